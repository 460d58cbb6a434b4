"""Figures (PNG, matplotlib's Agg backend): training curves, preference accuracy, IFEval by type, benchmarks, judge."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")  # files only, no display; must precede pyplot
import matplotlib.pyplot as plt

from orpo.io import atomic_path, write_text
from orpo.report import sources, tables

CURVES = (("loss", "loss (NLL + λ·OR)"), ("nll", "NLL of chosen"), ("or_loss", "odds-ratio term"),
          ("margin", "margin: log p(chosen) − log p(rejected)"))
PNG_METADATA = {"Software": None}  # no matplotlib version in the file: same data, same bytes


def _save(fig: Any, path: str | os.PathLike) -> None:
    with atomic_path(path) as tmp:
        fig.savefig(tmp, format="png", dpi=100, metadata=PNG_METADATA)
    plt.close(fig)


def training_series(metrics: list[dict], validation: list[dict], key: str) -> tuple[list, list, list, list]:
    """(train steps, train values, validation steps, validation values) of one metric; missing values skipped."""
    train = [(r["step"], r[key]) for r in metrics if r.get(key) is not None]
    val = [(p["step"], p[key]) for p in validation if p.get(key) is not None]
    return [s for s, _ in train], [v for _, v in train], [s for s, _ in val], [v for _, v in val]


def training_figure(metrics: list[dict], validation: list[dict], path: str | os.PathLike) -> None:
    """Loss, NLL, odds-ratio term and margin per step (lines) and per validation (dots), 2x2 panels."""
    fig, axes = plt.subplots(2, 2, figsize=(10, 7), sharex=True)
    for ax, (key, title) in zip(axes.flat, CURVES):
        ts, tv, vs, vv = training_series(metrics, validation, key)
        ax.plot(ts, tv, lw=1, label="train (micro-batch)")
        ax.plot(vs, vv, "o-", ms=4, label="validation")
        ax.set_title(title, fontsize=10)
        ax.grid(alpha=0.3)
    axes[0, 0].legend(fontsize=8)
    for ax in axes[1]:
        ax.set_xlabel("optimizer step")
    fig.tight_layout()
    _save(fig, path)


def accuracy_figure(metrics: list[dict], validation: list[dict], path: str | os.PathLike) -> None:
    """Preference accuracy (chosen more likely than rejected) per step and per validation."""
    fig, ax = plt.subplots(figsize=(7, 4))
    ts, tv, vs, vv = training_series(metrics, validation, "accuracy")
    ax.plot(ts, tv, lw=0.8, alpha=0.6, label="train (micro-batch)")
    ax.plot(vs, vv, "o-", ms=4, label="validation")
    ax.set_ylim(-0.02, 1.02)
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("preference accuracy")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    _save(fig, path)


def ifeval_by_instruction(result: dict[str, Any]) -> tuple[list[str], dict[str, list[float]]]:
    """(instruction types, model -> strict accuracy per type) from ifeval.json; types are the union, sorted."""
    models = result["models"]
    types = sorted({t for m in models.values() for t in m.get("by_instruction_strict", {})})
    return types, {label: [m.get("by_instruction_strict", {}).get(t, float("nan")) for t in types]
                   for label, m in models.items()}


def ifeval_figure(result: dict[str, Any], path: str | os.PathLike) -> None:
    """Strict accuracy per instruction type, one bar per model (base vs the adapter)."""
    types, values = ifeval_by_instruction(result)
    fig, ax = plt.subplots(figsize=(max(6, 0.45 * len(types) + 2), 5))
    width = 0.8 / max(1, len(values))
    for i, (label, vals) in enumerate(values.items()):
        ax.bar([x + i * width for x in range(len(types))], vals, width, label=label)
    ax.set_xticks([x + 0.4 - width / 2 for x in range(len(types))], types, rotation=60, ha="right", fontsize=7)
    ax.set_ylim(0, 1.05)
    ax.set_ylabel("strict accuracy")
    ax.legend(fontsize=8)
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    _save(fig, path)


def benchmarks_figure(records: dict[str, dict[str, float | None]], path: str | os.PathLike) -> None:
    """Wall time and max RSS per rule, two horizontal bar panels."""
    rules = list(records)
    fig, axes = plt.subplots(1, 2, figsize=(10, max(3, 0.35 * len(rules) + 1.5)), sharey=True)
    for ax, (key, label) in zip(axes, (("s", "wall time (s)"), ("max_rss", "max RSS (MB)"))):
        ax.barh(rules, [records[r].get(key) or 0.0 for r in rules])
        ax.set_xlabel(label)
        ax.grid(axis="x", alpha=0.3)
    axes[0].invert_yaxis()
    fig.tight_layout()
    _save(fig, path)


def judge_figure(summary: dict[str, Any], path: str | os.PathLike) -> None:
    """Win, tie, loss and adjusted win rates with their 95% bootstrap intervals."""
    rates = [r for r in tables.JUDGE_RATES if summary.get(r, {}).get("estimate") is not None]
    est = [summary[r]["estimate"] for r in rates]
    err = [[e - summary[r]["lo"] for r, e in zip(rates, est)], [summary[r]["hi"] - e for r, e in zip(rates, est)]]
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.bar(rates, est, yerr=err, capsize=4)
    ax.set_ylim(0, 1.05)
    ax.set_title(f"adapter vs base: {summary.get('judged')} of {summary.get('questions')} questions judged", fontsize=10)
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    _save(fig, path)


def write_plots(run: str, ifeval: str, curated: str, rendered: str, benchmark_files: dict[str, str],
                out: str | os.PathLike) -> dict[str, Any]:
    """Every figure and HTML table of one experiment into `out`; returns what went in."""
    out = Path(out)
    metrics, validation = sources.train_metrics(run), sources.validation_points(run)
    if not metrics:
        raise ValueError(f"{run}/metrics.jsonl: no training records to plot")
    result = sources.read_json(ifeval)
    records = sources.benchmarks(benchmark_files)
    training_figure(metrics, validation, out / "training.png")
    accuracy_figure(metrics, validation, out / "preference_accuracy.png")
    ifeval_figure(result, out / "ifeval_by_instruction.png")
    write_text(out / "ifeval.html", tables.ifeval_html(result))
    write_text(out / "curation.html", tables.curation_html(
        {"curate": sources.manifest(curated), "render": sources.manifest(rendered)}))
    benchmarks_figure(records, out / "benchmarks.png")
    write_text(out / "benchmarks.html", tables.benchmarks_html(records))
    return {"steps": len(metrics), "validations": len(validation), "models": list(result["models"]),
            "benchmarks": list(records)}


def write_judge(summary_path: str, out: str | os.PathLike) -> dict[str, Any]:
    """The judge figure and table of one experiment into `out`."""
    summary = sources.read_json(summary_path)
    judge_figure(summary, Path(out) / "judge.png")
    write_text(Path(out) / "judge.html", tables.judge_html(summary))
    return {"judged": summary.get("judged"), "counts": summary.get("counts")}
