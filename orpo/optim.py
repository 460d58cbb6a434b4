"""Learning-rate schedules shared by the training loops (base warm-up and ORPO), and the flat AdamW of ORPO training."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
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


@dataclass
class Bucket:
    """One flat buffer of the optimizer: weights of one rate group and one dtype, laid end to end."""

    group: int
    dtype: Any  # the model's dtype of these weights (the buffer itself is in the master dtype)
    names: list[str] = field(default_factory=list)
    shapes: list[tuple[int, ...]] = field(default_factory=list)
    offsets: list[int] = field(default_factory=list)
    size: int = 0

    def add(self, name: str, shape: tuple[int, ...]) -> None:
        self.names.append(name)
        self.shapes.append(shape)
        self.offsets.append(self.size)
        self.size += math.prod(shape)

    def flat(self, arrays: dict[str, mx.array]) -> mx.array:
        """The named arrays as one flat array (a lone weight's is a view of it, not a copy)."""
        parts = [arrays[name].reshape(-1) for name in self.names]
        return parts[0] if len(parts) == 1 else mx.concatenate(parts)

    def views(self, flat: mx.array) -> list[tuple[str, mx.array]]:
        """Each weight as a view of the flat buffer, by name."""
        if len(self.names) == 1:
            return [(self.names[0], flat.reshape(self.shapes[0]))]
        return [(name, flat[o : o + math.prod(shape)].reshape(shape))
                for name, shape, o in zip(self.names, self.shapes, self.offsets)]


# 2^15 as the low half of a float32's bits: from here up the high half was rounded up (see split_float32).
_HALF = 0x8000


def split_float32(x: mx.array) -> tuple[mx.array, mx.array]:
    """A float32 array as (its bf16 rounding, the low 16 bits of its bits): 4 bytes that hold it exactly.

    The bf16 half is the float32's top 16 bits rounded to nearest (ties away from zero, where mlx's cast rounds
    ties to even: a tie is 1 in 65,536 values), so it is the weight a bf16 model computes with, and
    `join_float32` undoes the split bit for bit.
    """
    bits = mx.view(x, mx.uint32)
    low = (bits & 0xFFFF).astype(mx.uint16)
    high = ((bits >> 16) + (low >= _HALF).astype(mx.uint32)).astype(mx.uint16)
    return mx.view(high, mx.bfloat16), low


def join_float32(high: mx.array, low: mx.array) -> mx.array:
    """The float32 array `split_float32` split into (high, low)."""
    top = (mx.view(high, mx.uint16) - (low >= _HALF).astype(mx.uint16)).astype(mx.uint32)
    return mx.view((top << 16) | low.astype(mx.uint32), mx.float32)


def master_extra_bytes(dtype: Any, master: Any) -> int:
    """Bytes per weight a master of dtype `master` takes beside a weight of `dtype`: 0 for none, 2 for a split
    float32 under bf16 (its low half), else the master's own size."""
    if master == dtype:
        return 0
    return 2 if (dtype, master) == (mx.bfloat16, mx.float32) else master.size


def adamw_rule(p, m, v, g, lr, scale, weight_decay: float, betas: tuple[float, float], eps: float, correction):
    """One AdamW step of flat arrays in their (master) dtype: decoupled decay, then the moment step; `correction`
    is None (mlx's rule) or (1 - b1^t, sqrt(1 - b2^t)) for torch's bias-corrected one."""
    b1, b2 = betas
    g = g * scale
    m = b1 * m + (1 - b1) * g
    v = b2 * v + (1 - b2) * mx.square(g)
    p = p * (1 - lr * weight_decay)
    if correction is None:
        return p - lr * m / (mx.sqrt(v) + eps), m, v
    c1, c2 = correction
    return p - (lr / c1) * m / (mx.sqrt(v) / c2 + eps), m, v


class FlatAdamW:
    """AdamW (decoupled decay; mlx's rule without bias correction, or torch's with it) over the trainable weights
    held in flat buffers per learning-rate group; the model's weights are views into them.

    A LoRA model has hundreds of small matrices, and updating them one by one costs a few kernel launches each:
    that launch cost, not arithmetic, bounds the update (bench/README.md). Flat, an update is one concatenation of
    the gradients, one norm and one fused kernel per group. The rule is elementwise, so each weight's arithmetic is
    the same as per-matrix AdamW's; only the clipping norm sums in a different order.

    `master_dtype` (full-parameter training of a bf16 model): the update runs on master weights and moments in
    this dtype, so updates far below the model dtype's resolution still add up. A bf16 weight's float32 master
    is held as the bf16 weight itself plus the low 16 bits of the master's (`split_float32`): exact, in 2 bytes
    more per weight instead of 4; another dtype's master is a copy whose rounding the model gets after each
    update. `bucket_elements` > 0 cuts each group into buffers of at most that many elements (a larger weight
    alone) and `bucketwise` evaluates the update one buffer at a time, each in place: its temporaries are then
    one buffer's, not the model's.
    """

    def __init__(self, rates: list[Callable | float], weight_decay: float, group_of: Callable[[str], int],
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8, master_dtype: Any = None,
                 bucket_elements: int = 0, bias_correction: bool = False, bucketwise: bool = False) -> None:
        self.rates = [r if callable(r) else (lambda step, r=r: mx.array(r, mx.float32)) for r in rates]
        self.weight_decay, self.group_of, self.betas, self.eps = weight_decay, group_of, betas, eps
        self.master_dtype, self.bucket_elements = master_dtype, bucket_elements
        self.bias_correction, self.bucketwise = bias_correction, bucketwise
        self.buckets: list[Bucket] = []
        # p: the stored weights (the master where it is a copy); low: the master's low bits where it is split.
        self.state: dict[str, Any] = {"step": mx.array(0, mx.uint64), "p": [], "m": [], "v": [], "low": []}
        self.attaches = 0  # attach() calls: weights taken from the model (a start, a checkpoint restore)
        self._rules: dict[int, Callable] = {}

    def _master(self, dtype: Any) -> Any:
        return dtype if self.master_dtype is None else self.master_dtype

    def _split(self, b: Bucket) -> bool:
        return master_extra_bytes(b.dtype, self._master(b.dtype)) == 2

    def _layout(self, params: list[tuple[str, mx.array]]) -> list[Bucket]:
        """The buckets of the model's trainable weights: by group (in group order), dtype and bucket_elements."""
        buckets: list[Bucket] = []
        for g in range(len(self.rates)):
            open_: dict[Any, Bucket] = {}
            for name, w in params:
                if self.group_of(name) != g:
                    continue
                b = open_.get(w.dtype)
                if b is None or (self.bucket_elements > 0 and b.size and b.size + w.size > self.bucket_elements):
                    b = open_[w.dtype] = Bucket(g, w.dtype)
                    buckets.append(b)
                b.add(name, tuple(w.shape))
        return buckets

    def attach(self, model: nn.Module, state: dict[str, mx.array] | None = None) -> None:
        """Take the model's trainable weights into the flat buffers (moments from a checkpoint's `state` or zero;
        master weights from its `<name>.master` arrays where it has them); the model gets views back.

        Weights loaded into the model from outside (a checkpoint) must come through here, or the next update
        overwrites them with the buffers'. Bucket by bucket, so only one bucket's weights exist twice at a time.
        """
        params = tree_flatten(model.trainable_parameters())
        self.buckets = self._layout(params)
        weights = dict(params)
        del params
        for k in ("p", "m", "v", "low"):
            self.state[k] = []
        for b in self.buckets:
            master = self._master(b.dtype)
            if state is not None and f"{b.names[0]}.master" in state:
                p = b.flat({n: state[f"{n}.master"] for n in b.names}).astype(master)
            else:
                p = b.flat(weights).astype(master)
            if state is None:
                m, v = mx.zeros_like(p), mx.zeros_like(p)
            else:
                m, v = (b.flat({n: state[f"{n}.{k}"] for n in b.names}).astype(master) for k in ("m", "v"))
            low = mx.zeros((0,), mx.uint16)
            if self._split(b):
                p, low = split_float32(p)
            mx.eval(p, m, v, low)
            for k, x in zip(("p", "m", "v", "low"), (p, m, v, low)):
                self.state[k].append(x)
            self._publish_bucket(model, len(self.state["p"]) - 1)
            for n in b.names:
                weights.pop(n)
        mx.eval(model.trainable_parameters())
        self.attaches += 1

    def _publish_bucket(self, model: nn.Module, i: int) -> None:
        b, p = self.buckets[i], self.state["p"][i]
        model.update(tree_unflatten(b.views(p if p.dtype == b.dtype else p.astype(b.dtype))))

    def master(self, i: int) -> mx.array:
        """Bucket i's weights in the master dtype (joined from their halves where split)."""
        p = self.state["p"][i]
        return join_float32(p, self.state["low"][i]) if self._split(self.buckets[i]) else p

    def _rule(self, split: bool) -> Callable:
        """The bucket update (stored weights, low bits, moments, gradient, rate, scale, corrections) -> the new
        stored weights, low bits and moments; compiled, one per storage kind."""
        if split not in self._rules:
            corrected = self.bias_correction

            def rule(p, low, m, v, g, lr, scale, c1, c2):
                master = join_float32(p, low) if split else p
                g = g.astype(master.dtype)
                master, m, v = adamw_rule(master, m, v, g, lr.astype(g.dtype), scale.astype(g.dtype),
                                          self.weight_decay, self.betas, self.eps, (c1, c2) if corrected else None)
                p, low = split_float32(master) if split else (master, low)
                return p, low, m, v
            self._rules[split] = mx.compile(rule)
        return self._rules[split]

    def update(self, model: nn.Module, grads: Any, clip: float) -> tuple[mx.array, mx.array]:
        """Clip the gradients to global norm `clip` (0: no clipping) and apply one step; returns (norm, rate).

        The rate returned is the last group's (LoRA+'s A matrices, or the only group).
        """
        by_name = dict(tree_flatten(grads))
        flat = [b.flat(by_name) if b.names else mx.zeros_like(p) for b, p in zip(self.buckets, self.state["p"])]
        # Squared in the gradients' dtype, summed in float32: a float32 copy of every gradient, needed both here
        # and by the update after it, would be kept whole until the norm is known.
        squares = [mx.sum(mx.square(g).astype(mx.float32)) for g in flat]
        if self.bucketwise:  # one bucket's squares at a time; lazily, the graph holds every bucket's at once
            for sq in squares:
                mx.eval(sq)
        norm = mx.sqrt(sum(squares))
        # mlx.optimizers.clip_grad_norm's rule; scaling by 1 is exact, so no clipping is scale 1.
        scale = mx.minimum(clip / (norm + 1e-6), 1.0) if clip > 0 else mx.array(1.0, mx.float32)
        step = self.state["step"]
        rates = [rate(step) for rate in self.rates]
        t = (step + 1).astype(mx.float32)  # torch's step count: 1 at the first update
        correction = (1 - self.betas[0] ** t, mx.sqrt(1 - self.betas[1] ** t))
        for i, b in enumerate(self.buckets):
            old = [self.state[k][i] for k in ("p", "low", "m", "v")]
            for k in ("p", "low", "m", "v"):
                self.state[k][i] = None  # held by the graph alone, so the new arrays may reuse their memory
            new = self._rule(self._split(b))(*old, flat[i], rates[b.group], scale, *correction)
            del old
            flat[i] = None
            for k, x in zip(("p", "low", "m", "v"), new):
                self.state[k][i] = x
            if self.bucketwise:
                mx.eval(new)
                self._publish_bucket(model, i)
            del new
        self.state["step"] = step + 1
        if not self.bucketwise:
            self._publish(model)
        return norm, rates[-1]

    def _publish(self, model: nn.Module) -> None:
        for i in range(len(self.buckets)):
            self._publish_bucket(model, i)

    def state_dict(self) -> dict[str, mx.array]:
        """Step count and moments, one array per weight (by the weight's name), and the master weights where the
        model holds a rounding of them (`<name>.master`, float32 whether held split or as a copy): what a
        checkpoint saves."""
        out = {"step": self.state["step"]}
        for i, b in enumerate(self.buckets):
            arrays = {"m": self.state["m"][i], "v": self.state["v"][i]}
            if self._master(b.dtype) != b.dtype:
                arrays["master"] = self.master(i)
            for k, flat in arrays.items():
                for name, view in b.views(flat):
                    out[f"{name}.{k}"] = view
        return out

    def load_state_dict(self, model: nn.Module, state: dict[str, mx.array]) -> None:
        """Restore a checkpoint's moments, master weights and step over the model's (just loaded) weights."""
        self.attach(model, state)
        self.state["step"] = state["step"]

    def nbytes(self) -> int:
        """Bytes the optimizer holds beyond the model's weights: master copies or low halves, and the moments."""
        own = sum(p.nbytes for b, p in zip(self.buckets, self.state["p"]) if p.dtype != b.dtype)
        return own + sum(x.nbytes for k in ("m", "v", "low") for x in self.state[k])


def lora_adamw(
    kind: str, lr: float, total_steps: int, warmup_steps: int, weight_decay: float, plus_ratio: float = 1.0,
    bias_correction: bool = False,
) -> FlatAdamW:
    """AdamW for LoRA weights; with plus_ratio != 1 (LoRA+, Hayou et al. 2024) the B matrices get lr * plus_ratio.

    B starts at zero and does all of the first steps' learning, so a faster B speeds up early training. The
    two rates follow the same schedule shape.
    """
    base = lr_schedule(kind, lr, total_steps, warmup_steps)
    if plus_ratio == 1.0:
        return FlatAdamW([base], weight_decay, lambda name: 0, bias_correction=bias_correction)
    fast = lr_schedule(kind, lr * plus_ratio, total_steps, warmup_steps)
    return FlatAdamW([fast, base], weight_decay, lambda name: 0 if name.endswith("lora_b") else 1,
                     bias_correction=bias_correction)
