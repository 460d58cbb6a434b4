"""Figures (PNG, matplotlib's Agg backend): training curves, preference accuracy, IFEval by type, benchmarks, judge."""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Any

import matplotlib
import polars as pl

matplotlib.use("Agg")  # files only, no display; must precede pyplot
import matplotlib.pyplot as plt

from orpo.io import atomic_path, write_text
from orpo.report import sources, tables

CURVES = (("loss", "loss (train.objective; orpo: NLL + λ·OR)"), ("nll", "NLL of chosen"),
          ("or_loss", "odds-ratio term"), ("margin", "margin: log p(chosen) − log p(rejected)"))
PNG_METADATA = {"Software": None}  # no matplotlib version in the file: same data, same bytes
SMOOTHING_FRACTION = 0.05  # a smoothed training curve averages about this fraction of its points


def save(fig: Any, path: str | os.PathLike) -> None:
    """Write a figure as PNG atomically and close it."""
    with atomic_path(path) as tmp:
        fig.savefig(tmp, format="png", dpi=100, metadata=PNG_METADATA)
    plt.close(fig)


def training_series(metrics: list[dict], validation: list[dict], key: str) -> tuple[list, list, list, list]:
    """(train steps, train values, validation steps, validation values) of one metric; missing values skipped."""
    train = [(r["step"], r[key]) for r in metrics if r.get(key) is not None]
    val = [(p["step"], p[key]) for p in validation if p.get(key) is not None]
    return [s for s, _ in train], [v for _, v in train], [s for s, _ in val], [v for _, v in val]


def smoothing_window(points: int) -> int:
    """Points averaged per smoothed value: an odd count near 5% of the curve (1 = no smoothing)."""
    return max(1, round(points * SMOOTHING_FRACTION)) | 1


def smoothed(values: list[float], window: int) -> list[float]:
    """Centred moving average over `window` points, fewer at the ends (same length as `values`)."""
    if not values:
        return []
    return pl.Series(values, dtype=pl.Float64).rolling_mean(window, min_samples=1, center=True).to_list()


def _train_curve(ax: Any, steps: list, values: list) -> None:
    window = smoothing_window(len(values))
    ax.plot(steps, values, lw=0.8, alpha=0.35, color="C0", label="train (micro-batch)")
    if window > 1:
        ax.plot(steps, smoothed(values, window), lw=1.8, color="C0", label=f"train, smoothed ({window}-step mean)")


def training_figure(metrics: list[dict], validation: list[dict], path: str | os.PathLike) -> Any:
    """Loss, NLL, odds-ratio term and margin per step (raw and smoothed lines) and per validation (dots), 2x2."""
    fig, axes = plt.subplots(2, 2, figsize=(10, 7), sharex=True)
    for ax, (key, title) in zip(axes.flat, CURVES):
        ts, tv, vs, vv = training_series(metrics, validation, key)
        _train_curve(ax, ts, tv)
        ax.plot(vs, vv, "o-", ms=4, color="C1", label="validation")
        ax.set_title(title, fontsize=10)
        ax.grid(alpha=0.3)
    axes[0, 0].legend(fontsize=8)
    for ax in axes[1]:
        ax.set_xlabel("optimizer step")
    fig.tight_layout()
    save(fig, path)
    return fig


def accuracy_figure(metrics: list[dict], validation: list[dict], path: str | os.PathLike) -> Any:
    """Preference accuracy (chosen more likely than rejected) per step, raw and smoothed, and per validation."""
    fig, ax = plt.subplots(figsize=(7, 4))
    ts, tv, vs, vv = training_series(metrics, validation, "accuracy")
    _train_curve(ax, ts, tv)
    ax.plot(vs, vv, "o-", ms=4, color="C1", label="validation")
    ax.set_ylim(-0.02, 1.02)
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("preference accuracy")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    save(fig, path)
    return fig


def mark_tops(ax: Any, bars: Any) -> None:
    """A thick line on each bar's top edge in its colour, so a zero-height bar still shows as a bar at 0."""
    for bar in bars:
        ax.hlines(bar.get_height(), bar.get_x(), bar.get_x() + bar.get_width(), colors=[bar.get_facecolor()],
                  lw=2.5, zorder=3)


def wilson(correct: int, total: int, z: float = 1.959964) -> tuple[float, float]:
    """Wilson score 95% interval of a proportion (sound at 0 and n: no zero-width interval)."""
    if total <= 0:
        return (0.0, 1.0)
    p = correct / total
    centre = (p + z * z / (2 * total)) / (1 + z * z / total)
    half = z * math.sqrt(p * (1 - p) / total + z * z / (4 * total * total)) / (1 + z * z / total)
    return (max(0.0, centre - half), min(1.0, centre + half))


def ifeval_by_instruction(result: dict[str, Any], details: str | os.PathLike | None = None
                          ) -> tuple[list[str], dict[str, list[dict[str, Any]]]]:
    """(instruction types, model -> per type {accuracy, correct, total, lo, hi}), types sorted.

    Counts come from the ifeval stage's details folder (<details>/<model>/summary.json, strict); without
    it only the accuracies in ifeval.json are known (no count, no interval).
    """
    models = result["models"]
    counts = {}
    for label in models:
        summary = Path(details) / label / "summary.json" if details else None
        if summary is not None and summary.is_file():
            counts[label] = sources.read_json(summary)["strict"]["by_instruction"]
    types = sorted({t for label, m in models.items() for t in (counts.get(label) or m.get("by_instruction_strict", {}))})
    out = {}
    for label, m in models.items():
        rows = []
        for t in types:
            c = (counts.get(label) or {}).get(t)
            if c:
                lo, hi = wilson(c["correct"], c["total"])
                rows.append({"accuracy": c["accuracy"], "correct": c["correct"], "total": c["total"], "lo": lo, "hi": hi})
            else:
                rows.append({"accuracy": m.get("by_instruction_strict", {}).get(t, float("nan")), "correct": None,
                             "total": None, "lo": None, "hi": None})
        out[label] = rows
    return types, out


def ifeval_figure(result: dict[str, Any], path: str | os.PathLike, details: str | os.PathLike | None = None) -> Any:
    """Strict accuracy per instruction type, one bar per model, with Wilson 95% intervals and correct/total."""
    types, values = ifeval_by_instruction(result, details)
    fig, ax = plt.subplots(figsize=(max(6, 0.5 * len(types) + 2), 5.5))
    width = 0.8 / max(1, len(values))
    for i, (label, rows) in enumerate(values.items()):
        xs = [x + i * width for x in range(len(types))]
        acc = [r["accuracy"] for r in rows]
        err = [[a - r["lo"] if r["lo"] is not None else 0.0 for a, r in zip(acc, rows)],
               [r["hi"] - a if r["hi"] is not None else 0.0 for a, r in zip(acc, rows)]]
        bars = ax.bar(xs, acc, width, yerr=err, capsize=2, error_kw={"lw": 0.8, "alpha": 0.7}, label=label)
        mark_tops(ax, bars)
        ax.bar_label(bars, labels=[f"{r['correct']}/{r['total']}" if r["total"] else f"{a:.2f}"
                                   for a, r in zip(acc, rows)], fontsize=6, padding=2, rotation=90)
    n = {t: next((r["total"] for rows in values.values() for r in [rows[k]] if r["total"]), None)
         for k, t in enumerate(types)}
    ax.set_xticks([x + 0.4 - width / 2 for x in range(len(types))],
                  [f"{t} (n={n[t]})" if n[t] else t for t in types], rotation=60, ha="right", fontsize=7)
    ax.set_ylim(-0.04, 1.18)
    ax.set_ylabel("strict accuracy")
    ax.set_title("per instruction type: correct/total over each bar, Wilson 95% intervals, n instructions", fontsize=9)
    ax.legend(fontsize=8, loc="upper right")
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    save(fig, path)
    return fig


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
    save(fig, path)


def judge_figure(summary: dict[str, Any], path: str | os.PathLike) -> Any:
    """Win, tie, loss and adjusted win rates with their 95% bootstrap intervals; with no verdict, a line saying so."""
    rates = [r for r in tables.JUDGE_RATES if summary.get(r, {}).get("estimate") is not None]
    est = [summary[r]["estimate"] for r in rates]
    err = [[e - summary[r]["lo"] for r, e in zip(rates, est)], [summary[r]["hi"] - e for r, e in zip(rates, est)]]
    fig, ax = plt.subplots(figsize=(6, 4))
    if rates:
        ax.bar(rates, est, yerr=err, capsize=4)
        ax.set_ylim(0, 1.05)
        ax.grid(axis="y", alpha=0.3)
    else:
        counts = summary.get("counts") or {}
        errors = f"; {counts['error']} without a verdict (errors)" if counts.get("error") else ""
        ax.text(0.5, 0.5, f"no verdicts: no rates to show\n{summary.get('questions', 0)} questions{errors}",
                ha="center", va="center", fontsize=11, transform=ax.transAxes)
        ax.set_axis_off()
    ax.set_title(f"adapter vs base: {summary.get('judged')} of {summary.get('questions')} questions judged", fontsize=10)
    fig.tight_layout()
    save(fig, path)
    return fig


def write_plots(run: str, ifeval: str, curated: str, rendered: str, benchmark_files: dict[str, str],
                out: str | os.PathLike, ifeval_details: str | os.PathLike | None = None) -> dict[str, Any]:
    """Every figure and HTML table of one experiment into `out`; returns what went in."""
    out = Path(out)
    metrics, validation = sources.train_metrics(run), sources.validation_points(run)
    if not metrics:
        raise ValueError(f"{run}/metrics.jsonl: no training records to plot")
    result = sources.read_json(ifeval)
    records = sources.benchmarks(benchmark_files)
    training_figure(metrics, validation, out / "training.png")
    accuracy_figure(metrics, validation, out / "preference_accuracy.png")
    ifeval_figure(result, out / "ifeval_by_instruction.png", ifeval_details)
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
