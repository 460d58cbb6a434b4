"""Learning-rate schedules shared by the training loops (base warm-up and ORPO)."""

from __future__ import annotations

import math
from typing import Callable

import mlx.core as mx
import mlx.optimizers as optim


def lr_schedule(kind: str, lr: float, total_steps: int, warmup_steps: int) -> Callable | float:
    """Linear warmup then `kind` decay ("cosine", "linear" to zero, or "constant")."""
    warmup_steps = max(0, min(warmup_steps, total_steps - 1))
    decay_steps = max(1, total_steps - warmup_steps)
    if kind == "cosine":
        decay = optim.cosine_decay(lr, decay_steps, 0.0)
    elif kind == "linear":
        decay = optim.linear_schedule(lr, 0.0, decay_steps)
    elif kind == "constant":
        decay = lambda step: mx.array(lr, mx.float32)  # noqa: E731
    else:
        raise ValueError(f"unknown schedule {kind!r}: expected cosine, linear or constant")
    if warmup_steps == 0:
        return decay
    # Start warmup at lr/warmup rather than 0 so the first step moves the weights.
    warm = optim.linear_schedule(lr / warmup_steps, lr, warmup_steps)
    return optim.join_schedules([warm, decay], [warmup_steps])


def warmup_steps_for(total_steps: int, warmup: float | int) -> int:
    """A warmup given as a fraction of the run (< 1) or as a step count."""
    return int(math.ceil(warmup * total_steps)) if 0 < warmup < 1 else int(warmup)


def lora_adamw(
    kind: str, lr: float, total_steps: int, warmup_steps: int, weight_decay: float, plus_ratio: float = 1.0,
) -> optim.Optimizer:
    """AdamW for LoRA weights; with plus_ratio != 1 (LoRA+, Hayou et al. 2024) the B matrices get lr * plus_ratio.

    B starts at zero and does all of the first steps' learning, so a faster B speeds up early training. The
    two rates follow the same schedule shape; both optimizers' states live in one tree, so checkpoints
    save and restore them like a single AdamW's.
    """
    base = optim.AdamW(learning_rate=lr_schedule(kind, lr, total_steps, warmup_steps), weight_decay=weight_decay)
    if plus_ratio == 1.0:
        return base
    fast = optim.AdamW(learning_rate=lr_schedule(kind, lr * plus_ratio, total_steps, warmup_steps),
                       weight_decay=weight_decay)
    return optim.MultiOptimizer([fast, base], [lambda path, _: path.endswith("lora_b")])
