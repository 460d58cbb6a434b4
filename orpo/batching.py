"""Seeded, length-grouped batch orders and padding, shared by the training loops."""

from __future__ import annotations

import math
from typing import Sequence

import numpy as np


def batch_schedule(
    lengths: Sequence[int], batch_size: int, epochs: int, seed: int, max_steps: int = 0, window: int = 32,
) -> list[list[int]]:
    """Row indices of every step, reproducible from `seed`.

    Per epoch: a seeded permutation (the remainder of n / batch_size rows sits the epoch out), then
    windows of `window` batches are sorted by length and cut into batches, and the batches shuffled.
    Similar lengths share a batch, so little compute goes to padding, while the order stays random.
    """
    n = len(lengths)
    if n < batch_size:
        raise ValueError(f"{n} rows is fewer than batch_size {batch_size}")
    steps: list[list[int]] = []
    for epoch in range(epochs):
        rng = np.random.default_rng([seed, epoch])
        order = rng.permutation(n)[: n - n % batch_size]
        batches = []
        span = window * batch_size
        for start in range(0, len(order), span):
            chunk = sorted(order[start : start + span].tolist(), key=lambda i: lengths[i])
            batches += [chunk[i : i + batch_size] for i in range(0, len(chunk), batch_size)]
        steps += [batches[i] for i in rng.permutation(len(batches))]
        if max_steps and len(steps) >= max_steps:
            break
    return steps[:max_steps] if max_steps > 0 else steps


def ladder(n: int, unit: int, per_octave: int = 8) -> int:
    """The smallest size >= n on a ladder of `unit` multiples: every multiple up to per_octave units, then
    per_octave sizes per doubling (at most 1/per_octave of padding), so variable lengths give few shapes.

    Each distinct padded shape is a new `mx.compile` trace and new buffer sizes in MLX's cache: a run's
    shapes are bounded by the number of rungs below its longest row (about per_octave per doubling).
    """
    k = max(1, math.ceil(n / unit))
    step = 2 ** max(0, (k - 1).bit_length() - per_octave.bit_length())
    return int(math.ceil(k / step) * step * unit)


def first_fit(lengths: Sequence[int], capacity: int, most: int) -> list[list[int]]:
    """Indices of `lengths` in bins of `capacity`, longest first, each into the first bin it fits that holds fewer
    than `most` (first-fit decreasing; ties in index order, so the bins are reproducible)."""
    bins: list[list[int]] = []
    free: list[int] = []
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        if lengths[i] > capacity:
            raise ValueError(f"an item of {lengths[i]} does not fit a bin of {capacity}")
        j = next((j for j, f in enumerate(free) if f >= lengths[i] and len(bins[j]) < most), len(bins))
        if j == len(bins):
            bins.append([])
            free.append(capacity)
        bins[j].append(i)
        free[j] -= lengths[i]
    return bins


def pad_rows(rows: Sequence[Sequence[int]], pad: int, multiple: int = 16, extra: int = 0) -> np.ndarray:
    """Right-pad int rows to one length, `extra` plus a rung of `ladder(.., multiple)`, so few distinct shapes occur.

    extra=1 suits rows the model reads shifted by one (inputs = tokens[:, :-1]): their inputs are then a
    whole multiple long.
    """
    width = ladder(max(max(len(r) for r in rows) - extra, 1), multiple) + extra
    out = np.full((len(rows), width), pad, dtype=np.int32)
    for i, r in enumerate(rows):
        out[i, : len(r)] = r
    return out
