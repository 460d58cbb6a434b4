"""What a researcher sees after a run: `make run`'s summary on the console, the figures and tables, `make report`'s
HTML report opened in a real headless Chromium, the render date on the console, and the SLURM profile's GPU rules."""

import json
import os
import re
import shutil
import subprocess
import sys
from datetime import datetime
from pathlib import Path

import matplotlib.image
import pytest
import yaml
from conftest import ROOT
from test_workflow import MICRO, _REPO_OF, micro_workflow, session_repo, snakemake, workspace

from orpo.report import plots, sources, summary, tables

# one worker under pytest-xdist: these share the session's workflow runs
pytestmark = pytest.mark.xdist_group("workflow")

FIGURES = ("training.png", "preference_accuracy.png", "ifeval_by_instruction.png", "benchmarks.png")
TABLES = ("ifeval.html", "curation.html", "benchmarks.html")
IFEVAL_RULES = ("data", "base", "curate", "render", "train", "replay", "generate_base_ifeval", "generate_orpo_ifeval",
                "ifeval")
# Every Results category of the flat layout's report and the files it lists.
CATEGORIES = {
    "Summary": ["results/summary.png"],
    "Training": ["results/plots/preference_accuracy.png", "results/plots/training.png"],
    "IFEval": ["results/plots/ifeval_by_instruction.png", "results/plots/ifeval.html"],
    "Data": ["results/plots/curation.html"],
    "Benchmarks": ["results/plots/benchmarks.html", "results/plots/benchmarks.png"],
}


def make(workdir: Path, target: str, *variables: str, config: str = "micro.yaml") -> subprocess.CompletedProcess:
    """`make TARGET` of the session's repository copy on a workdir, with this venv (what a researcher types)."""
    repo = _REPO_OF[Path(workdir)]
    args = f"--configfile {Path(workdir) / config} --cores 2"
    # -o setup: this venv is already set up; never reinstall it from the copy (its editable install would move there)
    cmd = ["make", "--no-print-directory", "-o", "setup", "-C", str(repo), target, f"VENV={sys.prefix}", f"WORKDIR={workdir}", f"SNAKEMAKE_ARGS={args}",
           *variables]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(repo), os.environ.get("PYTHONPATH")]))}
    return subprocess.run(cmd, capture_output=True, text=True, timeout=900, env=env, cwd=workdir, check=False)


@pytest.fixture(scope="module")
def reported(tmp_path_factory):
    """The micro run finished by `make run` (its printed output kept) and `make report`."""
    workdir = micro_workflow(tmp_path_factory)
    run = make(workdir, "run")
    assert run.returncode == 0, run.stderr[-3000:]
    report = make(workdir, "report")
    assert report.returncode == 0, report.stderr[-3000:]
    (workdir / "make_run.stdout").write_text(run.stdout)
    return workdir


def test_the_plots_rule_writes_every_figure_and_table(reported):
    out = reported / "results" / "plots"
    for name in FIGURES:
        image = matplotlib.image.imread(out / name)  # a decodable PNG of a real size
        assert image.shape[0] > 200 and image.shape[1] > 300, name
    for name in TABLES:
        assert (out / name).read_text().startswith("<!DOCTYPE html>"), name


def test_make_run_ends_with_the_summary_table(reported):
    """The console's last lines are the summary: each model's four IFEval metrics with their 95% intervals, the
    paired difference, validation accuracy from step 0 to the scored checkpoint, the replay, where things are."""
    printed = (reported / "make_run.stdout").read_text()
    result = json.loads((reported / "results" / "ifeval.json").read_text())
    index = json.loads((reported / "results" / "train" / "run" / "index.json").read_text())
    lines = [line.strip() for line in printed.splitlines() if line.strip()]
    assert lines[-1].startswith("• HTML report of them all: make report writes results/report.html"), lines[-3:]
    rows = {cells[0]: cells[1:] for cells in (re.split(r"\s{2,}", line) for line in lines)}
    for label in ("base", "orpo"):
        m = result["models"][label]
        assert rows[label] == [f"{m[k]:.3f} [{m['ci95'][k]['lo']:.3f}, {m['ci95'][k]['hi']:.3f}]"
                               for k in summary.METRIC_NAMES], label
    d = result["differences"]["orpo-base"]
    assert rows["orpo − base"] == [f"{d[k]['estimate']:+.3f} [{d[k]['lo']:+.3f}, {d[k]['hi']:+.3f}]"
                                   for k in summary.METRIC_NAMES]
    final = index["checkpoints"][str(index["final_step"])]["validation"]["accuracy"]
    assert any(f"{index['baseline']['accuracy']:.3f} at step 0 → {final:.3f} at step {index['final_step']} (final"
               in line and "equal: step" in line for line in lines)
    assert "results/plots/" in printed and "results/summary.png" in printed
    md = (reported / "results" / "summary.md").read_text()
    assert md.startswith("# ORPO run summary") and "| orpo − base |" in md


def test_the_report_shows_every_results_category_in_headless_chromium(reported, monkeypatch):
    """`make report`'s page in a real browser: every Results category lists its files, and each one displays
    (a PNG decoded at its own width, an HTML table with its rows), with no script error on the page."""
    from playwright.sync_api import sync_playwright

    browser_path = chromium()
    monkeypatch.delenv("LD_PRELOAD", raising=False)  # the tests' OpenBLAS preload crashes Playwright's node driver
    page_errors: list[str] = []
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=browser_path)
        try:
            page = browser.new_page(viewport={"width": 1400, "height": 900})
            page.set_default_timeout(10_000)
            page.on("pageerror", lambda e: page_errors.append(str(e)))
            page.goto((reported / "results" / "report.html").as_uri())
            menu = page.locator("nav").first
            entries = [line.strip() for line in menu.inner_text().splitlines() if line.strip()]
            assert set(entries[[e.upper() for e in entries].index("RESULTS") + 1:]) == set(CATEGORIES)
            for category, files in CATEGORIES.items():
                back = page.locator("nav ol a", has_text="Results")
                if back.count():
                    back.click()
                menu.get_by_text(category, exact=True).click()
                rows = page.locator("nav tbody tr")
                rows.first.wait_for()
                assert [rows.nth(i).locator("td").first.inner_text() for i in range(rows.count())] == files, category
                for i, name in enumerate(files):
                    rows.nth(i).locator("a[iconname=eye]").click()
                    if name.endswith(".png"):
                        shown = page.locator("img:not(nav img)")
                        shown.wait_for()
                        width = shown.evaluate("e => e.complete ? e.naturalWidth : 0")
                        assert width == matplotlib.image.imread(reported / name).shape[1], name
                    else:
                        table = page.frame_locator("iframe").locator("table tr")
                        table.first.wait_for()
                        assert table.count() >= 2, name
        finally:
            browser.close()
    assert page_errors == []


def chromium() -> str:
    """The headless Chromium the browser test drives: ORPO_CHROMIUM, else one on PATH (make test installs one)."""
    for name in (os.environ.get("ORPO_CHROMIUM"), "chromium-headless-shell", "chromium", "chromium-browser",
                 "google-chrome"):
        if name and (found := shutil.which(name)):
            return found
    message = "no headless Chromium on PATH: `make test` installs one (workflow/scripts/browser.sh)"
    if os.environ.get("CI"):
        pytest.fail(message)
    pytest.skip(message)


def test_the_html_report_holds_the_dag_figures_and_captions(reported):
    text = (reported / "results" / "report.html").read_text()
    assert len(text) > 100_000
    for name in FIGURES + TABLES:
        assert name in text, name
    for section in ('"Summary"', '"Training"', '"IFEval"', '"Data"', '"Benchmarks"'):
        assert section in text, section
    assert "rulegraph" in text and "generate_orpo" in text  # the DAG
    assert "odds-ratio term" in text and "Preference accuracy" in text  # captions (workflow/report/*.rst)
    assert not list((reported / "results").glob(".report.tmp*"))  # renamed into place


def test_the_render_date_is_pinned_recorded_and_said_on_the_console(tmp_path_factory, tmp_path):
    """A template that prints today's date (Llama 3.x's strftime_now) under the real workflow: by default the
    date is render.date's, recorded in the manifest and said on the console; with render.date null the
    render warns on the console that its text now changes with the day."""
    micro = micro_workflow(tmp_path_factory)
    work = workspace(session_repo(tmp_path_factory), tmp_path / "dated")
    render = {"max_length": 400, "max_prompt_length": 200, "template": str(ROOT / "tests" / "fixtures" / "templates" / "llama3.jinja"),
              "template_kwargs": {"bos_token": ""}}  # the tiny tokenizer has no BOS token
    config = {**MICRO, "model": {"path": str(micro / "results" / "base" / "model")},
              "data": {"raw": str(micro / "results" / "data" / "raw.jsonl")}, "render": render}
    (work / "micro.yaml").write_text(yaml.safe_dump(config))
    pinned = snakemake(work, "results/rendered/complete.json")
    assert pinned.returncode == 0, pinned.stderr[-3000:]
    assert "orpo render: note: the template calls strftime_now: it prints render.date 2024-07-26" in pinned.stderr
    manifest = json.loads((work / "results" / "rendered" / "manifest.json").read_text())
    assert manifest["template"]["date"] == "2024-07-26" and manifest["warnings"] == []
    assert "Today Date: 26 Jul 2024" in first_prompt(work, micro)
    (work / "micro.yaml").write_text(yaml.safe_dump({**config, "render": {**render, "date": None}}))
    live = snakemake(work, "results/rendered/complete.json")
    assert live.returncode == 0, live.stderr[-3000:]
    assert "orpo render: warning: the template calls strftime_now and render.date is null" in live.stderr
    assert json.loads((work / "results" / "rendered" / "manifest.json").read_text())["template"]["date"] is None
    assert f"Today Date: {datetime.now():%d %b %Y}" in first_prompt(work, micro)


def first_prompt(work: Path, micro: Path) -> str:
    """The text of the first rendered training prompt, decoded with the model's tokenizer."""
    import polars as pl
    from tokenizers import Tokenizer

    ids = pl.read_parquet(work / "results" / "rendered" / "train.parquet")["prompt_ids"][0].to_list()
    return Tokenizer.from_file(str(micro / "results" / "base" / "model" / "tokenizer.json")).decode(ids)


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


def test_training_curves_draw_a_smoothed_line_beside_the_raw_one(tmp_path):
    values = [float(i % 2) for i in range(200)]  # alternating 0, 1: the mean is 0.5
    window = plots.smoothing_window(len(values))
    assert window == 11 and plots.smoothing_window(8) == 1 and plots.smoothing_window(60) == 3
    smooth = plots.smoothed(values, window)
    assert len(smooth) == 200 and all(abs(v - 0.5) <= 1 / (2 * window) + 1e-12 for v in smooth[5:-5])
    assert smooth[0] == pytest.approx(sum(values[:6]) / 6)  # fewer points at the ends, never a shifted curve
    metrics = [{"step": i + 1, "loss": v, "nll": v, "or_loss": v, "margin": v, "accuracy": v}
               for i, v in enumerate(values)]
    fig = plots.training_figure(metrics, [{"step": 0, "loss": 1.0}], tmp_path / "t.png")
    for ax in fig.axes:
        lines = {line.get_label(): line for line in ax.get_lines()}
        assert list(lines["train, smoothed (11-step mean)"].get_ydata()) == smooth
        assert list(lines["train (micro-batch)"].get_ydata()) == values
    fig = plots.accuracy_figure(metrics, [], tmp_path / "a.png")
    assert "train, smoothed (11-step mean)" in [line.get_label() for line in fig.axes[0].get_lines()]


def test_the_ifeval_chart_shows_counts_intervals_and_zero_bars(reported, tmp_path):
    result = json.loads((reported / "results" / "ifeval.json").read_text())
    details = reported / "results" / "ifeval"
    types, values = plots.ifeval_by_instruction(result, details)
    counts = json.loads((details / "orpo" / "summary.json").read_text())["strict"]["by_instruction"]
    assert types == sorted(counts)
    for t, row in zip(types, values["orpo"]):
        assert (row["correct"], row["total"]) == (counts[t]["correct"], counts[t]["total"])
        assert (row["lo"], row["hi"]) == plots.wilson(row["correct"], row["total"])
        assert row["lo"] <= row["accuracy"] <= row["hi"] and row["hi"] > row["lo"]
    fig = plots.ifeval_figure(result, tmp_path / "i.png", details)
    ax = fig.axes[0]
    assert [t.get_text() for t in ax.get_xticklabels()] == [f"{t} (n={counts[t]['total']})" for t in types]
    labels = [t.get_text() for t in ax.texts]
    assert f"{values['orpo'][0]['correct']}/{values['orpo'][0]['total']}" in labels and len(labels) == 2 * len(types)
    zero = [r for r in values["orpo"] if r["accuracy"] == 0]
    assert zero  # the micro run's tiny model fails most instructions
    # Each bar's top is drawn as a thick line in its colour, at 0 too, above the axis' lower edge.
    tops = [seg for coll in ax.collections for seg in coll.get_segments() if coll.get_linewidths()[0] >= 2]
    assert sum(1 for seg in tops if seg[0][1] == 0) >= len(zero) and ax.get_ylim()[0] < 0
    assert plots.wilson(0, 4)[1] == pytest.approx(0.4899, abs=1e-4) and plots.wilson(3, 3)[0] == pytest.approx(0.4385, abs=1e-4)


def test_a_judge_figure_without_verdicts_says_so(tmp_path):
    summary = {"questions": 4, "judged": 0, "counts": {"win": 0, "loss": 0, "tie": 0, "inconsistent": 0, "error": 4},
               **{r: {"estimate": None, "lo": None, "hi": None} for r in tables.JUDGE_RATES}}
    fig = plots.judge_figure(summary, tmp_path / "j.png")
    texts = " ".join(t.get_text() for t in fig.axes[0].texts)
    assert "no verdicts" in texts and "4 without a verdict" in texts and not fig.axes[0].patches
    judged = {**summary, "judged": 4, "counts": {**summary["counts"], "win": 4, "error": 0},
              **{r: {"estimate": 0.5, "lo": 0.25, "hi": 0.75} for r in tables.JUDGE_RATES}}
    fig = plots.judge_figure(judged, tmp_path / "k.png")
    assert len(fig.axes[0].patches) == len(tables.JUDGE_RATES) and not fig.axes[0].texts


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
             for m in re.finditer(r"^(?:rule|use rule \w+ as) (\w+)", f.read_text(), re.MULTILINE)}
    resources = profile["set-resources"]
    assert set(resources) <= rules  # a renamed rule would silently lose its GPU
    for rule in ("train", "replay", "generate_base", "generate_orpo", "spin_train", "spin_generate"):
        assert resources[rule]["slurm_partition"] == "gpu"
        assert re.search(r"--gpus=\d|--gres=gpu", resources[rule]["slurm_extra"]), rule
    assert profile["executor"] == "slurm"


def _fake_experiment(folder: Path, settings: dict, margins: list[float], lams: list[float] | None) -> Path:
    """An experiment folder as the objectives table reads it: ifeval.json, the run's settings, index and metrics."""
    run = folder / "train" / "run"
    run.mkdir(parents=True)
    iv = lambda v: {"estimate": v, "lo": v - 0.05, "hi": v + 0.05}  # noqa: E731
    models = {label: {**{m: v for m in sources.IFEVAL_METRICS}, "ci95": {m: {"lo": v - 0.05, "hi": v + 0.05}
                                                                          for m in sources.IFEVAL_METRICS}}
              for label, v in (("base", 0.2), ("orpo", 0.3))}
    (folder / "ifeval.json").write_text(json.dumps({"prompts": 300, "models": models, "differences": {
        "orpo-base": {m: iv(0.1) for m in sources.IFEVAL_METRICS}}}))
    (folder / "train" / "replay.json").write_text(json.dumps({"equal": True, "step": 4, "checkpoint": "final",
                                                             "from_step": 2}))
    (run / "settings.json").write_text(json.dumps({"settings": settings}))
    validation = lambda m: {"loss": 1.0, "nll": 1.0 + m, "or_loss": 0.7, "accuracy": 0.5 + m, "margin": m}  # noqa: E731
    (run / "index.json").write_text(json.dumps({
        "baseline": validation(margins[0]), "final_step": 4,
        "checkpoints": {"2": {"validation": validation(margins[1])}, "4": {"validation": validation(margins[2])}}}))
    rows = [{"step": k, "split": "train", "margin": margins[min(k // 2, 2)], **({"lambda": lams[k - 1]} if lams else {})}
            for k in range(1, 5)]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return folder


def test_the_objectives_table_reads_each_runs_loss_margins_lambda_and_ifeval(tmp_path):
    from orpo.report.objectives import write_objectives

    train = {"lambda": 0.1, "beta": 2.0, "gamma": 1.0, "dpo_beta": 0.1,
             "controller": {"kp": 5.0, "ki": 0.0, "kd": 0.0, "window": 10, "target_drift": 0.0}}
    spec = {
        "controller": _fake_experiment(tmp_path / "controller", {**train, "objective": "orpo",
                                                                 "lambda_schedule": "controller"},
                                       [-0.1, 0.2, 0.15], [0.1, 0.1, 0.35, 0.6]),
        "simpo": _fake_experiment(tmp_path / "simpo", {**train, "objective": "simpo", "lambda_schedule": "constant"},
                                  [-0.1, 0.05, 0.3], None),
    }
    out = write_objectives({k: {"folder": str(v), "adapter": "final"} for k, v in spec.items()},
                           tmp_path / "table.md", tmp_path / "margin_lambda.png")
    assert out["experiments"] == ["controller", "simpo"]
    rows = {cells[0].strip("`"): cells for line in (tmp_path / "table.md").read_text().splitlines()
            if line.startswith("| `") for cells in [[c.strip() for c in line.strip("|").split("|")]]}
    c, s = rows["controller"], rows["simpo"]
    assert c[1].startswith("orpo, λ from 0.1 by controller (kp 5") and s[1] == "simpo, β 2, γ 1"
    assert c[2] == "0.400 → 0.650 (step 4, final)" and c[3] == "-0.100 → +0.150" and c[4] == "+0.200 (2)"
    assert c[5] == "0.900 → 1.150" and c[6] == "0.100 → 0.600" and s[6] == "–"  # simpo has no λ
    assert s[4] == "+0.300 (4)"
    assert c[7:] == ["0.200 [0.150, 0.250]", "0.300 [0.250, 0.350]", "+0.100 [+0.050, +0.150]"]
    assert matplotlib.image.imread(tmp_path / "margin_lambda.png").shape[2] in (3, 4)
