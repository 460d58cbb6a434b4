"""The real Snakemake workflow on a micro config in a temp dir: outputs, no-op rerun, exact param reruns.

The micro run uses a copy of the repository (Snakefile, rules and the `orpo` package, found first through
PYTHONPATH), made once per session and shared with tests/test_workflow_*.py: tests there edit its code, and
other people's edits to this checkout cannot change its code versions halfway through.
"""

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from conftest import ROOT, TINY_BASE, TINY_TRAIN

# one worker under pytest-xdist: these share the session's workflow runs
pytestmark = pytest.mark.xdist_group("workflow")

MICRO = {
    "data": {"rows": 120},
    "eval": {"limit": 6},
    "curate": {"validation_fraction": 0.1, "decontam_threshold": 0.8},
    "base": TINY_BASE,
    "render": {"max_length": 256, "max_prompt_length": 96},
    "train": {**TINY_TRAIN, "max_steps": 8},
    "generate": {"max_tokens": 24, "batch_size": 8},
}
_REPO_OF: dict[Path, Path] = {}  # workdir -> the repository copy whose Snakefile and package it runs
_SESSION: dict[str, Path] = {}


def copy_repo(dest: Path) -> Path:
    """The repository as a checkout holds it (tracked and untracked files git does not ignore) under dest."""
    listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                            capture_output=True, check=True).stdout.decode().split("\0")
    for rel in filter(None, listed):
        src = ROOT / rel
        if src.is_file():  # a tracked file deleted in the working tree is not part of it
            (dest / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest / rel)
    return dest


def workspace(repo: Path, workdir: Path) -> Path:
    """Register workdir's runs to use repo's Snakefile and package; returns workdir."""
    workdir.mkdir(parents=True, exist_ok=True)
    _REPO_OF[workdir] = repo
    return workdir


def snakemake(workdir, *args, config=("micro.yaml",)):
    repo = _REPO_OF.get(Path(workdir), ROOT)
    cmd = [sys.executable, "-m", "snakemake", "--snakefile", str(repo / "Snakefile"), "--directory", str(workdir),
           "--configfile", *(str(Path(workdir) / c) for c in config), "--cores", "2", *args]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(repo), os.environ.get("PYTHONPATH")]))}
    # cwd = workdir: `python -m` puts the cwd first on sys.path, and this checkout's cwd would shadow the copy.
    return subprocess.run(cmd, capture_output=True, text=True, timeout=900, env=env, cwd=workdir, check=False)


def job_counts(result) -> dict[str, int]:
    """Rule -> job count from the job table Snakemake prints (dry run or real run); empty when nothing to do."""
    text = result.stdout + result.stderr
    if "Nothing to be done" in text:
        return {}
    table = text.split("Job stats:", 1)[1].split("\n\n", 1)[0]
    return {m.group(1): int(m.group(2)) for m in re.finditer(r"^(\w+)\s+(\d+)$", table, re.MULTILINE)
            if m.group(1) not in ("total", "job")}


def planned_rules(result):
    """Rule names of the dry-run's job table."""
    return set(job_counts(result))


def session_repo(tmp_path_factory) -> Path:
    """The session's copy of the repository (made once)."""
    if "repo" not in _SESSION:
        _SESSION["repo"] = copy_repo(tmp_path_factory.mktemp("repo"))
    return _SESSION["repo"]


def micro_workflow(tmp_path_factory) -> Path:
    """The micro run of results/ifeval.json in the session's repository copy, once per session (its workdir)."""
    if "workdir" not in _SESSION:
        workdir = workspace(session_repo(tmp_path_factory), tmp_path_factory.mktemp("wf"))
        (workdir / "micro.yaml").write_text(yaml.safe_dump(MICRO))
        result = snakemake(workdir, "results/ifeval.json")
        assert result.returncode == 0, result.stderr[-4000:]
        _SESSION["workdir"] = workdir
    return _SESSION["workdir"]


@pytest.fixture(scope="session")
def workflow_run(tmp_path_factory):
    return micro_workflow(tmp_path_factory)


def test_end_to_end_outputs(workflow_run):
    results = json.loads((workflow_run / "results" / "ifeval.json").read_text())
    assert results["prompts"] == 6
    assert set(results["models"]) == {"base", "orpo"}
    for m in results["models"].values():
        for key in ("prompt_level_strict_acc", "inst_level_strict_acc", "prompt_level_loose_acc", "inst_level_loose_acc"):
            assert 0.0 <= m[key] <= 1.0
        assert m["prompts"] == 6
    assert "orpo-base" in results["differences"]
    replay = json.loads((workflow_run / "results" / "train" / "replay.json").read_text())
    assert replay["equal"] and replay["expected_sha256"] == replay["replayed_sha256"]
    gens = [json.loads(x) for x in (workflow_run / "results" / "generations" / "ifeval" / "orpo.jsonl").read_text().splitlines()]
    assert len(gens) == 6 and all(g["adapter"] for g in gens)
    manifest = json.loads((workflow_run / "results" / "curated" / "manifest.json").read_text())
    dropped = sum(v["count"] for v in manifest["dropped"].values())
    assert manifest["input_rows"] == 120 == manifest["output_rows"]["total"] + dropped
    for rule in ("data", "base", "curate", "render", "train", "replay", "generate_base_ifeval", "generate_orpo_ifeval",
                 "ifeval"):
        assert (workflow_run / "logs" / f"{rule}.log").exists(), rule


def test_judge_rules_against_a_real_server(workflow_run):
    from test_judge import JUDGE_PROMPTS, ScriptedJudgeServer

    server = ScriptedJudgeServer()
    try:
        judge = {"kind": "openai", "model": "scripted-judge", "base_url": server.url, "limit": 4,
                 "prompts_file": str(JUDGE_PROMPTS), "template": "pair-v2", "backoff_s": 0.01, "n_resamples": 100}
        (workflow_run / "judge.yaml").write_text(yaml.safe_dump({**MICRO, "judge": judge}))
        # The judge's summary and, from it, its figure and table for the report (rule judge_plot): one run.
        result = snakemake(workflow_run, "results/judge/summary.json", "results/plots/judge.png", config=("judge.yaml",))
        assert result.returncode == 0, result.stderr[-3000:]
        assert (workflow_run / "results" / "plots" / "judge.html").read_text().count("<tr>") == 1 + 5 + 4
    finally:
        server.close()
    summary = json.loads((workflow_run / "results" / "judge" / "summary.json").read_text())
    # The scripted judge prefers whichever answer sits in slot B: every question comes out inconsistent.
    assert summary["counts"]["inconsistent"] == 4 and len(server.requests) == 8
    verdicts = (workflow_run / "results" / "judge" / "verdicts.jsonl").read_text().splitlines()
    assert len(verdicts) == 8


def test_spin_iterations_chain_each_on_the_previous_run(tmp_path):
    """`snakemake spin` with two iterations: iteration 2 generates with iteration 1's run as its adapter."""
    (tmp_path / "micro.yaml").write_text(yaml.safe_dump({**MICRO, "spin": {"iterations": 2}}))
    result = snakemake(tmp_path, "-n", "-p", "spin")
    assert result.returncode == 0, result.stderr[-3000:]
    assert job_counts(result)["spin_pairs"] == 2
    assert re.search(r"orpo spin .*--adapter results/spin/iter1/run .*--iteration 2 ", result.stdout + result.stderr)


def test_spin_iteration_runs_in_the_dag_and_its_pairs_train(workflow_run):
    spin = {"limit": 24, "max_tokens": 24, "validation_fraction": 0.2}
    (workflow_run / "spin.yaml").write_text(yaml.safe_dump({**MICRO, "spin": spin}))
    result = snakemake(workflow_run, "results/spin/iter1/run/complete.json", config=("spin.yaml",))
    assert result.returncode == 0, result.stderr[-3000:]
    manifest = json.loads((workflow_run / "results" / "spin" / "iter1" / "pairs" / "manifest.json").read_text())
    dropped = sum(v["count"] for v in manifest["dropped"].values())
    assert manifest["iteration"] == 1 and manifest["output_rows"]["total"] > 0
    assert manifest["input_rows"] == manifest["output_rows"]["total"] + dropped
    index = json.loads((workflow_run / "results" / "spin" / "iter1" / "run" / "index.json").read_text())
    assert index["final_step"] > 0 and index["checkpoints"]


@pytest.mark.parametrize(
    "section, key, value, reruns",
    [
        ("train", "lr", 0.002, {"train", "replay", "generate_orpo", "ifeval"}),
        ("render", "max_prompt_length", 80, {"render", "train", "replay", "generate_orpo", "ifeval"}),
        ("generate", "max_tokens", 20, {"generate_base", "generate_orpo", "ifeval"}),
        # Prompt text changes for training and generation alike.
        ("render", "template_kwargs", {"unused": 1},
         {"render", "train", "replay", "generate_base", "generate_orpo", "ifeval"}),
        ("eval", "limit", 5, {"generate_base", "generate_orpo", "ifeval"}),
        # Every stage that loads the model for computation takes model.dtype.
        ("model", "dtype", "float32", {"train", "replay", "generate_base", "generate_orpo", "ifeval"}),
        # A quantized base: the weights change for every stage that loads them; the tokenizer does not.
        ("quantize", "bits", 4, {"quantize", "train", "replay", "generate_base", "generate_orpo", "ifeval"}),
    ],
)
def test_one_knob_reruns_its_stage_and_what_follows_only(workflow_run, section, key, value, reruns):
    config = yaml.safe_load((workflow_run / "micro.yaml").read_text())
    config.setdefault(section, {})[key] = value
    (workflow_run / "micro.yaml").write_text(yaml.safe_dump(config))
    try:
        assert planned_rules(snakemake(workflow_run, "-n", "results/ifeval.json")) == reruns
    finally:
        (workflow_run / "micro.yaml").write_text(yaml.safe_dump(MICRO))


def test_a_quantized_base_is_what_the_model_stages_load(tmp_path):
    """quantize.bits: the quantize rule reads the base model; train, replay and both generations load its folder,
    curate and render keep the source's tokenizer."""
    (tmp_path / "micro.yaml").write_text(yaml.safe_dump({**MICRO, "quantize": {"bits": 4}}))
    result = snakemake(tmp_path, "-n", "-p", "results/ifeval.json")
    assert result.returncode == 0, result.stderr[-3000:]
    text = result.stdout + result.stderr
    assert job_counts(result)["quantize"] == 1
    assert re.search(r"orpo quantize --model results/base/model --out results/quantized/model ", text)
    for stage in ("train", "replay", "generate"):
        assert re.search(rf"orpo {stage} [^\n]*--model results/quantized/model ", text), stage
    for stage in ("render", "curate"):
        assert not re.search(rf"orpo {stage} [^\n]*results/quantized", text), stage


@pytest.mark.parametrize(
    "bad, message",
    [
        ({"train": {"lrr": 1}}, "unknown key train.lrr"),
        ({"train": {"batch_size": "eight"}}, "train.batch_size: 'eight' is not of type 'integer'"),
        ({"model": {"path": "/nonexistent/model"}}, "model.path: /nonexistent/model does not exist"),
    ],
)
def test_bad_config_stops_with_one_clear_error(tmp_path, bad, message):
    (tmp_path / "micro.yaml").write_text(yaml.safe_dump(bad))
    result = snakemake(tmp_path, "-n", "results/ifeval.json")
    assert result.returncode != 0
    assert message in result.stdout + result.stderr
