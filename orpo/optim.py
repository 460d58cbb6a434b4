"""Learning-rate schedules shared by the training loops (base warm-up and ORPO), and the flat AdamW of LoRA training."""

from __future__ import annotations

import math
from typing import Any, Callable

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
from mlx.utils import tree_flatten, tree_unflatten


def lr_schedule(kind: str, lr: float, total_steps: int, warmup_steps: int) -> Callable | float:
    """Linear warmup then `kind` decay ("cosine", "linear" to zero, "constant", or "inverse_sqrt").

    The rate is a function of the optimizer's update count k (0 for the first update).
    """
    if kind == "inverse_sqrt":
        return inverse_sqrt_schedule(lr, warmup_steps)
    warmup_steps = max(0, min(warmup_steps, total_steps - 1))
    decay_steps = max(1, total_steps - warmup_steps)
    if kind == "cosine":
        decay = optim.cosine_decay(lr, decay_steps, 0.0)
    elif kind == "linear":
        decay = optim.linear_schedule(lr, 0.0, decay_steps)
    elif kind == "constant":
        decay = lambda step: mx.array(lr, mx.float32)  # noqa: E731
    else:
        raise ValueError(f"unknown schedule {kind!r}: expected cosine, linear, constant or inverse_sqrt")
    if warmup_steps == 0:
        return decay
    # Start warmup at lr/warmup rather than 0 so the first step moves the weights.
    warm = optim.linear_schedule(lr / warmup_steps, lr, warmup_steps)
    return optim.join_schedules([warm, decay], [warmup_steps])


# transformers' timescale of an inverse-sqrt schedule without warmup.
INVERSE_SQRT_TIMESCALE = 10_000


def inverse_sqrt_schedule(lr: float, warmup_steps: int) -> Callable:
    """transformers' get_inverse_sqrt_schedule (the ORPO authors' schedule): update k runs at lr * k / warmup while
    k < warmup (the first update at 0, as there), then at lr / sqrt((k + timescale - warmup) / timescale), with
    timescale = warmup (so lr * sqrt(warmup / k)), or 10000 without warmup. No end: the run's length plays no part.
    """
    warmup = max(0, int(warmup_steps))
    timescale = warmup or INVERSE_SQRT_TIMESCALE

    def rate(step: mx.array) -> mx.array:
        k = mx.array(step).astype(mx.float32)
        warm = k / max(1, warmup)
        # The decay branch is also evaluated (and discarded) below warmup: keep its argument positive there.
        decay = mx.rsqrt(mx.maximum(k + (timescale - warmup), 1.0) / timescale)
        return lr * mx.where(k < warmup, warm, decay)

    return rate


def warmup_steps_for(total_steps: int, warmup: float | int) -> int:
    """A warmup given as a fraction of the run (< 1) or as a whole number of steps (>= 1)."""
    if 0 < warmup < 1:
        return int(math.ceil(warmup * total_steps))
    if warmup != int(warmup):
        raise ValueError(f"warmup {warmup!r}: a fraction of the run is < 1, a step count a whole number")
    return int(warmup)


class FlatAdamW:
    """AdamW (mlx's rule: decoupled decay, no bias correction) over the trainable weights held in one flat buffer
    per learning-rate group; the model's weights are views into it.

    A LoRA model has hundreds of small matrices, and updating them one by one costs a few kernel launches each:
    that launch cost, not arithmetic, bounds the update (bench/README.md). Flat, an update is one concatenation of
    the gradients, one norm and one fused kernel per group. The rule is elementwise, so each weight's arithmetic is
    the same as per-matrix AdamW's; only the clipping norm sums in a different order.
    """

    def __init__(self, rates: list[Callable | float], weight_decay: float, group_of: Callable[[str], int],
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8) -> None:
        self.rates = [r if callable(r) else (lambda step, r=r: mx.array(r, mx.float32)) for r in rates]
        self.weight_decay, self.group_of, self.betas, self.eps = weight_decay, group_of, betas, eps
        self.layout: list[tuple[str, tuple[int, ...], int, int]] = []  # (name, shape, group, offset in the group)
        self.state: dict[str, Any] = {"step": mx.array(0, mx.uint64), "p": [], "m": [], "v": []}
        self.attaches = 0  # attach() calls: weights taken from the model (a start, a checkpoint restore)

    def attach(self, model: nn.Module, moments: dict[str, mx.array] | None = None) -> None:
        """Take the model's trainable weights into the flat buffers (moments from `moments` or zero); views back.

        Weights loaded into the model from outside (a checkpoint) must come through here, or the next update
        overwrites them with the buffers'.
        """
        params = tree_flatten(model.trainable_parameters())
        groups: list[list[mx.array]] = [[] for _ in self.rates]
        sizes = [0] * len(self.rates)
        self.layout = []
        for name, w in params:
            g = self.group_of(name)
            self.layout.append((name, tuple(w.shape), g, sizes[g]))
            groups[g].append(w.reshape(-1))
            sizes[g] += w.size
        flat = lambda arrays: mx.concatenate(arrays) if arrays else mx.zeros((0,), mx.float32)  # noqa: E731
        self.state["p"] = [flat(a) for a in groups]
        for k in ("m", "v"):
            if moments is None:
                self.state[k] = [mx.zeros_like(p) for p in self.state["p"]]
            else:
                parts: list[list[mx.array]] = [[] for _ in self.rates]
                for name, _, g, _ in self.layout:
                    parts[g].append(moments[f"{name}.{k}"].reshape(-1))
                self.state[k] = [flat(a) for a in parts]
        mx.eval(self.state)
        self._publish(model)
        self.attaches += 1

    def _publish(self, model: nn.Module) -> None:
        views = [(name, self.state["p"][g][o : o + math.prod(shape)].reshape(shape))
                 for name, shape, g, o in self.layout]
        model.update(tree_unflatten(views))

    def update(self, model: nn.Module, grads: Any, clip: float) -> tuple[mx.array, mx.array]:
        """Clip the gradients to global norm `clip` (0: no clipping) and apply one step; returns (norm, rate).

        The rate returned is the last group's (LoRA+'s A matrices, or the only group).
        """
        by_name = dict(tree_flatten(grads))
        parts: list[list[mx.array]] = [[] for _ in self.rates]
        for name, _, g, _ in self.layout:
            parts[g].append(by_name[name].reshape(-1))
        flat = [mx.concatenate(a).astype(p.dtype) if a else mx.zeros_like(p) for a, p in zip(parts, self.state["p"])]
        norm = mx.sqrt(sum(mx.sum(mx.square(g)) for g in flat))
        if clip > 0:
            scale = mx.minimum(clip / (norm + 1e-6), 1.0)  # mlx.optimizers.clip_grad_norm's rule
            flat = [g * scale for g in flat]
        b1, b2 = self.betas
        step = self.state["step"]
        rates = [rate(step) for rate in self.rates]
        for i, (g, lr) in enumerate(zip(flat, rates)):
            p, m, v = self.state["p"][i], self.state["m"][i], self.state["v"][i]
            lr = lr.astype(g.dtype)
            m = b1 * m + (1 - b1) * g
            v = b2 * v + (1 - b2) * mx.square(g)
            p = p * (1 - lr * self.weight_decay) - lr * m / (mx.sqrt(v) + self.eps)
            self.state["p"][i], self.state["m"][i], self.state["v"][i] = p, m, v
        self.state["step"] = step + 1
        self._publish(model)
        return norm, rates[-1]

    def state_dict(self) -> dict[str, mx.array]:
        """Step count and moments, one array per weight (by the weight's name): what a checkpoint saves."""
        out = {"step": self.state["step"]}
        for name, shape, g, o in self.layout:
            for k in ("m", "v"):
                out[f"{name}.{k}"] = self.state[k][g][o : o + math.prod(shape)].reshape(shape)
        return out

    def load_state_dict(self, model: nn.Module, state: dict[str, mx.array]) -> None:
        """Restore a checkpoint's moments and step over the model's (just loaded) weights."""
        self.attach(model, state)
        self.state["step"] = state["step"]


def lora_adamw(
    kind: str, lr: float, total_steps: int, warmup_steps: int, weight_decay: float, plus_ratio: float = 1.0,
) -> FlatAdamW:
    """AdamW for LoRA weights; with plus_ratio != 1 (LoRA+, Hayou et al. 2024) the B matrices get lr * plus_ratio.

    B starts at zero and does all of the first steps' learning, so a faster B speeds up early training. The
    two rates follow the same schedule shape.
    """
    base = lr_schedule(kind, lr, total_steps, warmup_steps)
    if plus_ratio == 1.0:
        return FlatAdamW([base], weight_decay, lambda name: 0)
    fast = lr_schedule(kind, lr * plus_ratio, total_steps, warmup_steps)
    return FlatAdamW([fast, base], weight_decay, lambda name: 0 if name.endswith("lora_b") else 1)
