"""The `ifeval` stage core: score each model's generations and compare them on the same prompts."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from orpo.eval.ifeval.bootstrap import METRICS, bootstrap_ci, bootstrap_diff
from orpo.eval.ifeval.score import read_responses, score_to_dir
from orpo.eval.ifeval.source import load_inputs
from orpo.folders import mark_complete
from orpo.io import atomic_path, write_json


def compare_models(
    inputs_path: str | Path, generations: dict[str, str | Path], out_json: str | Path, details_dir: str | Path,
    limit: int = 0, n_resamples: int = 1000, seed: int = 0,
) -> dict[str, Any]:
    """Write `out_json` with the four IFEval accuracies per model (and CIs), and per-model details.

    The first model named is the reference: every other model gets its difference to it, with a paired
    bootstrap CI over prompts. `inputs_path` is any prompt source: a jsonl, a dataset folder or a `hub:` id.
    """
    inputs = load_inputs(inputs_path)
    inputs = inputs[:limit] if limit > 0 else inputs
    scored: dict[str, tuple[list[dict], list[dict]]] = {}
    models: dict[str, Any] = {}
    with atomic_path(details_dir) as tmp:  # the details folder whole or not at all (orpo.folders)
        tmp.mkdir()
        for label, path in generations.items():
            strict, loose, summary = score_to_dir(inputs, read_responses(path), tmp / label)
            scored[label] = (strict, loose)
            models[label] = {
                **{m: summary[m] for m in METRICS},
                "prompts": summary["prompts"], "instructions": summary["instructions"],
                "ci95": bootstrap_ci(strict, loose, n_resamples=n_resamples, seed=seed),
                "by_instruction_strict": {k: v["accuracy"] for k, v in summary["strict"]["by_instruction"].items()},
                "generations": str(path),
            }
        mark_complete(tmp, "ifeval")
    labels = list(generations)
    reference = labels[0]
    differences = {
        f"{label}-{reference}": bootstrap_diff(*scored[label], *scored[reference], n_resamples=n_resamples, seed=seed)
        for label in labels[1:]
    }
    result = {"prompts": len(inputs), "inputs": str(inputs_path), "models": models, "differences": differences}
    write_json(out_json, result)
    return result
