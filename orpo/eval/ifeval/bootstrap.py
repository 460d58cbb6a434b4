"""Percentile bootstrap confidence intervals for the four IFEval metrics, resampling prompts.

Prompts are the unit of resampling for all four metrics; the instruction-level accuracies are
ratios (instructions followed / instructions) over the resampled prompts, so a prompt's
instructions stay together, as they are not independent.
"""

from __future__ import annotations

import numpy as np

from .score import check_paired

METRICS = ("prompt_level_strict_acc", "inst_level_strict_acc", "prompt_level_loose_acc", "inst_level_loose_acc")


def _table(strict: list[dict], loose: list[dict]) -> np.ndarray:
    """Per prompt: strict all-followed, strict followed count, loose all-followed, loose count, instructions."""
    if not strict:
        raise ValueError("no results to bootstrap")
    check_paired(strict, loose)
    return np.array(
        [
            [
                all(s["follow_instruction_list"]),
                sum(map(bool, s["follow_instruction_list"])),
                all(lo["follow_instruction_list"]),
                sum(map(bool, lo["follow_instruction_list"])),
                len(s["follow_instruction_list"]),
            ]
            for s, lo in zip(strict, loose, strict=True)
        ],
        dtype=np.float64,
    )


def _metrics(sums: np.ndarray, n: int) -> np.ndarray:
    """Metrics (last axis, in METRICS order) from column sums over n prompts."""
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.stack(
            [sums[..., 0] / n, sums[..., 1] / sums[..., 4], sums[..., 2] / n, sums[..., 3] / sums[..., 4]],
            axis=-1,
        )


def _resample_sums(tables: list[np.ndarray], n_resamples: int, seed: int) -> list[np.ndarray]:
    if n_resamples < 1:
        raise ValueError(f"n_resamples must be >= 1, got {n_resamples}")
    n = len(tables[0])
    idx = np.random.default_rng(seed).integers(0, n, size=(n_resamples, n))
    # Same indices for every table: that is what makes a difference paired.
    return [t[idx].sum(axis=1) for t in tables]


def _interval(point: np.ndarray, samples: np.ndarray, level: float) -> dict[str, dict[str, float]]:
    if not 0 < level < 1:
        raise ValueError(f"level must be in (0, 1), got {level}")
    tail = (1 - level) / 2
    lo, hi = np.quantile(samples, [tail, 1 - tail], axis=0)
    return {m: {"estimate": float(point[i]), "lo": float(lo[i]), "hi": float(hi[i])} for i, m in enumerate(METRICS)}


def bootstrap_ci(
    strict: list[dict], loose: list[dict], n_resamples: int = 1000, seed: int = 0, level: float = 0.95
) -> dict[str, dict[str, float]]:
    """Per metric the point estimate and the percentile bootstrap interval (lo, hi) over prompts."""
    table = _table(strict, loose)
    n = len(table)
    (sums,) = _resample_sums([table], n_resamples, seed)
    return _interval(_metrics(table.sum(axis=0), n), _metrics(sums, n), level)


def _align(a: list[dict], b: list[dict]) -> list[dict]:
    """`b` reordered to follow `a`'s prompts; both must hold the same prompts."""
    pa, pb = [r["prompt"] for r in a], [r["prompt"] for r in b]
    if pa == pb:
        return b
    by_prompt = {r["prompt"]: r for r in b}
    if len(by_prompt) != len(pb) or len(set(pa)) != len(pa) or set(pa) != set(by_prompt):
        raise ValueError("paired bootstrap needs the same prompts, each once, in both result sets")
    return [by_prompt[p] for p in pa]


def bootstrap_diff(
    a_strict: list[dict],
    a_loose: list[dict],
    b_strict: list[dict],
    b_loose: list[dict],
    n_resamples: int = 1000,
    seed: int = 0,
    level: float = 0.95,
) -> dict[str, dict[str, float]]:
    """Per metric the paired difference a - b (a = trained, b = base) and its bootstrap interval."""
    ta = _table(a_strict, a_loose)
    tb = _table(_align(a_strict, b_strict), _align(a_loose, b_loose))
    n = len(ta)
    sa, sb = _resample_sums([ta, tb], n_resamples, seed)
    point = _metrics(ta.sum(axis=0), n) - _metrics(tb.sum(axis=0), n)
    return _interval(point, _metrics(sa, n) - _metrics(sb, n), level)
