"""Load and validate the pipeline config against the schema shipped in the package (orpo/config.schema.yaml)."""

from __future__ import annotations

import copy
import datetime
import functools
import os
import re
from pathlib import Path
from typing import Any

import jsonschema
import yaml

from orpo.hub import is_hub_dataset
from orpo.io import InputError
from orpo.rows import data_files

PROJECT_ROOT = Path(__file__).resolve().parent.parent
# Keys of config.spin that shape the DAG (how many iterations, what they start from), not the spin stage.
SPIN_DAG_KEYS = ("iterations", "sft", "adapter")
# Keys of config.render only the render stage reads (lengths, samples); the others shape a prompt's text.
RENDER_STAGE_KEYS = ("max_length", "max_prompt_length", "over_length", "samples")
SCHEMA_PATH = Path(__file__).resolve().parent / "config.schema.yaml"  # package data: works installed, not only editable
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


_INT = re.compile(r"[-+]?[0-9]+")
_FLOAT = re.compile(r"[-+]?(\.[0-9]+|[0-9]+(\.[0-9]*)?)([eE][-+]?[0-9]+)?")
_BOOL = {"true": True, "false": False}


def _accepts(schema: dict[str, Any]) -> tuple[set[str], list[Any]]:
    """The JSON types and the literal values (enum, const) a scalar schema node accepts, anyOf/oneOf included."""
    types = schema.get("type", [])
    types, literals = set([types] if isinstance(types, str) else types), list(schema.get("enum", []))
    if "const" in schema:
        literals.append(schema["const"])
    for branch in schema.get("anyOf", []) + schema.get("oneOf", []):
        t, lit = _accepts(branch)
        types |= t
        literals += lit
    return types, literals


def _reading(text: str, schema: dict[str, Any]) -> Any:
    """What a string means where the schema wants a number, integer, boolean or null (YAML 1.2 core rules).

    PyYAML (YAML 1.1) reads 1e-3 as a string, and Snakemake's --config reads nested values as strings;
    a string the node already accepts, or one that reads as nothing it accepts, is returned unchanged.
    """
    types, literals = _accepts(schema)
    if "string" in types or text in literals:
        return text
    word = text.strip()
    if {"integer", "number"} & types and _INT.fullmatch(word):
        return int(word)
    if {"integer", "number"} & types and _FLOAT.fullmatch(word):
        value = float(word)
        if "number" in types:
            return value
        if value.is_integer():
            return int(value)
    if word.lower() in _BOOL and ("boolean" in types or _BOOL[word.lower()] in literals):
        return _BOOL[word.lower()]
    if word in ("null", "Null", "NULL", "~") and ("null" in types or None in literals):
        return None
    return text


def _coerce(node: Any, schema: dict[str, Any]) -> Any:
    """`node` with its scalar strings read as numbers, booleans or null where the schema wants them (in place)."""
    if isinstance(node, str):
        return _reading(node, schema)
    if isinstance(node, datetime.date) and "string" in _accepts(schema)[0]:
        return node.isoformat()  # YAML reads an unquoted 2024-07-26 as a date
    if isinstance(node, dict):
        props, extra = schema.get("properties", {}), schema.get("additionalProperties")
        for key, value in node.items():
            sub = props.get(key, extra if isinstance(extra, dict) else None)
            if sub is not None:
                node[key] = _coerce(value, sub)
    elif isinstance(node, list) and isinstance(schema.get("items"), dict):
        node[:] = [_coerce(v, schema["items"]) for v in node]
    return node


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


def _check(instance: dict[str, Any], schema: dict[str, Any], prefix: str) -> None:
    """Raise one ConfigError listing every schema violation, each by its dotted key."""
    errors = sorted(jsonschema.Draft202012Validator(schema).iter_errors(instance), key=lambda e: list(e.absolute_path))
    if errors:
        raise ConfigError(f"{prefix}: " + "; ".join(_describe(e) for e in errors))


def validate_settings(section: str, settings: dict[str, Any], drop: tuple[str, ...] = (),
                      what: str = "--settings") -> dict[str, Any]:
    """Check one stage's settings against the schema's `section` (less the keys in `drop`), as the workflow would.

    Strings are read as numbers where the schema wants them (in place); unknown keys and wrong types raise
    ConfigError naming the dotted key. Defaults stay the stage's to fill.
    """
    sub = copy.deepcopy(load_schema()["properties"][section])
    for key in drop:
        sub.get("properties", {}).pop(key, None)
    _coerce(settings, sub)
    _check({section: settings}, {"type": "object", "properties": {section: sub}}, what)
    return settings


def load_config_file(path: str | os.PathLike) -> dict[str, Any]:
    """A YAML (or JSON) config file as a mapping; a syntax error raises ConfigError naming file:line:column."""
    try:
        text = Path(path).read_text(encoding="utf-8")
        value = yaml.safe_load(text)
    except yaml.MarkedYAMLError as e:
        mark = e.problem_mark or e.context_mark
        where = f"{path}:{mark.line + 1}:{mark.column + 1}" if mark else str(path)
        raise ConfigError(f"config error: {where}: not valid YAML: {e.problem or e.context}") from None
    except (OSError, UnicodeDecodeError, yaml.YAMLError) as e:
        raise ConfigError(f"config error: {path}: {e}") from None
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise ConfigError(f"config error: {path}: expected a mapping of config keys, got {type(value).__name__}")
    return value


def _recorded(p: Path, base: Path) -> str:
    """`p` relative to `base` when inside it, else absolute: rule params then survive a moved checkout."""
    absolute, root = os.path.abspath(p), os.path.abspath(base)
    return os.path.relpath(absolute, root) if Path(absolute).is_relative_to(root) else absolute


def validate_config(config: dict[str, Any], base_dir: str | os.PathLike | None = None) -> dict[str, Any]:
    """Fill defaults into `config` in place and check it; raise ConfigError naming the key or path.

    Strings are read as numbers where the schema wants numbers (YAML 1.1's 1e-3, Snakemake's nested --config).
    Relative paths resolve against `base_dir` (the working directory by default) and paths inside it are
    recorded relative to it, so a moved or re-cloned checkout gives the same rule params.
    """
    schema = load_schema()
    _coerce(config, schema)
    _fill_defaults(config, schema)
    _check(config, schema, "config error")
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
        return _recorded(p, base)

    def source(key: str, value: str | None) -> str | None:  # eval prompt sets: a hub id is checked when loaded
        return value if value and value.startswith("hub:") else existing(key, value)

    model = config["model"]
    if model["path"] and model["hub_id"]:
        raise ConfigError("config error: model.path and model.hub_id are both set; give one")
    model["path"] = existing("model.path", model["path"], need="config.json")
    raw = config["data"]["raw"]  # a path, or a hub id (owner/name[:split]) that curate loads
    config["data"]["raw"] = raw if raw and is_hub_dataset(raw, base) else existing("data.raw", raw)
    if config["data"]["raw"] and not is_hub_dataset(config["data"]["raw"], base):
        try:  # every stage that reads raw rows takes these forms (orpo.rows): refuse others before any job runs
            data_files(str(base / config["data"]["raw"]))
        except InputError as e:
            raise ConfigError(f"config error: data.raw: {e}") from None
    config["eval"]["prompts"] = source("eval.prompts", config["eval"]["prompts"]) or _recorded(EMBEDDED_EVAL_PROMPTS, base)
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
    if config["curate"]["validation_fraction"] == 0:  # no validation split: no checkpoint is chosen by it
        for key, value in (("replay.checkpoint", config["replay"]["checkpoint"]),
                           ("generate.adapter", config["generate"]["adapter"])):
            if value in ("best_margin", "best_loss"):
                raise ConfigError(f"config error: {key}: {value} is chosen by validation, and "
                                  "curate.validation_fraction is 0 (no validation pairs): use final or a step number")
    if config["quantize"]["bits"] is not None and config["train"]["method"] == "full":
        raise ConfigError("config error: quantize.bits: a quantized base trains only its LoRA adapters, and "
                          "train.method is full; set quantize.bits: null or train.method: lora")
    if config["render"]["max_prompt_length"] >= config["render"]["max_length"]:
        raise ConfigError("config error: render.max_prompt_length must be smaller than render.max_length")
    return config
