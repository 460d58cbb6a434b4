"""Load and validate the pipeline config against workflow/schemas/config.schema.yaml, filling defaults."""

from __future__ import annotations

import copy
import functools
import os
from pathlib import Path
from typing import Any

import jsonschema
import yaml

from orpo.hub import is_hub_dataset

PROJECT_ROOT = Path(__file__).resolve().parent.parent
SCHEMA_PATH = PROJECT_ROOT / "workflow" / "schemas" / "config.schema.yaml"
EMBEDDED_EVAL_PROMPTS = PROJECT_ROOT / "data" / "eval" / "ifeval_prompts.jsonl"


class ConfigError(ValueError):
    """A config problem, naming the key (dotted path) or the file."""


@functools.lru_cache(maxsize=1)
def _schema_text() -> str:
    return SCHEMA_PATH.read_text()


def load_schema() -> dict[str, Any]:
    """The config JSON schema (a fresh copy)."""
    return yaml.safe_load(_schema_text())


def section_defaults(section: str) -> dict[str, Any]:
    """The schema's defaults for one config section: the single source of every stage's defaults."""
    node: dict[str, Any] = {}
    _fill_defaults(node, load_schema()["properties"][section])
    return node


def _fill_defaults(node: dict[str, Any], schema: dict[str, Any]) -> None:
    for key, sub in schema.get("properties", {}).items():
        if key not in node and "default" in sub:
            node[key] = copy.deepcopy(sub["default"])
        if isinstance(node.get(key), dict) and sub.get("type") == "object":
            _fill_defaults(node[key], sub)


def _dotted(path: Any) -> str:
    return ".".join(str(p) for p in path) or "(top level)"


def _describe(err: jsonschema.ValidationError) -> str:
    where = _dotted(err.absolute_path)
    if err.validator == "additionalProperties":
        allowed = sorted(err.schema.get("properties", {}))
        extra = sorted(set(err.instance) - set(allowed))
        prefix = "" if not err.absolute_path else where + "."
        return f"unknown key {', '.join(prefix + e for e in extra)} (allowed here: {', '.join(allowed)})"
    return f"{where}: {err.message}"


def validate_config(config: dict[str, Any], base_dir: str | os.PathLike | None = None) -> dict[str, Any]:
    """Fill defaults into `config` in place and check it; raise ConfigError naming the key or path.

    Relative paths resolve against `base_dir` (the working directory by default).
    """
    schema = load_schema()
    _fill_defaults(config, schema)
    errors = sorted(jsonschema.Draft202012Validator(schema).iter_errors(config), key=lambda e: list(e.absolute_path))
    if errors:
        raise ConfigError("config error: " + "; ".join(_describe(e) for e in errors))
    base = Path(base_dir or os.getcwd())

    def existing(key: str, value: str | None, need: str | None = None) -> str | None:
        if value is None:
            return None
        p = Path(value).expanduser()
        p = p if p.is_absolute() else base / p
        if not p.exists():
            raise ConfigError(f"config error: {key}: {value} does not exist")
        if need and not (p / need).exists():
            raise ConfigError(f"config error: {key}: {value} has no {need} (expected an HF-style model folder)")
        return str(p)

    def source(key: str, value: str | None) -> str | None:  # eval prompt sets: a hub id is checked when loaded
        return value if value and value.startswith("hub:") else existing(key, value)

    model = config["model"]
    if model["path"] and model["hub_id"]:
        raise ConfigError("config error: model.path and model.hub_id are both set; give one")
    model["path"] = existing("model.path", model["path"], need="config.json")
    raw = config["data"]["raw"]  # a path, or a hub id (owner/name[:split]) that curate loads
    config["data"]["raw"] = raw if raw and is_hub_dataset(raw, base) else existing("data.raw", raw)
    config["eval"]["prompts"] = source("eval.prompts", config["eval"]["prompts"]) or str(EMBEDDED_EVAL_PROMPTS)
    config["curate"]["truthfulqa_questions"] = existing("curate.truthfulqa_questions", config["curate"]["truthfulqa_questions"])
    config["render"]["template"] = existing("render.template", config["render"]["template"])
    config["judge"]["prompts_file"] = existing("judge.prompts_file", config["judge"]["prompts_file"])
    config["judge"]["questions"] = source("judge.questions", config["judge"]["questions"])
    if config["judge"]["prompt_set"] == "mt_bench" and not config["judge"]["questions"]:
        raise ConfigError("config error: judge.questions: needed with judge.prompt_set mt_bench (MT-Bench's question.jsonl)")
    config["train"]["init_adapter"] = existing("train.init_adapter", config["train"]["init_adapter"])
    spin = config["spin"]
    if spin["adapter"]:
        spin["adapter"] = existing("spin.adapter", spin["adapter"])
    if spin["sft"] and (os.sep in spin["sft"] or Path(spin["sft"]).suffix or (base / spin["sft"]).exists()):
        spin["sft"] = existing("spin.sft", spin["sft"])  # a path; anything else is taken as a hub id
    if config["render"]["max_prompt_length"] >= config["render"]["max_length"]:
        raise ConfigError("config error: render.max_prompt_length must be smaller than render.max_length")
    return config
