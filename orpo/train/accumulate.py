"""Gradient accumulation: the mean gradient of equal-size micro-batches, one micro-batch's graph alive at a time."""

from __future__ import annotations

from typing import Any, Callable

import mlx.core as mx
from mlx.utils import tree_map

MicroStep = Callable[[int], tuple[dict[str, mx.array], Any]]


def accumulate_grads(micro_step: MicroStep, n: int) -> tuple[Any, dict[str, mx.array]]:
    """Mean gradients and metrics of `micro_step(0..n-1)`, each a (metrics, grads) of one micro-batch.

    The loss is a mean over pairs, so with equal-size micro-batches the mean of their gradients is the
    gradient of the whole batch. The running sums are evaluated after every micro-batch, so its forward
    and backward graph is freed before the next one is built: peak memory does not grow with `n`.
    """
    total_grads: Any = None
    total_metrics: dict[str, mx.array] = {}
    for j in range(n):
        metrics, grads = micro_step(j)
        if total_grads is None:
            total_grads, total_metrics = grads, dict(metrics)
        else:
            total_grads = tree_map(mx.add, total_grads, grads)
            total_metrics = {k: total_metrics[k] + metrics[k] for k in total_metrics}
        mx.eval(total_grads, total_metrics)
    if n == 1:
        return total_grads, total_metrics  # exactly the single batch's values
    inv = 1.0 / n
    return tree_map(lambda g: g * inv, total_grads), {k: v * inv for k, v in total_metrics.items()}
