"""Experiment grids: experiments merge onto the config, shared stages are keyed by their settings and built once."""

import json
import re

import matplotlib.image
import pytest
import yaml
from conftest import ROOT
from test_workflow import MICRO, job_counts, micro_workflow, snakemake
from test_workflow_paper import tiny_paper_workflow

from orpo.config import ConfigError, validate_config
from orpo.experiments import Layout, expand, stage_keys

# one worker under pytest-xdist: these share the session's workflow runs
pytestmark = pytest.mark.xdist_group("workflow")

UPSTREAM = ("data", "base", "curate", "render", "generate_base_ifeval")


def outputs(result) -> list[str]:
    """Every output path of a dry run's job listing."""
    text = result.stdout + result.stderr
    return [p for line in re.findall(r"^\s+output: (.+)$", text, re.MULTILINE) for p in line.split(", ")]


def test_two_lambdas_compute_upstream_once_and_train_to_ifeval_twice(tmp_path):
    (tmp_path / "micro.yaml").write_text(yaml.safe_dump(MICRO))
    grid = {"experiments": {"lam01": {"train": {"lambda": 0.1}}, "lam05": {"train": {"lambda": 0.5}}}}
    (tmp_path / "grid.yaml").write_text(yaml.safe_dump(grid))
    result = snakemake(tmp_path, "-n", config=("micro.yaml", "grid.yaml"))
    assert result.returncode == 0, result.stderr[-3000:]
    assert job_counts(result) == {"data": 1, "base": 1, "curate": 1, "render": 1, "generate_base": 1,
                                  "train": 2, "replay": 2, "generate_orpo": 2, "ifeval": 2, "plots": 2, "summary_table": 1,
                                  "all": 1}
    paths = outputs(result)
    assert {"results/lam01/ifeval.json", "results/lam05/ifeval.json",
            "results/lam01/train/run/complete.json", "results/lam05/train/run/complete.json"} <= set(paths)
    shared = [p for p in paths if p.startswith("results/shared/")]
    assert len(shared) == 5 and all(re.match(r"results/shared/[0-9a-f]{10}/", p) for p in shared)


def test_the_objectives_grid_trains_each_objective_on_one_upstream(tmp_path):
    """config/experiments/objectives.yaml on the micro config: a run per experiment from one data, base and render,
    and the objectives table over them all."""
    (tmp_path / "micro.yaml").write_text(yaml.safe_dump(MICRO))
    grid = yaml.safe_load((ROOT / "config" / "experiments" / "objectives.yaml").read_text())
    (tmp_path / "grid.yaml").write_text(yaml.safe_dump(grid))
    result = snakemake(tmp_path, "-n", "results/objectives/table.md", config=("micro.yaml", "grid.yaml"))
    assert result.returncode == 0, result.stderr[-3000:]
    n = len(grid["experiments"])
    assert n >= 8 and job_counts(result) == {"data": 1, "base": 1, "curate": 1, "render": 1, "generate_base": 1,
                                             "train": n, "replay": n, "generate_orpo": n, "ifeval": n,
                                             "objectives_table": 1}
    objectives = {e["train"].get("objective") for e in grid["experiments"].values()}
    assert objectives == {"orpo", "orpo_margin", "simpo", "dpo"}


def test_a_grid_on_a_given_model_and_rows_plans_no_data_or_base(tmp_path_factory, tmp_path):
    """model.path and data.raw given (the micro run's): the grid plans no data or base stage, the rest as above."""
    micro = micro_workflow(tmp_path_factory)
    config = {**MICRO, "model": {"path": str(micro / "results" / "base" / "model")},
              "data": {"raw": str(micro / "results" / "data" / "raw.jsonl")},
              "experiments": {"lam01": {"train": {"lambda": 0.1}}, "lam05": {"train": {"lambda": 0.5, "seed": 1}}}}
    (tmp_path / "micro.yaml").write_text(yaml.safe_dump(config))
    result = snakemake(tmp_path, "-n", "results/summary.md")
    assert result.returncode == 0, result.stderr[-3000:]
    assert job_counts(result) == {"curate": 1, "render": 1, "generate_base": 1, "train": 2, "replay": 2,
                                  "generate_orpo": 2, "ifeval": 2, "summary_table": 1}


def test_a_grid_run_summarises_every_experiment(tmp_path_factory):
    """Two experiments trained for real (the tiny paper config's alpha and beta, a grid run once per session
    and shared with test_workflow_paper.py): results/summary.md holds each one's IFEval of base and trained
    model with 95% intervals, its validation accuracy and replay, and results/summary.png shows them side by side."""
    work, _, config = tiny_paper_workflow(tmp_path_factory)
    result = snakemake(work, "results/summary.md", config=config)
    assert result.returncode == 0, result.stderr[-3000:]
    md = (work / "results" / "summary.md").read_text()
    ifeval, other, name = {}, {}, None
    for line in md.splitlines():
        cells = [c.strip() for c in line.strip("|").split("|")] if line.startswith("| ") else []
        if len(cells) == 6 and cells[1] in ("base", "orpo", "orpo − base"):
            name = cells[0].strip("`") or name
            ifeval[(name, cells[1])] = cells[2:]
        elif len(cells) == 3 and cells[0].startswith("`"):
            other[cells[0].strip("`")] = cells[1:]
    assert {n for n, _ in ifeval} == set(other) == {"alpha", "beta"}
    metrics = ("prompt_level_strict_acc", "prompt_level_loose_acc", "inst_level_strict_acc", "inst_level_loose_acc")
    for name in ("alpha", "beta"):
        scores = json.loads((work / "results" / name / "ifeval.json").read_text())
        for label in ("base", "orpo"):
            m = scores["models"][label]
            assert ifeval[(name, label)] == [f"{m[k]:.3f} [{m['ci95'][k]['lo']:.3f}, {m['ci95'][k]['hi']:.3f}]"
                                             for k in metrics], (name, label)
        d = scores["differences"]["orpo-base"]
        assert ifeval[(name, "orpo − base")] == [f"{d[k]['estimate']:+.3f} [{d[k]['lo']:+.3f}, {d[k]['hi']:+.3f}]"
                                                 for k in metrics]
        index = json.loads((work / "results" / name / "train" / "run" / "index.json").read_text())
        step = index["final_step"]
        accuracy = index["checkpoints"][str(step)]["validation"]["accuracy"]
        assert other[name][0] == (f"{index['baseline']['accuracy']:.3f} at step 0 → {accuracy:.3f} at step {step} "
                                  "(final, scored)")
        assert other[name][1].startswith("equal: step ")
    assert "`results/alpha/plots/`" in md and "`results/beta/plots/`" in md
    image = matplotlib.image.imread(work / "results" / "summary.png")
    assert image.shape[0] > 300 and image.shape[1] > 1000


def full(config: dict) -> dict:
    return validate_config(yaml.safe_load(yaml.safe_dump(config)))


def test_no_experiments_is_the_flat_layout():
    layout = Layout(full(MICRO))
    assert not layout.grid and list(layout.configs) == [""]
    assert layout.curated("") == "results/curated" and layout.path("", "ifeval.json") == "results/ifeval.json"
    assert layout.model_ref("") == "results/base/model" and layout.raw("") == "results/data/raw.jsonl"


def test_experiments_merge_onto_the_config_and_a_grid_crosses_them():
    config = full({**MICRO, "experiments": {"h4": {"curate": {"recipe": "h4"}},
                                            "argilla": {"curate": {"recipe": "argilla_clean"}}},
                   "grid": {"train.lambda": [0.1, 0.5], "train.seed": [0, 1]}})
    exps = expand(config)
    assert len(exps) == 8 and "h4_lambda0.1_seed0" in exps and "argilla_lambda0.5_seed1" in exps
    e = exps["argilla_lambda0.5_seed1"]
    assert (e["curate"]["recipe"], e["train"]["lambda"], e["train"]["seed"]) == ("argilla_clean", 0.5, 1)
    # Untouched keys keep the top-level values, defaults included.
    assert e["train"]["lora"] == config["train"]["lora"] and e["data"] == config["data"]


def test_shared_stage_keys_follow_exactly_the_settings_each_stage_reads():
    base = full(MICRO)
    lam = stage_keys(full({**MICRO, "train": {**MICRO["train"], "lambda": 0.5}}))
    assert lam == stage_keys(base)  # training settings reach no shared stage
    recipe = stage_keys(full({**MICRO, "curate": {**MICRO["curate"], "recipe": "argilla_clean"}}))
    changed = {k for k in recipe if recipe[k] != stage_keys(base)[k]}
    # The judge's questions are the curated validation prompts; the base model and its IFEval answers stay.
    assert changed == {"curate", "render", "judge_prompts", "generate_base_judge"}
    rows = stage_keys(full({**MICRO, "data": {"rows": 100}}))
    assert all(rows[k] != stage_keys(base)[k] for k in UPSTREAM)  # new data: a new base model, everything after


@pytest.mark.parametrize(
    "experiments, message",
    [
        ({"a": {"train": {"lrr": 1}}}, "experiment a: unknown key train.lrr"),
        ({"b": {"train": {"lambda": "x"}}}, "experiment b: train.lambda: 'x' is not of type 'number'"),
        ({"shared": {}}, "'shared' is not a usable experiment name"),
    ],
)
def test_a_bad_experiment_is_named_in_the_error(experiments, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        expand(full({**MICRO, "experiments": experiments}))


def test_a_bad_experiment_stops_the_workflow_with_its_name(tmp_path):
    (tmp_path / "micro.yaml").write_text(yaml.safe_dump({**MICRO, "experiments": {"a": {"train": {"lrr": 1}}}}))
    result = snakemake(tmp_path, "-n")
    assert result.returncode != 0 and "experiment a: unknown key train.lrr" in result.stdout + result.stderr
