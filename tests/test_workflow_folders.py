"""Folder outputs under the real Snakemake: complete or remade, never lost to a failed rebuild; data.raw forms.

Each test works on a copy of the session's micro run (tests/test_workflow.py), so the shared run stays as it is.
"""

import json
import shutil

import pytest
import yaml
from test_workflow import MICRO, micro_workflow, planned_rules, session_repo, snakemake, workspace

# one worker under pytest-xdist: these share the session's workflow runs
pytestmark = pytest.mark.xdist_group("workflow")


def copy_of_the_micro_run(tmp_path_factory, tmp_path):
    """A workdir holding a finished micro run (results, logs, Snakemake's records), run by the session's repo."""
    work = workspace(session_repo(tmp_path_factory), tmp_path / "wf")
    shutil.copytree(micro_workflow(tmp_path_factory), work, dirs_exist_ok=True, symlinks=True)
    return work


def test_an_emptied_folder_output_is_made_again(tmp_path_factory, tmp_path):
    """A train job that died after its run folder was emptied: the folder is there but incomplete, so a job that
    reads it (replay, rerun here) first makes it again, instead of failing on a missing settings.json."""
    work = copy_of_the_micro_run(tmp_path_factory, tmp_path)
    run = work / "results" / "train" / "run"
    shutil.rmtree(run)
    run.mkdir()
    assert {"train", "replay"} <= planned_rules(snakemake(work, "-n", "--forcerun", "replay", "results/ifeval.json"))
    assert "train" in planned_rules(snakemake(work, "-n", "results/train/run/complete.json"))


def test_a_failed_rebuild_keeps_the_finished_model(tmp_path_factory, tmp_path):
    """The base model rebuilt on raw rows that fail to read: the job fails, the finished model stays in place
    (only its marker goes, so the next run rebuilds it)."""
    work = copy_of_the_micro_run(tmp_path_factory, tmp_path)
    weights = work / "results" / "base" / "model" / "model.safetensors"
    before = weights.read_bytes()
    (work / "bad.jsonl").write_text("{not json\n")
    (work / "bad.yaml").write_text(yaml.safe_dump({**MICRO, "data": {"raw": "bad.jsonl"}}))
    result = snakemake(work, "results/ifeval.json", config=("bad.yaml",))
    assert result.returncode != 0 and "bad.jsonl, line 1" in (work / "logs" / "base.log").read_text()
    assert weights.read_bytes() == before
    assert not (work / "results" / "base" / "model" / "complete.json").exists()


def test_the_embedded_base_reads_every_form_data_raw_takes(tmp_path_factory, tmp_path):
    """data.raw as a folder of jsonl files with a malformed line, under curate.on_error: skip: the base stage
    reads it as curate does (skipping and counting that line) and builds the model."""
    work = copy_of_the_micro_run(tmp_path_factory, tmp_path)
    lines = (work / "results" / "data" / "raw.jsonl").read_text().splitlines()
    folder = work / "raw"
    folder.mkdir()
    (folder / "a.jsonl").write_text("\n".join(lines[:60]) + "\n{not json\n")
    (folder / "b.jsonl").write_text("\n".join(lines[60:]) + "\n")
    # The rows read are under test, not what the model learns from them: a few training steps build it.
    config = {**MICRO, "data": {"raw": "raw"}, "curate": {**MICRO["curate"], "on_error": "skip"},
              "base": {**MICRO["base"], "steps": 8}}
    (work / "folder.yaml").write_text(yaml.safe_dump(config))
    result = snakemake(work, "results/base/model/complete.json", config=("folder.yaml",))
    assert result.returncode == 0, (work / "logs" / "base.log").read_text()[-2000:]
    manifest = json.loads((work / "results" / "base" / "model" / "manifest.json").read_text())
    assert manifest["rows"] == len(lines) and manifest["malformed_skipped"] == 1
