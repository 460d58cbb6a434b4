# Config validation, input/param functions and stage code versions. Rules stay one-liners.
import json
import os
import sys

from orpo.config import ConfigError, validate_config
from orpo.versions import code_version

try:
    validate_config(config)
except ConfigError as e:
    raise WorkflowError(str(e)) from None

# The rules call the `orpo` command of the Python that runs Snakemake (a venv need not be activated).
os.environ["PATH"] = os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", "")

# What each stage's code is: rerun a stage when the package modules it imports change.
MLX = ("mlx", "mlx-lm")
CODE = {
    "data": code_version("orpo.data.synth"),
    "curate": code_version("orpo.curate.core"),
    "base": code_version("orpo.base.model", dists=MLX),
    "render": code_version("orpo.render.pairs"),
    "train": code_version("orpo.train.trainer", dists=MLX),
    "generate": code_version("orpo.eval.generate", dists=MLX),
    "ifeval": code_version("orpo.eval.ifeval.compare"),
    "judge": code_version("orpo.eval.judge.core", dists=MLX),
    "spin": code_version("orpo.spin.core", dists=MLX),
}


def settings(section):
    """A config section as canonical JSON: the rule's param, so any change in it reruns the rule."""
    return json.dumps(config[section], sort_keys=True)


def prompt_rendering():
    """The render settings that shape a prompt's text (not lengths): generation must render the same way."""
    return json.dumps({k: config["render"][k] for k in ("template", "template_kwargs")}, sort_keys=True)


def judge_questions():
    """The judge's question source: MT-Bench's question.jsonl or the curated validation prompts."""
    j = config["judge"]
    return j["questions"] if j["prompt_set"] == "mt_bench" else "results/curated"


def prompt_set_file(name):
    return config["eval"]["prompts"] if name == "ifeval" else "results/judge/prompts.jsonl"


def prompt_set_limit(name):
    return config["eval"]["limit"] if name == "ifeval" else config["judge"]["limit"]


def raw_rows():
    return config["data"]["raw"] or "results/data/raw.jsonl"


def embedded_model():
    return not (config["model"]["path"] or config["model"]["hub_id"])


def model_ref():
    """The base model as the `orpo` commands take it: a folder or a hub id."""
    if embedded_model():
        return "results/base/model"
    return config["model"]["path"] or config["model"]["hub_id"]


def model_input():
    """The base model as a Snakemake input (none for a hub id)."""
    return [] if config["model"]["hub_id"] and not config["model"]["path"] else [model_ref()]



SPIN_DAG_KEYS = ("iterations", "sft", "adapter")


def spin_settings():
    """config.spin minus the DAG keys, as canonical JSON: the spin core's settings."""
    return json.dumps({k: v for k, v in config["spin"].items() if k not in SPIN_DAG_KEYS}, sort_keys=True)


def spin_sft_arg():
    """What `orpo spin --sft` reads: spin.sft (file, folder or hub id), or the curate stage's train split."""
    return config["spin"]["sft"] or "results/curated/train.parquet"


def spin_sft_input():
    """spin.sft as a Snakemake input (none for a hub id); the default needs the curate stage's folder."""
    sft = config["spin"]["sft"]
    if sft is None:
        return ["results/curated"]
    return [sft] if os.path.exists(sft) else []


def spin_adapter(wildcards):
    """The generator of iteration k: iteration k-1's run; iteration 1: spin.adapter, or the base model."""
    k = int(wildcards.k)
    if k > 1:
        return [f"results/spin/iter{k - 1}/run"]
    return [config["spin"]["adapter"]] if config["spin"]["adapter"] else []


def spin_train_settings(wildcards):
    """config.train warm-started from the generator's adapter: iteration k trains on from iteration k-1."""
    previous = spin_adapter(wildcards)
    return json.dumps({**config["train"], "init_adapter": previous[0] if previous else None}, sort_keys=True)
