"""Paper tables: the ORPO paper's IFEval experiment dry-runs as published (7B) and runs end to end scaled down."""

import json
import re
import subprocess
import sys

import pytest
import yaml
from conftest import ROOT, TINY_BASE
from test_workflow import MICRO, job_counts, session_repo, snakemake, workspace

PAPER = yaml.safe_load((ROOT / "config" / "paper" / "orpo-ifeval.yaml").read_text())
COLUMNS = ("prompt_level_strict_acc", "prompt_level_loose_acc", "inst_level_strict_acc", "inst_level_loose_acc")
KEYS = ("prompt_strict", "prompt_loose", "inst_strict", "inst_loose")
# The tiny config on the micro scale: a few steps everywhere; the pipeline, not the scores, is under test.
MICRO_PAPER = {**MICRO, "base": {**TINY_BASE, "steps": 24}, "eval": {"limit": 4},
               "train": {**MICRO["train"], "max_steps": 4, "checkpoint_every": 2},
               "generate": {"max_tokens": 16, "batch_size": 8}}


def test_the_7b_config_is_the_published_experiment():
    assert PAPER["model"]["hub_id"] == "mistralai/Mistral-7B-v0.1"
    assert PAPER["experiments"]["alpha"]["data"]["raw"].startswith("HuggingFaceH4/ultrafeedback_binarized")
    assert PAPER["experiments"]["beta"]["data"]["raw"].startswith("argilla/ultrafeedback-binarized-preferences-cleaned")
    assert (PAPER["train"]["lambda"], PAPER["train"]["lr"]) == (0.1, 5e-6)
    assert (PAPER["render"]["max_length"], PAPER["render"]["max_prompt_length"]) == (2048, 1024)
    published = {m["experiment"]: [m["published"][k] for k in KEYS] for m in PAPER["paper"]["models"]}
    assert published == {"alpha": [0.5009, 0.5083, 0.5995, 0.6163], "beta": [0.5287, 0.5564, 0.6355, 0.6619]}


def test_the_7b_config_dry_runs_its_whole_dag(tmp_path):
    (tmp_path / "config").symlink_to(ROOT / "config")  # the chat template path is relative to the workdir
    result = snakemake(tmp_path, "-n", "-p", "results/paper/orpo-ifeval/table.md", "results/paper/orpo-ifeval/judge.md",
                       config=(str(ROOT / "config" / "paper" / "orpo-ifeval.yaml"),))
    assert result.returncode == 0, result.stderr[-3000:]
    counts = job_counts(result)
    # Hub model and hub datasets: no data or base stage; two datasets: curate and render twice.
    assert "data" not in counts and "base" not in counts
    assert {r: counts[r] for r in ("curate", "render", "train", "replay", "ifeval", "judge", "paper_table",
                                   "paper_judge", "generate_orpo", "generate_base")} == {
        "curate": 2, "render": 2, "train": 2, "replay": 2, "ifeval": 2, "judge": 2, "paper_table": 1,
        "paper_judge": 1, "generate_orpo": 4, "generate_base": 2}
    text = result.stdout + result.stderr
    assert text.count("orpo train --model mistralai/Mistral-7B-v0.1") == 2
    for raw in ("HuggingFaceH4/ultrafeedback_binarized:train_prefs", "argilla/ultrafeedback-binarized-preferences-cleaned:train"):
        assert f"orpo curate --inputs {raw} " in text
    train = [json.loads((tmp_path / s).read_text()) for s in re.findall(r"orpo train .*--settings @(\S+)", text)]
    assert [(t["lr"], t["lambda"], t["epochs"]) for t in train] == [(5e-6, 0.1, 5)] * 2


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    repo = session_repo(tmp_path_factory)
    workdir = workspace(repo, tmp_path_factory.mktemp("paper"))
    (workdir / "micro.yaml").write_text(yaml.safe_dump(MICRO_PAPER))
    tiny = str(repo / "config" / "paper" / "orpo-ifeval-tiny.yaml")
    result = snakemake(workdir, "results/paper/orpo-ifeval-tiny/table.md", config=(tiny, "micro.yaml"))
    assert result.returncode == 0, result.stderr[-4000:]
    return workdir, result


def test_the_tiny_config_runs_end_to_end_sharing_data_and_model(tiny_run):
    _, result = tiny_run
    # alpha (h4) and beta (argilla_clean) binarize the same rows with the same model: data and base once.
    assert job_counts(result) == {"data": 1, "base": 1, "curate": 2, "render": 2, "train": 2, "replay": 2,
                                  "generate_base": 1, "generate_orpo": 2, "ifeval": 2, "paper_table": 1}


def table_rows(text: str) -> list[list[str]]:
    return [[c.strip() for c in line.strip().strip("|").split("|")] for line in text.splitlines()
            if line.startswith("|") and not line.startswith("|---")]


def test_the_tiny_table_puts_ours_beside_the_published_numbers(tiny_run):
    workdir, _ = tiny_run
    rows = table_rows((workdir / "results" / "paper" / "orpo-ifeval-tiny" / "table.md").read_text())
    assert rows[0] == ["Model", "", "Prompt-Strict", "Prompt-Loose", "Inst-Strict", "Inst-Loose"]
    models = yaml.safe_load((ROOT / "config" / "paper" / "orpo-ifeval-tiny.yaml").read_text())["paper"]["models"]
    body = rows[1:]
    assert len(body) == 4 * len(models)
    for i, model in enumerate(models):
        published, ours, ci, diff = body[4 * i: 4 * i + 4]
        assert published[0] == model["label"] and published[1] == "published"
        assert [float(v) for v in published[2:]] == [model["published"][k] for k in KEYS]
        result = json.loads((workdir / "results" / model["experiment"] / "ifeval.json").read_text())
        trained = result["models"]["orpo"]
        assert ours[1].startswith(f"ours (`{model['experiment']}`, 4 prompts")
        assert [float(v) for v in ours[2:]] == [round(trained[c], 4) for c in COLUMNS]
        assert all(re.fullmatch(r"\[\d\.\d{4}, \d\.\d{4}\]", v) for v in ci[2:])
        expected = [trained[c] - model["published"][k] for c, k in zip(COLUMNS, KEYS)]
        assert [float(v.replace("−", "-")) for v in diff[2:]] == pytest.approx(expected, abs=5e-5)


def test_the_judge_table_reads_each_experiments_summary(tmp_path):
    from orpo.eval.judge.summary import summarize

    outcomes = {"alpha": ["win"] * 5 + ["loss"] * 2 + ["tie", "inconsistent", "error"],
                "beta": ["win", "loss", "loss", "tie"]}
    args = []
    for exp, out in outcomes.items():
        (tmp_path / f"{exp}.json").write_text(json.dumps(summarize(out, n_resamples=200, seed=0)))
        args.append(f"{exp}={tmp_path / f'{exp}.json'}")
    spec = json.dumps(PAPER["paper"])
    subprocess.run([sys.executable, "-m", "orpo.cli", "report", "paper-judge", "--spec", spec, "--results", *args,
                    "--out", str(tmp_path / "judge.md")], check=True, capture_output=True)
    rows = table_rows((tmp_path / "judge.md").read_text())[1:]
    for row, (exp, out) in zip(rows, outcomes.items()):
        judged = [o for o in out if o != "error"]
        assert row[0].endswith(f"(`{exp}`)")
        assert [int(v) for v in row[1:7]] == [len(judged)] + [out.count(k) for k in ("win", "tie", "loss", "inconsistent", "error")]
        assert float(row[7].split()[0]) == pytest.approx(out.count("win") / len(judged), abs=5e-5)
        adjusted = (out.count("win") + 0.5 * (out.count("tie") + out.count("inconsistent"))) / len(judged)
        assert float(row[8].split()[0]) == pytest.approx(adjusted, abs=5e-5)
