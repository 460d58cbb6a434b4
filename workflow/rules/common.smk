# Config validation, experiments, input/param functions and stage code versions. Rules stay one-liners.
#
# Paths carry two wildcards (orpo/experiments.py, docs/reproducibility.md): {exp} on per-experiment stages
# ("" in the flat layout of a single experiment, "<name>/" with experiments) and {up} on shared stages ("" or
# "shared/<key>/", the key a hash of the stage's settings). Input and param functions map a job's wildcard
# back to an experiment's config: per_exp(f) calls f(experiment name), shared(f) an experiment reading it.
import hashlib
import json
import os
import sys

from orpo.config import SPIN_DAG_KEYS, ConfigError, validate_config
from orpo.folders import MARKER, marker
from orpo.experiments import Layout, prompt_rendering
from orpo.io import write_text
from orpo.versions import code_version

try:
    validate_config(config)
    L = Layout(config)
except ConfigError as e:
    raise WorkflowError(str(e)) from None

# A prompt set given as an HF-style dataset folder or a hub:OWNER/NAME id is normalised once to a jsonl (rules
# eval_prompts, mt_bench_questions: a download is then cached like any output); every rule reads that jsonl
# through the same config key, as it reads a local jsonl. PROMPT_SOURCES keeps the sources as given.
PROMPT_SOURCES = {"eval": config["eval"]["prompts"], "judge": config["judge"]["questions"]}
NORMALISED_PROMPTS = {"eval": "results/eval/ifeval_prompts.jsonl", "judge": "results/judge/mt_bench_questions.jsonl"}
for _cfg in [config, *L.configs.values()]:
    for _section, _key in (("eval", "prompts"), ("judge", "questions")):
        _source = _cfg[_section][_key]
        if _source and not (_source.endswith(".jsonl") and os.path.isfile(_source)):
            if _source not in (PROMPT_SOURCES[_section], NORMALISED_PROMPTS[_section]):
                raise WorkflowError(f"config error: {_section}.{_key}: an experiment may set a local .jsonl; "
                                    f"a folder or hub id ({_source}) goes in the top-level config")
            _cfg[_section][_key] = NORMALISED_PROMPTS[_section]


def folder(path):
    """The folder a rule reads or writes: a declared marker's parent (orpo/folders.py), else the path itself."""
    return os.path.dirname(path) if os.path.basename(path) == MARKER else path


def source_input(source):
    """A prompt source as a Snakemake input: the local file or folder; none for a hub id (or no source)."""
    return [source] if source and not source.startswith("hub:") else []


# A stage's warnings and notes, printed to the console as well as kept in its log (the rest stays in the log).
CONSOLE_NOTES = "(grep -hE '^orpo [a-z]+: (warning|note):' {log} >&2 || true)"

# The rules call the `orpo` command of the Python that runs Snakemake (a venv need not be activated).
os.environ["PATH"] = os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", "")

# What each stage's code is: rerun a stage when the package modules it imports change.
MLX = ("mlx", "mlx-lm")
CODE = {
    "data": code_version("orpo.data.synth"),
    "curate": code_version("orpo.curate.core"),
    "base": code_version("orpo.base.model", dists=MLX),
    "quantize": code_version("orpo.base.quantize", dists=MLX),
    "render": code_version("orpo.render.pairs"),
    "train": code_version("orpo.train.trainer", dists=MLX),
    "generate": code_version("orpo.eval.generate", dists=MLX),
    "ifeval": code_version("orpo.eval.ifeval.compare"),
    "judge": code_version("orpo.eval.judge.core", dists=MLX),
    "spin": code_version("orpo.spin.core", dists=MLX),
    "report": code_version("orpo.report.plots", "orpo.report.tables", dists=("matplotlib",)),
    "summary": code_version("orpo.report.summary", dists=("matplotlib",)),
    "objectives": code_version("orpo.report.objectives", dists=("matplotlib",)),
}


wildcard_constraints:
    exp=L.exp_regex(),
    up=L.up_regex(),


def per_exp(fn):
    """An input/param function of a per-experiment job: fn(experiment name)."""
    return lambda wildcards: fn(L.name(wildcards.exp))


def shared(fn):
    """An input/param function of a shared job: fn(an experiment that reads it)."""
    return lambda wildcards: fn(L.owner(wildcards.up))


SETTINGS_DIR = "results/settings"


def settings_file(kind, value):
    """`value` as canonical JSON in results/settings/<kind>-<its sha256>.json (written when missing): the path a
    rule takes as a param and passes as `--settings @PATH`. Commands stay short; the name is the content's hash,
    so any change in the settings changes the param (the job reruns) and no job reads another's settings."""
    text = json.dumps(value, sort_keys=True)
    path = f"{SETTINGS_DIR}/{kind}-{hashlib.sha256(text.encode()).hexdigest()[:16]}.json"
    if not os.path.exists(path):
        write_text(path, text + "\n")
    return path


def section(name, key):
    """One experiment's config section as a settings file: the rule's param, so any change in it reruns the rule."""
    return settings_file(key, L.config(name)[key])


def rendering(name):
    """The render settings that shape a prompt's text, as a settings file: generation renders the same way."""
    return settings_file("prompt-rendering", prompt_rendering(L.config(name)))


def model_dtype(name):
    """model.dtype, the dtype every stage that loads the model computes in (`--dtype`)."""
    return L.config(name)["model"]["dtype"]


def report_group(wildcards):
    """An experiment's subcategory in the HTML report: its name; none in the flat layout (an empty name blanks
    the report's result pages)."""
    return L.name(wildcards.exp) or None


def experiment_targets(rel):
    """results/[<name>/]<rel> for every experiment of the config."""
    return [L.path(name, rel) for name in L.configs]




def spin_settings(name):
    """config.spin minus the DAG keys, as a settings file: the spin core's settings."""
    return settings_file("spin", {k: v for k, v in L.config(name)["spin"].items() if k not in SPIN_DAG_KEYS})


def spin_sft_arg(name):
    """What `orpo spin --sft` reads: spin.sft (file, folder or hub id), or the curate stage's train split."""
    return L.config(name)["spin"]["sft"] or f"{L.curated(name)}/train.parquet"


def spin_sft_input(name):
    """spin.sft as a Snakemake input (none for a hub id); the default needs the curate stage's folder."""
    sft = L.config(name)["spin"]["sft"]
    if sft is None:
        return [marker(L.curated(name))]
    return [sft] if os.path.exists(sft) else []


def spin_adapter(wildcards):
    """The generator of iteration k: iteration k-1's run; iteration 1: spin.adapter, or the base model."""
    k = int(wildcards.k)
    if k > 1:
        return [marker(f"results/{wildcards.exp}spin/iter{k - 1}/run")]
    adapter = L.config(L.name(wildcards.exp))["spin"]["adapter"]
    return [adapter] if adapter else []


def spin_train_settings(wildcards):
    """config.train warm-started from the generator's adapter: iteration k trains on from iteration k-1."""
    previous = spin_adapter(wildcards)
    train = L.config(L.name(wildcards.exp))["train"]
    return settings_file("train", {**train, "init_adapter": folder(previous[0]) if previous else None})
