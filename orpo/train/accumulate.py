"""Gradient accumulation: the mean gradient of equal-size micro-batches, one micro-batch's graph alive at a time."""

from __future__ import annotations

from typing import Any, Callable

import mlx.core as mx
from mlx.utils import tree_map

# (j, running sums by path) -> (metrics, the sums' tree once micro-batch j's gradients are added into them)
MicroStep = Callable[[int, dict[str, mx.array]], tuple[dict[str, mx.array], Any]]


def accumulate_grads(micro_step: MicroStep, n: int, shares: list[mx.array] | None = None,
                     evaluating: list[bool] | None = None) -> tuple[Any, dict[str, mx.array]]:
    """Mean gradients and metrics of `micro_step(0..n-1)`, each adding its gradients into the running sums.

    With equal-size micro-batches (the loss a mean over pairs) their mean gradient is the whole batch's. With
    `shares` (each micro-batch's part of the step's pairs, its loss already scaled by it) the sums are the step's
    mean and the metrics are weighted by them. Micro-batch j's graph is built while j - 1 computes, and started
    once j - 1 is done: the host's work overlaps the device's, yet one micro-batch's buffers are alive at a time.
    Only the sums dict holds the running sums, so each addition reuses the old sum's buffer: peak memory does not
    grow with `n`. `evaluating[j]`: micro_step(j) evaluates as it builds (the segmented backward adds into the
    sums segment by segment), so j - 1 is waited for first, leaving the sums to it alone.
    """
    sums: dict[str, mx.array] = {}
    total_metrics: dict[str, mx.array] = {}
    running = None  # the micro-batch computing: its gradients and metrics
    for j in range(n):
        if evaluating and evaluating[j]:
            mx.eval(running)
            running = None
        grads = None  # `sums` alone references the running sums while the next micro-batch adds into them
        metrics, grads = micro_step(j, sums)
        if shares is not None:
            metrics = {k: v * shares[j] for k, v in metrics.items()}
        total_metrics = dict(metrics) if j == 0 else {k: total_metrics[k] + metrics[k] for k in total_metrics}
        mx.eval(running)
        running = None
        mx.async_eval(grads, total_metrics)
        running = (grads, total_metrics)
    mx.eval(running)
    sums.clear()
    if shares is not None or n == 1:  # the sums are the step's mean already, or exactly the single batch's values
        return grads, total_metrics
    inv = 1.0 / n
    return tree_map(lambda g: g * inv, grads), {k: v * inv for k, v in total_metrics.items()}
