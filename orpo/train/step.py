"""One ORPO training step, top to bottom: pairs -> rows -> log-probs -> loss -> gradients.

`prepare` packs a micro-batch's pairs into the engine's rows on the host; `batch_value_and_grad` runs
them through the model (orpo.engine: our stack forward, the log-prob head, the segmented backward) to
per-sequence mean log-probs, the ORPO loss over them and the LoRA gradients. The settings
(train.engine: head x segment_layers x prefix_sharing x width_multiple x compile) compose freely and give
the same loss and gradients within float tolerance. All naive, no segments, no sharing is the plain path:
full logits of [chosen; rejected] rows under nn.value_and_grad, the oracle the others are tested against.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from orpo.config import section_defaults
from orpo.device import on_cuda
from orpo.engine.attention import CUDNN_MAX_HEAD_DIM, exclusion_fits
from orpo.engine.compiled import kept, layout_arrays, layout_from
from orpo.engine.head import LMHead, fused_logp_eager, lm_head_of, response_mean_logps, token_logp
from orpo.engine.segmented import Params, segmented_value_and_grad
from orpo.engine.stack import Stack, head_dim_of
from orpo.train.data import Pairs, pair_batch
from orpo.train.lora import refuse_mlp_dropout
from orpo.train.rows import PACKED_ATTENTION, PackedPairs, plain_rows, shared_rows

# --- the settings ---

ENGINE_DEFAULTS: dict[str, Any] = section_defaults("train")["engine"]


def resolve_engine(engine: dict[str, Any] | None) -> dict[str, Any]:
    """Defaults overlaid with `engine`, checked (a clear error names the bad train.engine field), "auto" decided."""
    e = {**ENGINE_DEFAULTS, **(engine or {})}
    unknown = set(e) - set(ENGINE_DEFAULTS)
    if unknown:
        raise ValueError(f"train.engine: unknown settings {sorted(unknown)} (known: {sorted(ENGINE_DEFAULTS)})")
    if e["head"] not in ("naive", "fused"):
        raise ValueError(f"train.engine.head: {e['head']!r} is not one of naive, fused")
    if int(e["segment_layers"]) < 0 or int(e["head_chunk"]) < 0:
        raise ValueError(f"train.engine: segment_layers >= 0, head_chunk >= 0 (got {e})")
    if int(e["mlp_chunks"]) < 1:
        raise ValueError(f"train.engine.mlp_chunks: must be >= 1 (got {e['mlp_chunks']})")
    if int(e["overlap"]) < 0 or float(e["memory_limit_gb"]) < 0:
        raise ValueError(f"train.engine.overlap and train.engine.memory_limit_gb: must be >= 0 "
                         f"(got {e['overlap']}, {e['memory_limit_gb']})")
    c = e["cache_limit_gb"]
    if c != "auto" and (isinstance(c, (str, bool)) or float(c) < 0):
        raise ValueError(f"train.engine.cache_limit_gb: must be auto or a number >= 0 (got {c!r})")
    if int(e["width_multiple"]) < 0:
        raise ValueError(f"train.engine.width_multiple: must be >= 0 (got {e['width_multiple']})")
    if e["prefix_sharing"] not in ("auto", True, False):
        raise ValueError(f"train.engine.prefix_sharing: {e['prefix_sharing']!r} is not one of auto, true, false")
    if e["prefix_attention"] not in PACKED_ATTENTION:
        raise ValueError(f"train.engine.prefix_attention: {e['prefix_attention']!r} is not one of "
                         f"{', '.join(PACKED_ATTENTION)}")
    if e["compile"] not in ("auto", True, False):
        raise ValueError(f"train.engine.compile: {e['compile']!r} is not one of auto, true, false")
    if e["compile"] == "auto":
        # Measured on an H200: 1.43-1.51x tokens/s for the fused head at widths of 128 (bench/README.md). On the
        # CPU each new shape's first call also pays a trace and a C++ build of its kernels: off there.
        e["compile"] = on_cuda()
    if e["prefix_sharing"] == "auto":
        # On everywhere. H200, fused head, widths of 128, compiled: 1.03x tokens/s at 0.86x peak with prompt =
        # response, 1.27x at 0.82x with prompt = 2x response (1.25x with prompts of their own lengths; naive
        # head uncompiled 1.41-1.46x); CPU 1.7-1.9x (bench/README.md).
        e["prefix_sharing"] = True
    return e


# MLX's CUDA attention runs its cuDNN backward only for query lengths that are a multiple of 128; other
# lengths differentiate the unfused fallback ([B, H, L, L] scores kept). Measured on an H200 at a Llama-1B
# layer (B 8, L 1024, bf16): causal fwd+bwd 1.03 ms at L 1024 against 7.54 ms at L 1023.
CUDA_ATTENTION_MULTIPLE = 128


def input_multiple(engine: dict[str, Any]) -> int | None:
    """What the forward's input length is padded to a multiple of (None: the loader's 16-token rounding)."""
    m = int(engine["width_multiple"])
    if m == 0:
        return CUDA_ATTENTION_MULTIPLE if on_cuda() else None
    return m


# The trainer's original path: naive head, plain backward, no sharing (the oracle).
PLAIN: dict[str, Any] = {"head": "naive", "segment_layers": 0, "prefix_sharing": False}


def is_plain(engine: dict[str, Any]) -> bool:
    """Whether the settings ask for the trainer's original path (PLAIN)."""
    return all(engine[k] == v for k, v in PLAIN.items())


def tight_rows_fit(model: nn.Module) -> bool:
    """Whether prefix rows of pairs of their own lengths may be tight here (exclusion dims at full speed)."""
    return exclusion_fits(head_dim_of(model), on_cuda())


def check_attention(model: nn.Module, engine: dict[str, Any]) -> None:
    """Refuse a prefix attention that would run MLX's unfused fallback on this model and device."""
    if engine["prefix_sharing"] and engine["prefix_attention"] == "exclusion" and not tight_rows_fit(model):
        raise ValueError(f"train.engine.prefix_attention: exclusion widens this model's head dim "
                         f"({head_dim_of(model)}) past the {CUDNN_MAX_HEAD_DIM} MLX's CUDA attention runs fused "
                         "(the fallback keeps [B, H, L, L] scores); use auto or split")


# --- pairs -> rows ---


def pack(pairs: Pairs, engine: dict[str, Any], tight: bool = True) -> PackedPairs:
    """The forward rows of `pairs`: shared-prefix rows (tight ones only where `tight`), or the plain rows."""
    m = input_multiple(engine)
    if not engine["prefix_sharing"]:
        return plain_rows(pairs, m)
    return shared_rows(pairs, m, engine["prefix_attention"], tight)


@dataclass(frozen=True)
class MicroBatch:
    """One micro-batch as the step reads it, built on the host ahead of its step (nothing runs on the device).

    `packed` holds the engine's rows, `plain` the oracle path's [chosen; rejected] tokens and scoring mask.
    The counts: `scored` response tokens, `row_tokens` and `two_forward_tokens` the pairs' tokens as the
    rows hold them and as two forwards would, `positions` the rows' size with their padding.
    """

    n: int
    scored: int
    row_tokens: int
    two_forward_tokens: int
    positions: int
    packed: PackedPairs | None = None
    plain: tuple[mx.array, mx.array] | None = None

    def signature(self) -> tuple:
        """The shapes (and split structure) a compiled step is traced for: one trace per distinct signature."""
        return self.packed.signature() if self.packed is not None else (tuple(self.plain[0].shape),)


def prepare(pairs: Pairs, engine: dict[str, Any] | None, tight: bool = True) -> MicroBatch:
    """The forward rows of `pairs` for the engine's settings (host work only); `tight` as `pack` takes it."""
    e = resolve_engine(engine)
    n = len(pairs)
    scored = sum(map(sum, pairs.chosen_mask + pairs.rejected_mask))
    if is_plain(e):
        tokens, mask = pair_batch(pairs, list(range(n)), input_multiple(e))
        full = sum(2 * len(p) + len(c) + len(r) for p, c, r in zip(pairs.prompt, pairs.chosen, pairs.rejected))
        return MicroBatch(n, scored, full, full, int(tokens.size), plain=(tokens, mask))
    packed = pack(pairs, e, tight)
    return MicroBatch(n, scored, packed.row_tokens, packed.two_forward_tokens, int(packed.layout.tokens.size),
                      packed=packed)


# --- rows -> log-probs ---


def scored_rows(hidden: mx.array, packed: PackedPairs) -> mx.array:
    """The final hidden states [M, H] that predict the scored tokens, in packed.targets' order."""
    return mx.take(hidden.reshape(-1, hidden.shape[-1]), packed.index, axis=0)


def packed_logps(head: LMHead, hidden: mx.array, packed: PackedPairs, engine: dict[str, Any]) -> mx.array:
    """Mean response log-prob of each sequence [2B] (chosen rows, then rejected) from final hidden states."""
    logp = token_logp(head, scored_rows(hidden, packed), packed.targets, engine["head"] == "fused",
                      int(engine["head_chunk"]))
    return packed.weights @ logp


# --- log-probs -> loss (Hong et al. 2024) ---

_LN_HALF = -math.log(2.0)


def log1mexp(x: mx.array) -> mx.array:
    """log(1 - exp(x)) for x < 0, stable at both ends (Maechler's two-branch form).

    Each branch gets a clamped input so the branch `where` discards never produces inf/NaN, whose
    gradient would otherwise poison the one it keeps.
    """
    x = mx.minimum(x, -1e-12)
    near = x > _LN_HALF
    x_near = mx.where(near, x, _LN_HALF)
    x_far = mx.where(near, _LN_HALF, x)
    return mx.where(near, mx.log(-mx.expm1(x_near)), mx.log1p(-mx.exp(x_far)))


def orpo_terms(logp_chosen: mx.array, logp_rejected: mx.array) -> tuple[mx.array, mx.array, mx.array]:
    """Per row: (nll, or_loss, log_odds) from mean response log-probs l_w, l_r.

    log_odds = (l_w - l_r) - (log1mexp(l_w) - log1mexp(l_r)); or_loss = -log sigmoid(log_odds); nll = -l_w.
    """
    log_odds = (logp_chosen - logp_rejected) - (log1mexp(logp_chosen) - log1mexp(logp_rejected))
    or_loss = -nn.log_sigmoid(log_odds)
    return -logp_chosen, or_loss, log_odds


def orpo_loss(logp_chosen: mx.array, logp_rejected: mx.array, lam: float) -> tuple[mx.array, dict[str, mx.array]]:
    """Batch mean of NLL(chosen) + lambda * L_OR, and the metrics the trainer logs."""
    nll, or_loss, log_odds = orpo_terms(logp_chosen, logp_rejected)
    loss = (nll + lam * or_loss).mean()
    metrics = {
        "loss": loss,
        "nll": nll.mean(),
        "or_loss": or_loss.mean(),
        "log_odds": log_odds.mean(),
        "logp_chosen": logp_chosen.mean(),
        "logp_rejected": logp_rejected.mean(),
        "accuracy": (logp_chosen > logp_rejected).astype(mx.float32).mean(),
        "margin": (logp_chosen - logp_rejected).mean(),
    }
    return loss, metrics


def naive_pair_loss(model: nn.Module, tokens: mx.array, mask: mx.array, n: int, lam: float) -> tuple[mx.array, dict[str, mx.array]]:
    """ORPO loss and metrics of a [chosen; rejected] batch of n pairs, full logits (the trainer's original loss)."""
    logps = response_mean_logps(model, tokens, mask)
    return orpo_loss(logps[:n], logps[n:], lam)


def whole_loss(model: nn.Module, packed: PackedPairs, n: int, lam: float,
               e: dict[str, Any]) -> tuple[mx.array, dict[str, mx.array]]:
    """ORPO loss and metrics of n pairs' packed rows through the whole stack and the head (one graph)."""
    hidden = Stack(model).hidden(packed.layout)
    logps = packed_logps(lm_head_of(model), hidden, packed, e)
    return orpo_loss(logps[:n], logps[n:], lam)


# --- loss -> gradients ---


def batch_value_and_grad(model: nn.Module, batch: MicroBatch, lam: float,
                         engine: dict[str, Any] | None) -> tuple[tuple[mx.array, dict[str, mx.array]], Any]:
    """((loss, metrics), grads) of the ORPO loss over a prepared micro-batch; metrics as orpo_loss's plus
    prefix_fallbacks (the pairs whose prompts differ: no sharing for them).

    grads has the tree structure of model.trainable_parameters(), as nn.value_and_grad gives it.
    """
    e = resolve_engine(engine)
    n = batch.n
    if batch.plain is not None:
        (loss, metrics), grads = nn.value_and_grad(model, naive_pair_loss)(model, *batch.plain, n, lam)
        return (loss, {**metrics, "prefix_fallbacks": mx.array(0.0)}), grads
    packed = batch.packed
    if int(e["segment_layers"]) > 0:
        (loss, metrics), grads = _segmented(model, packed, n, lam, e)
    elif e["compile"]:
        (loss, metrics), grads = _compiled_whole(model, packed, n, lam, e)
    else:
        (loss, metrics), grads = nn.value_and_grad(model, lambda: whole_loss(model, packed, n, lam, e))()
    return (loss, {**metrics, "prefix_fallbacks": mx.array(float(packed.fallbacks))}), grads


def pair_value_and_grad(model: nn.Module, pairs: Pairs, lam: float,
                        engine: dict[str, Any] | None) -> tuple[tuple[mx.array, dict[str, mx.array]], Any]:
    """`batch_value_and_grad` of `prepare(pairs)`: the rows built and differentiated in one call."""
    return batch_value_and_grad(model, prepare(pairs, engine, tight_rows_fit(model)), lam, engine)


def _compiled_whole(model: nn.Module, packed: PackedPairs, n: int, lam: float,
                    e: dict[str, Any]) -> tuple[tuple[mx.array, dict[str, mx.array]], Any]:
    """nn.value_and_grad of `whole_loss` under mx.compile (the model's arrays are its implicit inputs)."""
    structure, arrays = layout_arrays(packed.layout)

    def build() -> Any:
        def loss(arrays: dict[str, mx.array], index: mx.array, targets: mx.array, weights: mx.array) -> Any:
            p = PackedPairs(layout_from(structure, arrays), index, targets, weights, 0)
            return whole_loss(model, p, n, lam, e)

        return mx.compile(nn.value_and_grad(model, loss), inputs=model.state, outputs=model.state)

    key = ("whole", tuple(sorted((k, str(v)) for k, v in e.items())), n, lam, structure)
    return kept(model, key, build)(arrays, packed.index, packed.targets, packed.weights)


def _segmented(model: nn.Module, packed: PackedPairs, n: int, lam: float,
               e: dict[str, Any]) -> tuple[tuple[mx.array, dict[str, mx.array]], Any]:
    """((loss, metrics), grads) through the segmented backward; a fused head runs eagerly, chunk by chunk.

    The head is read from the model inside each function, so where it trains (full-parameter training) the
    segmented backward's replaced arrays are the ones differentiated.
    """
    stack = Stack(model)
    if int(e["mlp_chunks"]) > 1:
        refuse_mlp_dropout(stack.layers)

    def loss_of(logps: mx.array) -> tuple[mx.array, dict[str, mx.array]]:
        return orpo_loss(logps[:n], logps[n:], lam)

    def loss_of_last(h: mx.array) -> tuple[mx.array, dict[str, mx.array]]:
        return loss_of(packed_logps(lm_head_of(model), stack.norm(h), packed, e))

    def head_value_and_grad(h: mx.array, top: Params) -> tuple[tuple[mx.array, dict[str, mx.array]], mx.array, list]:
        """The fused head's value and cotangents on h (and the parameters outside the layers), its [chunk, V]
        blocks evaluated one chunk at a time."""

        def rows(h: mx.array, *arrays: mx.array) -> mx.array:
            with top.replaced(arrays):
                return scored_rows(stack.norm(h), packed)

        x = rows(h, *top.arrays)
        mx.eval(x)
        head = lm_head_of(model)
        logp, grad_fn = fused_logp_eager(head, x, packed.targets, int(e["head_chunk"]), int(e["overlap"]))
        (loss, metrics), g = mx.value_and_grad(lambda lp: loss_of(packed.weights @ lp))(logp)
        mx.eval(loss, metrics, g)
        cots = grad_fn(g)
        _, (cot, *grads) = mx.vjp(lambda h, *arrays: [rows(h, *arrays)], [h, *top.arrays], [cots.hidden])
        of_head = cots.by_name(head)  # the head's weight is not in rows(): its vjp gave zeros there
        return (loss, metrics), cot, [of_head[k] + gr if k in of_head else gr for k, gr in zip(top.names, grads)]

    eager = head_value_and_grad if e["head"] == "fused" else None
    return segmented_value_and_grad(model, stack, packed.layout, loss_of_last, int(e["segment_layers"]), eager,
                                    bool(e["compile"]), int(e["overlap"]), int(e["mlp_chunks"]))


# --- validation: log-probs without gradients ---


def pair_logps(model: nn.Module, pairs: Pairs, engine: dict[str, Any] | None) -> tuple[mx.array, mx.array]:
    """Mean response log-probs (chosen [B], rejected [B]) without gradients, for validation."""
    e = resolve_engine(engine)
    n = len(pairs)
    if e["head"] == "naive" and not e["prefix_sharing"]:  # segments only change the backward
        logps = response_mean_logps(model, *pair_batch(pairs, list(range(n)), input_multiple(e)))
    else:
        packed = pack(pairs, e, tight_rows_fit(model))
        stack = Stack(model)
        logps = packed_logps(lm_head_of(model), stack.hidden(packed.layout), packed, e)
    logps = mx.stop_gradient(logps)
    return logps[:n], logps[n:]
