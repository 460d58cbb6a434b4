"""The report: figures and tables from a real micro run, `snakemake --report`, and the SLURM profile's GPU rules."""

import json
import re

import matplotlib.image
import pytest
import yaml
from conftest import ROOT
from test_workflow import micro_workflow, snakemake

from orpo.report import plots, sources, tables

FIGURES = ("training.png", "preference_accuracy.png", "ifeval_by_instruction.png", "benchmarks.png")
TABLES = ("ifeval.html", "curation.html", "benchmarks.html")
IFEVAL_RULES = ("data", "base", "curate", "render", "train", "replay", "generate_base_ifeval", "generate_orpo_ifeval",
                "ifeval")


@pytest.fixture(scope="module")
def reported(tmp_path_factory):
    """The micro run with its plots rule run and `snakemake --report` written."""
    workdir = micro_workflow(tmp_path_factory)
    result = snakemake(workdir, "results/plots/training.png")
    assert result.returncode == 0, result.stderr[-3000:]
    report = snakemake(workdir, "--report", "report.html")
    assert report.returncode == 0, report.stderr[-3000:]
    return workdir


def test_the_plots_rule_writes_every_figure_and_table(reported):
    out = reported / "results" / "plots"
    for name in FIGURES:
        image = matplotlib.image.imread(out / name)  # a decodable PNG of a real size
        assert image.shape[0] > 200 and image.shape[1] > 300, name
    for name in TABLES:
        assert (out / name).read_text().startswith("<!DOCTYPE html>"), name


def test_the_html_report_holds_the_dag_figures_and_captions(reported):
    text = (reported / "report.html").read_text()
    assert len(text) > 100_000
    for name in FIGURES + TABLES:
        assert name in text, name
    for section in ('"Training"', '"IFEval"', '"Data"', '"Benchmarks"'):
        assert section in text, section
    assert "rulegraph" in text and "generate_orpo" in text  # the DAG
    assert "odds-ratio term" in text and "Preference accuracy" in text  # captions (workflow/report/*.rst)


def test_training_series_are_the_runs_metrics(reported):
    run = reported / "results" / "train" / "run"
    lines = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines() if x.strip()]
    raw = [r for r in lines if r["split"] == "train"]
    assert len(raw) == 8 and len(lines) > len(raw)  # validation records live there too; the curves take index.json's
    index = json.loads((run / "index.json").read_text())
    metrics, validation = sources.train_metrics(run), sources.validation_points(run)
    for key in ("loss", "nll", "or_loss", "margin", "accuracy"):
        steps, values, vsteps, vvalues = plots.training_series(metrics, validation, key)
        assert steps == [r["step"] for r in raw] and values == [r[key] for r in raw]
        assert vsteps == [0] + sorted(int(s) for s in index["checkpoints"])
        assert vvalues[0] == index["baseline"][key]
        assert vvalues[1:] == [index["checkpoints"][str(s)]["validation"][key] for s in vsteps[1:]]


def test_benchmark_table_holds_every_rule_behind_the_score(reported):
    text = (reported / "results" / "plots" / "benchmarks.html").read_text()
    for rule in IFEVAL_RULES:
        wall = sources.benchmark(reported / "benchmarks" / f"{rule}.tsv")["s"]
        assert re.search(rf"<td>{rule}</td><td>{wall:.4f}</td>", text), rule


def test_benchmark_records_read_the_last_row_and_na(tmp_path):
    tsv = tmp_path / "b.tsv"
    tsv.write_text("s\th:m:s\tmax_rss\tcpu_time\n1.5\t0:00:01\t10.0\t1.0\n2.25\t0:00:02\tNA\t2.0\n")
    assert sources.benchmark(tsv) == {"s": 2.25, "max_rss": None, "cpu_time": 2.0}
    assert sources.benchmarks({"a": str(tsv), "missing": str(tmp_path / "none.tsv")}) == {"a": sources.benchmark(tsv)}


def test_figures_are_byte_reproducible_and_tables_escape_text(tmp_path, reported):
    run = reported / "results" / "train" / "run"
    metrics, validation = sources.train_metrics(run), sources.validation_points(run)
    plots.training_figure(metrics, validation, tmp_path / "a.png")
    plots.training_figure(metrics, validation, tmp_path / "b.png")
    assert (tmp_path / "a.png").read_bytes() == (tmp_path / "b.png").read_bytes()
    page = tables.html_table(["h"], [["<script>x</script>"]], "t")
    assert "<script>x" not in page and "&lt;script&gt;x&lt;/script&gt;" in page


def test_the_slurm_profile_gives_gpus_to_the_model_rules_that_exist():
    profile = yaml.safe_load((ROOT / "workflow" / "profiles" / "slurm" / "config.yaml").read_text())
    rules = {m.group(1) for f in (ROOT / "workflow" / "rules").glob("*.smk")
             for m in re.finditer(r"^rule (\w+):", f.read_text(), re.MULTILINE)}
    resources = profile["set-resources"]
    assert set(resources) <= rules  # a renamed rule would silently lose its GPU
    for rule in ("train", "replay", "generate_base", "generate_orpo", "spin_train", "spin_generate"):
        assert resources[rule]["slurm_partition"] == "gpu"
        assert re.search(r"--gpus=\d|--gres=gpu", resources[rule]["slurm_extra"]), rule
    assert profile["executor"] == "slurm"
