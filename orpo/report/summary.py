"""The run's summary, per experiment: IFEval of the base and the trained model with 95% intervals and their paired
difference, validation preference accuracy and the replay check; as markdown (results/summary.md), one figure
across experiments (results/summary.png) and a table on the console."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

from orpo.io import write_text
from orpo.report import plots, sources

METRIC_NAMES = {"prompt_level_strict_acc": "prompt strict", "prompt_level_loose_acc": "prompt loose",
                "inst_level_strict_acc": "instruction strict", "inst_level_loose_acc": "instruction loose"}
REPORT = "results/report.html"  # where `make report` writes the HTML report


def _interval(value: float | None, ci: dict[str, Any] | None) -> dict[str, float | None]:
    ci = ci or {}
    return {"estimate": value, "lo": ci.get("lo"), "hi": ci.get("hi")}


def checkpoint_step(index: dict[str, Any], which: str | int) -> int | None:
    """The step a checkpoint name (final, best_margin, best_loss) or number stands for in a run's index.json."""
    if isinstance(which, int) or str(which).isdigit():
        return int(which)
    return index.get(f"{which}_step")


def experiment(name: str, folder: str | os.PathLike, adapter: str | int = "final") -> dict[str, Any]:
    """One experiment's numbers from its folder (ifeval.json, train/run, train/replay.json); `adapter` is the
    checkpoint the trained model was scored with (generate.adapter)."""
    folder = Path(folder)
    result = sources.read_json(folder / "ifeval.json")
    run = folder / "train" / "run"
    step = checkpoint_step(sources.read_json(run / "index.json"), adapter)
    accuracy = {p["step"]: p.get("accuracy") for p in sources.validation_points(run)}
    replay = sources.read_json(folder / "train" / "replay.json")
    return {
        "name": name,
        "folder": str(folder),
        "prompts": result.get("prompts"),
        "models": {label: {m: _interval(model.get(m), model.get("ci95", {}).get(m)) for m in sources.IFEVAL_METRICS}
                   for label, model in result["models"].items()},
        "differences": {label: {m: dict(d[m]) for m in sources.IFEVAL_METRICS}
                        for label, d in result.get("differences", {}).items()},
        "accuracy": {"start": accuracy.get(0), "step": step, "checkpoint": adapter, "value": accuracy.get(step)},
        "replay": {"equal": bool(replay.get("equal")), "step": replay.get("step"),
                   "checkpoint": replay.get("checkpoint"), "from_step": replay.get("from_step")},
    }


def _cell(iv: dict[str, Any], signed: bool = False) -> str:
    if iv.get("estimate") is None:
        return "–"
    fmt = "{:+.3f}" if signed else "{:.3f}"
    ci = "" if iv.get("lo") is None else f" [{fmt.format(iv['lo'])}, {fmt.format(iv['hi'])}]"
    return fmt.format(iv["estimate"]) + ci


def _num(value: float | None) -> str:
    return "–" if value is None else f"{value:.3f}"


def markdown(experiments: list[dict[str, Any]]) -> str:
    """The summary as markdown: IFEval rows per model and difference, then accuracy and replay per experiment."""
    grid = any(e["name"] for e in experiments)
    lead = ["experiment"] if grid else []
    prompts = sorted({e["prompts"] for e in experiments if e["prompts"] is not None})
    lines = ["# ORPO run summary", "",
             f"IFEval on {', '.join(map(str, prompts)) or '?'} prompts: accuracy with 95% bootstrap intervals; "
             "the difference (trained minus base) with a paired bootstrap interval over the same prompts.", "",
             "| " + " | ".join(lead + ["model"] + list(METRIC_NAMES.values())) + " |",
             "|" + "---|" * (len(lead) + 1 + len(METRIC_NAMES))]
    for e in experiments:
        rows = [(label, [_cell(m[k]) for k in METRIC_NAMES]) for label, m in e["models"].items()]
        rows += [(label.replace("-", " − "), [_cell(d[k], signed=True) for k in METRIC_NAMES])
                 for label, d in e["differences"].items()]
        for i, (label, cells) in enumerate(rows):
            head = [f"`{e['name']}`" if i == 0 else ""] if grid else []
            lines.append("| " + " | ".join(head + [label] + cells) + " |")
    lines += ["", "| " + " | ".join(lead + ["validation preference accuracy", "replay"]) + " |",
              "|" + "---|" * (len(lead) + 2)]
    for e in experiments:
        a, r = e["accuracy"], e["replay"]
        acc = f"{_num(a['start'])} at step 0 → {_num(a['value'])} at step {a['step']} ({a['checkpoint']}, scored)"
        if a["start"] is None and a["value"] is None:
            acc = f"none: no validation pairs (step {a['step']}, {a['checkpoint']}, scored)"
        replay = (f"{'equal' if r['equal'] else 'DIFFERENT'}: step {r['step']} ({r['checkpoint']}) "
                  f"retrained from step {r['from_step']}")
        lines.append("| " + " | ".join(([f"`{e['name']}`"] if grid else []) + [acc, replay]) + " |")
    folders = ", ".join(f"`{Path(e['folder']) / 'plots'}/`" for e in experiments)
    lines += ["", f"- figures and tables: {folders} (training curves, preference accuracy, IFEval by instruction, "
              "curation, benchmarks)",
              "- this summary's figure: `results/summary.png`",
              f"- HTML report of them all: `make report` writes `{REPORT}`"]
    return "\n".join(lines) + "\n"


def figure(experiments: list[dict[str, Any]], path: str | os.PathLike) -> Any:
    """Per experiment: the four IFEval metrics of each model with 95% intervals, and validation accuracy."""
    plt = plots.plt
    names = [e["name"] or "run" for e in experiments]
    labels = list(experiments[0]["models"])
    fig, axes = plt.subplots(1, len(METRIC_NAMES) + 1, figsize=(2.2 * (len(METRIC_NAMES) + 1) + 0.5 * len(names), 4.5),
                             sharey=True)
    xs = range(len(names))
    panels = [(f"IFEval {title}", [(label, [e["models"].get(label, {}).get(metric, {}) for e in experiments])
                                    for label in labels]) for metric, title in METRIC_NAMES.items()]
    panels.append(("validation preference accuracy",
                   [(label, [{"estimate": e["accuracy"][key]} for e in experiments])
                    for key, label in (("start", "step 0"), ("value", "scored step"))]))
    for ax, (title, series) in zip(axes, panels):
        width = 0.8 / len(series)
        for j, (label, ivs) in enumerate(series):
            est = [iv.get("estimate") or 0.0 for iv in ivs]
            lo = [iv["lo"] if iv.get("lo") is not None else v for v, iv in zip(est, ivs)]
            hi = [iv["hi"] if iv.get("hi") is not None else v for v, iv in zip(est, ivs)]
            bars = ax.bar([x + j * width for x in xs], est, width, label=label,
                          yerr=[[v - a for v, a in zip(est, lo)], [b - v for v, b in zip(est, hi)]], capsize=3)
            plots.mark_tops(ax, bars)
            ax.bar_label(bars, labels=[f"{v:.2f}" for v in est], fontsize=6, padding=2)
        ax.set_title(title, fontsize=9)
        ax.set_xticks([x + 0.4 - width / 2 for x in xs], names, rotation=30 if len(names) > 1 else 0,
                      ha="right" if len(names) > 1 else "center", fontsize=8)
        ax.set_ylim(-0.04, 1.12)
        ax.grid(axis="y", alpha=0.3)
        ax.legend(fontsize=7, loc="upper left")
    axes[0].set_ylabel("accuracy (IFEval: 95% CI)")
    fig.tight_layout()
    plots.save(fig, path)
    return fig


def write_summary(spec: dict[str, dict[str, Any]], out: str | os.PathLike, plot: str | os.PathLike) -> dict[str, Any]:
    """results/summary.md and its figure from {experiment name: {"folder": ..., "adapter": ...}}."""
    experiments = [experiment(name, s["folder"], s.get("adapter", "final")) for name, s in spec.items()]
    if not experiments:
        raise ValueError("summary: no experiment given")
    figure(experiments, plot)
    write_text(out, markdown(experiments))
    return {"experiments": [e["name"] for e in experiments], "out": str(out), "plot": str(plot)}


def show(path: str | os.PathLike) -> None:
    """Print a summary markdown file as a table on the console (rich), wide enough for its rows off a terminal."""
    from rich.console import Console
    from rich.markdown import Markdown

    text = Path(path).read_text(encoding="utf-8")
    rows = [len(line) for line in text.splitlines() if line.startswith("|")]
    width = None if sys.stdout.isatty() else max([100] + [n + 4 for n in rows])
    Console(width=width, soft_wrap=False).print(Markdown(text))
