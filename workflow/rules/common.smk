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
}


def settings(section):
    """A config section as canonical JSON: the rule's param, so any change in it reruns the rule."""
    return json.dumps(config[section], sort_keys=True)


def prompt_rendering():
    """The render settings that shape a prompt's text (not lengths): generation must render the same way."""
    return json.dumps({k: config["render"][k] for k in ("template", "template_kwargs")}, sort_keys=True)


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

