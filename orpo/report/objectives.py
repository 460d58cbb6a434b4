"""The objectives comparison (results/objectives/): per experiment its loss (train.objective, λ schedule), the
validation preference accuracy and margin, IFEval prompt-strict of the base and the trained model with 95%
intervals and their paired difference; one figure of the margin and λ over the steps of every run."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from orpo.io import write_text
from orpo.report import plots, sources, summary
from orpo.train.objectives import LAMBDA_WEIGHTED

METRIC = "prompt_level_strict_acc"


def describe(s: dict[str, Any]) -> str:
    """An experiment's loss in a few words, from its recorded train settings."""
    o = s.get("objective", "orpo")
    lam = f"λ {s['lambda']:g}"
    if s.get("lambda_schedule") == "controller":
        c = s["controller"]
        lam = (f"λ from {s['lambda']:g} by controller (kp {c['kp']:g}, ki {c['ki']:g}, kd {c['kd']:g}, window "
               f"{c['window']}, drift {c['target_drift']:g})")
    simpo = f"β {s['beta']:g}, γ {s['gamma']:g}"
    return {"orpo": f"orpo, {lam}", "orpo_margin": f"orpo_margin, {lam}, {simpo}", "simpo": f"simpo, {simpo}",
            "sft_simpo": f"sft_simpo, {simpo}", "dpo": f"dpo, β {s['dpo_beta']:g}"}[o]


def experiment(name: str, folder: str | os.PathLike, adapter: str | int = "final") -> dict[str, Any]:
    """One experiment's numbers (summary.experiment's plus its loss, validation margins and per-step curves)."""
    e = summary.experiment(name, folder, adapter)
    run = Path(folder) / "train" / "run"
    settings = sources.read_json(run / "settings.json")["settings"]
    validation = sources.validation_points(run)
    at = {p["step"]: p for p in validation}
    best = max(validation, key=lambda p: p["margin"]) if validation else None
    metrics = sources.train_metrics(run)
    return {**e, "loss": describe(settings), "start": at.get(0), "scored": at.get(e["accuracy"]["step"]),
            "best_margin": best, "validation": validation,
            "steps": [m["step"] for m in metrics], "margin": [m["margin"] for m in metrics],
            # λ only where it weights the loss
            "lambda": [m.get("lambda", settings["lambda"]) for m in metrics]
            if settings.get("objective", "orpo") in LAMBDA_WEIGHTED else []}


def _val(point: dict[str, Any] | None, key: str, signed: bool = False) -> str:
    if not point or point.get(key) is None:
        return "–"
    return f"{point[key]:+.3f}" if signed else f"{point[key]:.3f}"


def markdown(experiments: list[dict[str, Any]]) -> str:
    """The comparison as markdown: one row per experiment."""
    prompts = sorted({e["prompts"] for e in experiments if e["prompts"] is not None})
    lines = ["# Objectives: validation preference and IFEval", "",
             "Validation preference accuracy (mean response log-prob of chosen above rejected), margin (their "
             "mean difference) and chosen NLL (a margin won by pushing both down shows there) at step 0 and at "
             "the scored checkpoint; the best validation margin and its step; "
             f"λ at the first and last step (– where the loss has none). IFEval prompt-level strict accuracy on {', '.join(map(str, prompts)) or '?'} "
             "prompts with 95% bootstrap intervals; trained minus base with a paired bootstrap interval.", "",
             "| experiment | loss | accuracy (step 0 → scored) | margin (step 0 → scored) | best margin (step) | "
             "NLL (step 0 → scored) | λ (first → last) | IFEval base | IFEval trained | trained − base |",
             "|" + "---|" * 10]
    for e in experiments:
        trained = [label for label in e["models"] if label != "base"]
        base = e["models"].get("base", {}).get(METRIC, {})
        tuned = e["models"][trained[0]][METRIC] if trained else {}
        diff = next(iter(e["differences"].values()), {}).get(METRIC, {})
        a, step = e["accuracy"], e["accuracy"]["step"]
        best = e["best_margin"]
        lam = f"{e['lambda'][0]:.3f} → {e['lambda'][-1]:.3f}" if e["lambda"] else "–"
        lines.append("| " + " | ".join([
            f"`{e['name']}`", e["loss"],
            f"{_val(e['start'], 'accuracy')} → {_val(e['scored'], 'accuracy')} (step {step}, {a['checkpoint']})",
            f"{_val(e['start'], 'margin', True)} → {_val(e['scored'], 'margin', True)}",
            f"{_val(best, 'margin', True)} ({best['step']})" if best else "–",
            f"{_val(e['start'], 'nll')} → {_val(e['scored'], 'nll')}", lam,
            summary._cell(base), summary._cell(tuned), summary._cell(diff, signed=True)]) + " |")
    lines += ["", "- margin and λ over the steps: `results/objectives/margin_lambda.png`",
              "- each experiment's own figures: " + ", ".join(f"`{Path(e['folder']) / 'plots'}/`" for e in experiments)]
    return "\n".join(lines) + "\n"


def figure(experiments: list[dict[str, Any]], path: str | os.PathLike) -> Any:
    """Training margin (smoothed) with the validation margins as dots, and λ, over the steps of each run."""
    plt = plots.plt
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(10, 8), sharex=True, height_ratios=(2, 1))
    for i, e in enumerate(experiments):
        color = f"C{i % 10}"
        window = plots.smoothing_window(len(e["margin"]))
        top.plot(e["steps"], plots.smoothed(e["margin"], window), lw=1.5, color=color, label=e["name"])
        top.plot([p["step"] for p in e["validation"]], [p["margin"] for p in e["validation"]], "o", ms=3,
                 color=color)
        if e["lambda"]:
            bottom.plot(e["steps"], e["lambda"], lw=1.5, color=color, label=e["name"])
    top.set_title("margin: log p(chosen) − log p(rejected), train (smoothed) and validation (dots)", fontsize=10)
    bottom.set_title("λ per step (orpo, orpo_margin; the others do not use it)", fontsize=10)
    bottom.set_xlabel("optimizer step")
    for ax in (top, bottom):
        ax.grid(alpha=0.3)
    top.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    plots.save(fig, path)
    return fig


def write_objectives(spec: dict[str, dict[str, Any]], out: str | os.PathLike,
                     plot: str | os.PathLike) -> dict[str, Any]:
    """results/objectives/table.md and its figure from {experiment name: {"folder": ..., "adapter": ...}}."""
    experiments = [experiment(name, s["folder"], s.get("adapter", "final")) for name, s in spec.items()]
    if not experiments:
        raise ValueError("objectives: no experiment given")
    figure(experiments, plot)
    write_text(out, markdown(experiments))
    return {"experiments": [e["name"] for e in experiments], "out": str(out), "plot": str(plot)}
