"""Experiment grids: one config names several experiments; shared upstream stages are computed once.

A config without `experiments` and `grid` is one experiment in the flat layout (`results/curated`,
`results/train/run`, `results/ifeval.json`, ...). Otherwise each experiment is the top-level config
with its overrides merged in (and each `grid` combination on top), and

- per-experiment stages (train, replay, generate_orpo, ifeval, judge, spin, plots) write under
  `results/<experiment>/`;
- shared stages (data, base, quantize, curate, render, generate_base, judge_prompts) write under
  `results/shared/<key>/`, where the key hashes the stage's own settings and the keys of the stages it
  reads. Experiments whose settings agree up to a stage get the same path, so Snakemake builds it once;
  a change upstream gives a new key (a new folder), never a clash.

Code versions are not part of a key: a code change reruns the stage in place (its `code` param).
"""

from __future__ import annotations

import copy
import hashlib
import itertools
import json
import re
from typing import Any

from orpo.folders import marker
from orpo.config import ConfigError, validate_config
from orpo.hub import is_hub_dataset

SETS = ("ifeval", "judge")
SHARED_STAGES = ("data", "base", "quantize", "curate", "render", "judge_prompts", "generate_base_ifeval",
                 "generate_base_judge")
RESERVED = ("shared", "paper")
NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")
KEY_CHARS = 10


def deep_merge(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    """`base` with `over` merged in: mappings merge key by key, anything else replaces."""
    out = copy.deepcopy(base)
    for key, value in over.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = deep_merge(out[key], value)
        else:
            out[key] = copy.deepcopy(value)
    return out


def _nested(dotted: str, value: Any) -> dict[str, Any]:
    node: Any = value
    for part in reversed(dotted.split(".")):
        node = {part: node}
    return node


def _slug(value: Any) -> str:
    text = value if isinstance(value, str) else json.dumps(value, sort_keys=True)
    return re.sub(r"[^A-Za-z0-9_.-]+", "-", text).strip("-") or "x"


def _combinations(grid: dict[str, list]) -> list[tuple[str, dict[str, Any]]]:
    """(name suffix, overrides) for every combination of the grid's values, in the grid's order."""
    if not grid:
        return [("", {})]
    out = []
    for values in itertools.product(*grid.values()):
        over: dict[str, Any] = {}
        parts = []
        for dotted, value in zip(grid, values):
            over = deep_merge(over, _nested(dotted, value))
            parts.append(f"{dotted.rsplit('.', 1)[-1]}{_slug(value)}")
        out.append(("_".join(parts), over))
    return out


def expand(config: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Experiment name -> its full, validated config; {"": config} when the config names none."""
    named = config.get("experiments") or {}
    grid = config.get("grid") or {}
    if not named and not grid:
        return {"": config}
    base = {k: v for k, v in config.items() if k not in ("experiments", "grid", "paper")}
    out: dict[str, dict[str, Any]] = {}
    for exp_name, overrides in (named or {"": {}}).items():
        for suffix, grid_over in _combinations(grid):
            name = "_".join(p for p in (exp_name, suffix) if p)
            if not NAME.match(name) or name in RESERVED:
                raise ConfigError(f"config error: experiments: {name!r} is not a usable experiment name "
                                  f"(letters, digits, _ . -; not {', '.join(RESERVED)})")
            if name in out:
                raise ConfigError(f"config error: experiments: two experiments are named {name!r}")
            merged = deep_merge(deep_merge(base, overrides or {}), grid_over)
            try:
                out[name] = validate_config(merged)
            except ConfigError as e:
                raise ConfigError(f"config error: experiment {name}: {str(e).removeprefix('config error: ')}") from None
    return out


def _key(stage: str, deps: dict[str, Any]) -> str:
    text = json.dumps({"stage": stage, **deps}, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:KEY_CHARS]


def prompt_rendering(cfg: dict[str, Any]) -> dict[str, Any]:
    """The render settings that shape a prompt's text (not lengths): generation renders the same way."""
    return {k: cfg["render"][k] for k in ("template", "template_kwargs", "date", "add_bos")}


def stage_keys(cfg: dict[str, Any]) -> dict[str, str]:
    """Each shared stage's key: a hash of its settings and of the keys (or user paths) of what it reads."""
    keys = {"data": _key("data", {"data": cfg["data"]})}
    raw = cfg["data"]["raw"] or keys["data"]
    keys["base"] = _key("base", {"base": cfg["base"], "raw": raw})
    model = cfg["model"]["path"] or cfg["model"]["hub_id"] or keys["base"]
    keys["quantize"] = _key("quantize", {"quantize": cfg["quantize"], "model": model})
    weights = keys["quantize"] if cfg["quantize"]["bits"] is not None else model  # what generation loads
    keys["curate"] = _key("curate", {"curate": cfg["curate"], "raw": raw, "model": model,
                                     "eval_prompts": cfg["eval"]["prompts"]})
    keys["render"] = _key("render", {"render": cfg["render"], "curated": keys["curate"], "model": model})
    judge = cfg["judge"]
    questions = judge["questions"] if judge["prompt_set"] == "mt_bench" else keys["curate"]
    keys["judge_prompts"] = _key("judge_prompts", {"prompt_set": judge["prompt_set"], "questions": questions})
    for name in SETS:
        prompts, limit = ((cfg["eval"]["prompts"], cfg["eval"]["limit"]) if name == "ifeval"
                          else (keys["judge_prompts"], judge["limit"]))
        keys[f"generate_base_{name}"] = _key(f"generate_base_{name}", {
            "generate": cfg["generate"], "render": prompt_rendering(cfg), "model": weights,
            "dtype": cfg["model"]["dtype"], "prompts": prompts, "limit": limit})
    return keys


class Layout:
    """Where each stage's outputs live for each experiment of a config (paths relative to the workdir)."""

    def __init__(self, config: dict[str, Any]):
        self.configs = expand(config)
        self.grid = list(self.configs) != [""]
        self._keys = {name: stage_keys(cfg) for name, cfg in self.configs.items()}
        self._owners: dict[str, str] = {}
        for name in self.configs:
            for stage in SHARED_STAGES:
                self._owners.setdefault(self.up(name, stage), name)

    # -- wildcards ---------------------------------------------------------------------------------
    def exp(self, name: str) -> str:
        """The `{exp}` wildcard value of a per-experiment stage: "" (flat layout) or "<name>/"."""
        return f"{name}/" if name else ""

    def up(self, name: str, stage: str) -> str:
        """The `{up}` wildcard value of a shared stage: "" (flat layout) or "shared/<key>/"."""
        return f"shared/{self._keys[name][stage]}/" if self.grid else ""

    def exp_regex(self) -> str:
        """Wildcard constraint of `{exp}`: exactly the experiments of this config."""
        return "|".join(re.escape(self.exp(n)) for n in self.configs) if self.grid else "(?:)"

    def up_regex(self) -> str:
        """Wildcard constraint of `{up}`: exactly the shared-stage prefixes of this config."""
        return "|".join(re.escape(p) for p in sorted(self._owners)) if self.grid else "(?:)"

    def name(self, exp: str) -> str:
        """The experiment of an `{exp}` wildcard value."""
        return exp[:-1] if exp else ""

    def owner(self, up: str) -> str:
        """An experiment that reads the shared stage at prefix `up` (all such agree on its settings)."""
        try:
            return self._owners[up]
        except KeyError:
            raise ConfigError(f"results/{up} belongs to no stage of this config's experiments") from None

    def config(self, name: str) -> dict[str, Any]:
        """The full config of one experiment."""
        return self.configs[name]

    # -- artifacts ---------------------------------------------------------------------------------
    def path(self, name: str, rel: str) -> str:
        """A per-experiment artifact: results/[<name>/]<rel>."""
        return f"results/{self.exp(name)}{rel}"

    def raw(self, name: str) -> str:
        """The raw rows as curate takes them: the user's file or hub id, or the data stage's output."""
        return self.configs[name]["data"]["raw"] or f"results/{self.up(name, 'data')}data/raw.jsonl"

    def raw_input(self, name: str) -> list[str]:
        """The raw rows as a Snakemake input (none for a hub id)."""
        raw = self.raw(name)
        return [] if is_hub_dataset(raw) else [raw]

    def embedded_model(self, name: str) -> bool:
        """True when the base stage builds the model (no model.path nor model.hub_id)."""
        model = self.configs[name]["model"]
        return not (model["path"] or model["hub_id"])

    def source_ref(self, name: str) -> str:
        """The base model as given (its tokenizer and template are what curate and render read): a folder or a
        hub id."""
        model = self.configs[name]["model"]
        if self.embedded_model(name):
            return f"results/{self.up(name, 'base')}base/model"
        return model["path"] or model["hub_id"]

    def source_input(self, name: str) -> list[str]:
        """The base model as a Snakemake input: the base stage's marker, the user's folder, none for a hub id."""
        model = self.configs[name]["model"]
        if self.embedded_model(name):
            return [marker(self.source_ref(name))]
        return [] if model["hub_id"] and not model["path"] else [self.source_ref(name)]

    def quantized(self, name: str) -> bool:
        """True when the quantize stage writes the weights every model-loading stage reads."""
        return self.configs[name]["quantize"]["bits"] is not None

    def model_ref(self, name: str) -> str:
        """The weights train, replay, generate and spin load: the quantize stage's folder, else the source."""
        if self.quantized(name):
            return f"results/{self.up(name, 'quantize')}quantized/model"
        return self.source_ref(name)

    def model_input(self, name: str) -> list[str]:
        """`model_ref` as a Snakemake input."""
        return [marker(self.model_ref(name))] if self.quantized(name) else self.source_input(name)

    def curated(self, name: str) -> str:
        """The curate stage's folder (train/validation pairs and manifest)."""
        return f"results/{self.up(name, 'curate')}curated"

    def rendered(self, name: str) -> str:
        """The render stage's folder (token ids and masks)."""
        return f"results/{self.up(name, 'render')}rendered"

    def judge_prompts(self, name: str) -> str:
        """The judge's questions as prompts for `orpo generate`."""
        return f"results/{self.up(name, 'judge_prompts')}judge/prompts.jsonl"

    def judge_questions(self, name: str) -> str:
        """The judge's question source as a Snakemake input: MT-Bench's question.jsonl or the curate stage's
        marker (its folder holds the validation prompts)."""
        judge = self.configs[name]["judge"]
        return judge["questions"] if judge["prompt_set"] == "mt_bench" else marker(self.curated(name))

    def prompt_set(self, name: str, which: str) -> tuple[str, int]:
        """(prompts file, limit) of a prompt set: the eval prompts or the judge's questions."""
        cfg = self.configs[name]
        if which == "ifeval":
            return cfg["eval"]["prompts"], cfg["eval"]["limit"]
        return self.judge_prompts(name), cfg["judge"]["limit"]

    def base_generations(self, name: str, which: str) -> str:
        """The base model's answers to a prompt set (shared across experiments)."""
        return f"results/{self.up(name, f'generate_base_{which}')}generations/{which}/base.jsonl"

    def benchmarks(self, name: str) -> dict[str, str]:
        """Rule -> benchmark file of every job behind this experiment's results/[<name>/]ifeval.json."""
        out = {}
        if not self.configs[name]["data"]["raw"]:
            out["data"] = f"benchmarks/{self.up(name, 'data')}data.tsv"
        if self.embedded_model(name):
            out["base"] = f"benchmarks/{self.up(name, 'base')}base.tsv"
        if self.quantized(name):
            out["quantize"] = f"benchmarks/{self.up(name, 'quantize')}quantize.tsv"
        out["curate"] = f"benchmarks/{self.up(name, 'curate')}curate.tsv"
        out["render"] = f"benchmarks/{self.up(name, 'render')}render.tsv"
        for rule in ("train", "replay"):
            out[rule] = f"benchmarks/{self.exp(name)}{rule}.tsv"
        out["generate_base_ifeval"] = f"benchmarks/{self.up(name, 'generate_base_ifeval')}generate_base_ifeval.tsv"
        out["generate_orpo_ifeval"] = f"benchmarks/{self.exp(name)}generate_orpo_ifeval.tsv"
        out["ifeval"] = f"benchmarks/{self.exp(name)}ifeval.tsv"
        return out

    def judged(self, name: str) -> bool:
        """True when the experiment configures a judge model (the judge stage can run)."""
        return bool(self.configs[name]["judge"]["model"])
