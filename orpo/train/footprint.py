"""The training run's memory, predicted before the first step: weights, gradients, optimizer, activations.

The first three are exact sums over the model's arrays; the activations an estimate from the geometry, the
engine's settings and the data's longest pairs. index.json keeps it beside the measured peak.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import mlx.core as mx
from mlx.utils import tree_flatten

from orpo.device import on_cuda
from orpo.engine.head import chunk_for
from orpo.engine.stack import activation_dtype
from orpo.optim import master_extra_bytes
from orpo.train.data import Pairs
from orpo.train.lora import mlp_dropout
from orpo.train.memory import HEADROOM, device_memory
from orpo.train.settings import EngineSettings
from orpo.train.rows import block_lengths
from orpo.train.step import (batch_value_and_grad, pair_value_and_grad, prepare, prepare_packed_step,
                              tight_rows_fit)
from orpo.settings import as_dict

GB = 1e9
# The compiled CUDA step, measured against this estimate by bench/memory_model.py (H100, 2026-12-06,
# bench/runs/2026-12-06-h100): the plain backward keeps about 5 layers' activations beyond its own, a segment's
# recompute and backward about 3x its layers' plus one layer's, a trainable head in the one-graph step about 8
# [V, H] float32 blocks; over it all 5% more covers every measured case (1B and 7B, 2 to 32 layers, LoRA and full).
CUDA_EXTRA_LAYERS, CUDA_SEGMENT_FACTOR, CUDA_HEAD_GRAD_BLOCKS, CUDA_MARGIN = 5, 3, 8, 1.05


def parameter_bytes(model: Any, master_dtype: Any, grad_copies: float) -> dict[str, int]:
    """Exact bytes of the model's weights (every array, in its dtype), of a step's gradients (`grad_copies` sets of
    the trainable weights, in their dtype), of the master weights (trainable weights not already in the master
    dtype, held again in it, or as their low halves under bf16) and of AdamW's two moments (in the master dtype)."""
    weights = sum(v.nbytes for _, v in tree_flatten(model.parameters()))
    trainable = [v for _, v in tree_flatten(model.trainable_parameters())]
    master = [master_dtype or v.dtype for v in trainable]
    return {
        "weights": weights,
        "gradients": int(grad_copies * sum(v.nbytes for v in trainable)),
        "master_weights": sum(v.size * master_extra_bytes(v.dtype, m) for v, m in zip(trainable, master)),
        "moments": 2 * sum(v.size * m.size for v, m in zip(trainable, master)),
    }


def activation_bytes(args: Any, dtype: Any, rows: int, width: int, scored: int, engine: dict[str, Any],
                     head_trains: bool, cuda: bool) -> int:
    """An estimate of a micro-batch's activations at its largest: `rows` rows of `width` positions, `scored`
    of them reaching the head.

    A decoder layer keeps about 5 H + 2 q + 4 kv + 5 I values per token for its backward: all layers without
    segments, one segment's plus the boundaries with them (its MLP part divided among mlp_chunks). The head: the
    naive one's [tokens, V] logits in the model's dtype and twice in float32; the fused one's [chunk, V] float32
    blocks, about 8 in flight in one graph and 3 chunk by chunk under segments (tests/test_engine_head.py), plus
    a [V, H] float32 accumulator when it trains. Attention that is not fused (off CUDA) keeps float32
    [rows, heads, width, width] probabilities per layer. On CUDA, what the compiled step keeps beyond that
    (CUDA_EXTRA_LAYERS and the others above).
    """
    tokens = rows * width
    hidden = args.hidden_size
    layers = getattr(args, "num_hidden_layers", 1)
    inter = getattr(args, "intermediate_size", None) or 4 * hidden  # families that name it otherwise: a typical MLP
    heads = getattr(args, "num_attention_heads", 1)
    head_dim = getattr(args, "head_dim", None) or hidden // heads
    kv = getattr(args, "num_key_value_heads", None) or heads
    size = dtype.size
    seg, chunks = int(engine["segment_layers"]), max(1, int(engine["mlp_chunks"]))
    attention = 5 * hidden + 2 * heads * head_dim + 4 * kv * head_dim
    scores = 0 if cuda else rows * heads * width * width * 4  # per layer
    if seg:
        kept = CUDA_SEGMENT_FACTOR * seg + 1 if cuda else seg
        stack = ((math.ceil(layers / seg) + 1) * tokens * hidden * size
                 + kept * (tokens * (attention + 5 * inter / chunks) * size + scores))
    else:
        stack = (layers + (CUDA_EXTRA_LAYERS if cuda else 0)) * (tokens * (attention + 5 * inter) * size + scores)
    vocab = args.vocab_size
    if engine["head"] == "fused":
        blocks = 3 if seg else 8
        chunk = min(chunk_for(vocab, int(engine["head_chunk"])), scored)
        grad_blocks = 1 + (CUDA_HEAD_GRAD_BLOCKS if cuda and not seg else 0)
        head = blocks * chunk * vocab * 4 + (grad_blocks * vocab * hidden * 4 if head_trains else 0)
    else:
        head = tokens * vocab * (size + 8)
    return int((stack + head) * (CUDA_MARGIN if cuda else 1.0))


def widest_micro_batch(pairs: Pairs, batch_size: int, lengths: list[int]) -> Pairs:
    """The `batch_size` pairs of the greatest `lengths`: at least as wide as any micro-batch the trainer cuts (it
    cuts each step's pairs in order of these lengths, Session.lengths)."""
    longest = sorted(range(len(pairs)), key=lengths.__getitem__)[-batch_size:]
    return pairs.select(longest)


def widest_extent(sess: Any) -> tuple[int, int, int]:
    """(rows, width, scored tokens) of the widest micro-batch the session's steps build: pack_rows rows of
    pack_width when packed (every scored position counted), else `widest_micro_batch`'s."""
    e = sess.engine
    if e.pack_width:
        return packed_extent(e)
    return micro_batch_extent(widest_micro_batch(sess.train, sess.s.batch_size, sess.lengths), e,
                              sess.resolved.tight_rows, sess.s.nll_span)


def packed_extent(engine: EngineSettings) -> tuple[int, int, int]:
    """(rows, width, scored tokens) of a packed micro-batch: pack_rows rows of pack_width, every position counted."""
    return engine.pack_rows, engine.pack_width, engine.pack_rows * engine.pack_width


def micro_batch_extent(pairs: Pairs, engine: EngineSettings, tight: bool, nll_span: str = "response") -> tuple[int, int, int]:
    """(rows, width, scored tokens) of the forward `pairs` make as one micro-batch: the rows the step builds
    (shared, tight, split or two forwards; padded as the engine pads them)."""
    batch = prepare(pairs, dataclasses.replace(engine, segment_layers=0), tight, nll_span)
    if batch.packed is not None:
        rows, width = batch.packed.layout.tokens.shape
        return rows, width, int(batch.packed.targets.shape[0])
    rows, width = batch.plain[0].shape
    return rows, width - 1, rows * (width - 1)


def model_activations(model: Any, rows: int, width: int, scored: int, engine: EngineSettings) -> int:
    """`activation_bytes` for `model` as it trains: its compute dtype, and whether its head trains."""
    head_trains = any(k.startswith(("lm_head.", "model.embed_tokens.")) for k, _ in
                      tree_flatten(model.trainable_parameters()))
    return activation_bytes(model.args, activation_dtype(model), rows, width, scored, as_dict(engine), head_trains,
                            on_cuda())


def predict_memory(sess: Any, engine: EngineSettings | None = None,
                   extent: tuple[int, int, int] | None = None) -> dict[str, Any]:
    """The session's predicted peak, in GB: weights + gradients + master weights + moments + activations (estimate)
    of its widest micro-batch (`extent`: rows, width and scored tokens of that or another micro-batch), under the
    session's engine or `engine` (the planner's candidates), with the backward it takes for that micro-batch."""
    s = sess.s
    e = engine or sess.engine
    rows, width, scored = extent or widest_extent(sess)
    backward = dataclasses.replace(e, segment_layers=e.segments_for(rows * width))
    # Accumulating, the running sums beside a micro-batch's gradients (a segment's where the segmented backward
    # adds them in as it goes); data parallel, the all-reduced copy.
    beside = 0.0
    if s.grad_accum > 1:
        layers = max(1, getattr(sess.model.args, "num_hidden_layers", 1))
        beside = min(1.0, backward.segment_layers / layers) if backward.segment_layers else 1.0
    copies = 1 + beside + (sess.shard.size > 1)
    parts = parameter_bytes(sess.model, sess.opt.master_dtype, copies)
    if sess.reference is not None:  # dpo's frozen copy (full-parameter training)
        parts["reference"] = sum(v.nbytes for _, v in tree_flatten(sess.reference.parameters()))
    parts["activations"] = model_activations(sess.model, rows, width, scored, backward)
    parts["peak"] = sum(parts.values())
    return {**{k: round(v / GB, 6) for k, v in parts.items()}, "bytes": parts, "rows": rows, "width": width,
            "packed": bool(e.pack_width), "recomputes": backward.segment_layers > 0, **e.memory_plan}


def measured_activations(model: Any, pairs: Pairs, engine: EngineSettings, lam: float = 0.1) -> dict[str, int]:
    """One value_and_grad of `pairs` as one micro-batch (with pack_width set, the first micro-batch of their packed
    rows), after a warm-up call: the bytes its peak took above the arrays resident before it, less its gradients'
    own, beside `activation_bytes`' estimate for it."""
    if engine.pack_width:
        batch = prepare_packed_step(pairs, block_lengths(pairs), engine)[0]
        step = lambda: batch_value_and_grad(model, batch, lam, engine)  # noqa: E731
        (rows, width, scored), n = packed_extent(engine), batch.n  # as the planner counts it
    else:
        step = lambda: pair_value_and_grad(model, pairs, lam, engine)  # noqa: E731
        (rows, width, scored), n = micro_batch_extent(pairs, engine, tight_rows_fit(model)), len(pairs)
    mx.eval(step())  # the trace (compiled) and the allocator's warm-up
    mx.clear_cache()
    resident = mx.get_active_memory()
    mx.reset_peak_memory()
    (loss, _), grads = step()
    mx.eval(loss, grads)
    measured = mx.get_peak_memory() - resident - sum(v.nbytes for _, v in tree_flatten(grads))
    return {"measured": int(measured), "predicted": model_activations(model, rows, width, scored, engine),
            "rows": rows, "width": width, "pairs": n}


def plan_memory(sess: Any, configured: EngineSettings) -> tuple[dict[str, int], dict[str, Any]]:
    """The memory plan (EngineSettings.memory_plan) for the values `configured` leaves `auto`, with its prediction.

    Candidates in order of speed, the first whose predicted peak at the widest micro-batch fits the budget (else
    the least): the plain backward; segments of layers/2 down to 1 layer (the recompute is one forward whatever
    the size; fewer segments, fewer boundaries); one layer with its MLP in 2, 4, 8 chunks. Where it plans
    segments off CUDA, the narrower micro-batches the plain backward still fits keep it (`plain_reach`).
    """
    auto = {k for k, v in configured.memory_plan.items() if v == "auto"}
    layers = max(1, getattr(sess.model.args, "num_hidden_layers", 1))
    # What a step may peak at: train.engine.memory_limit_gb where set, else what the run's memory limit allows.
    limit = sess.engine.memory_limit_gb
    budget = int(limit * GB) if limit else int(HEADROOM * device_memory())
    # The rows do not depend on the plan: built once for every candidate.
    extent = widest_extent(sess)
    segments = [0, *range(max(1, layers // 2), 0, -1)] if "segment_layers" in auto else [sess.engine.segment_layers]
    candidates = [dataclasses.replace(sess.engine, segment_layers=k) for k in segments]
    if "mlp_chunks" in auto and segments[-1] and not mlp_dropout(sess.model.model.layers):
        candidates += [dataclasses.replace(candidates[-1], mlp_chunks=c) for c in (2, 4, 8)]
    peaks = [predict_memory(sess, e, extent)["bytes"]["peak"] for e in candidates]
    fits = [e for e, p in zip(candidates, peaks) if p <= budget]
    chosen = fits[0] if fits else candidates[peaks.index(min(peaks))]
    plain = None
    # Segments set in the config, or CUDA (where the threshold was slower than none: bench/README.md): every
    # micro-batch recomputed.
    if {"segment_layers", "segment_min_positions"} <= auto and chosen.segment_layers and not on_cuda():
        plain = plain_reach(sess, extent, budget)
        chosen = dataclasses.replace(chosen, segment_min_positions=plain["rows"] * plain["width"] + 1 if plain else 0)
    # The run's peak: the widest micro-batch's, or a narrower one's without the recompute, whichever is more.
    peak = max([predict_memory(sess, chosen, extent), *([plain] if plain else [])], key=lambda p: p["bytes"]["peak"])
    return chosen.memory_plan, {**peak, **chosen.memory_plan, "budget_gb": round(budget / GB, 6)}


def plain_reach(sess: Any, extent: tuple[int, int, int], budget: int) -> dict[str, Any] | None:
    """The prediction of the widest micro-batch narrowed (its rows, fewer positions each, its scored tokens in
    proportion) as far as its plain backward fits `budget`, or None where none does: the activations grow with
    the positions, so a bisection over the width finds the most that fit."""
    rows, width, scored = extent
    plain = dataclasses.replace(sess.engine, segment_layers=0)
    lo, hi, found = 1, width - 1, None
    while lo <= hi:
        mid = (lo + hi) // 2
        p = predict_memory(sess, plain, (rows, mid, max(1, scored * mid // width)))
        if p["bytes"]["peak"] <= budget:
            found, lo = p, mid + 1
        else:
            hi = mid - 1
    return found


def memory_warning(predicted: dict[str, Any], outside: int = 0) -> str | None:
    """A warning when the predicted peak, beside `outside` bytes of the device in use outside the run's memory pool
    (other processes, libraries' workspaces), passes the device's memory (the run would likely fail), or the peak
    passes the budget the memory plan was made for (nothing it could choose fits: the run may still fit), else None."""
    device, peak = device_memory(), predicted["bytes"]["peak"]
    plan = f"train.engine.segment_layers {predicted.get('segment_layers', 0)}, mlp_chunks {predicted.get('mlp_chunks', 1)}"
    smaller = "a smaller batch_size (grad_accum keeps the step's pairs) or shorter pairs take memory off"
    if peak + outside > device:
        held = f" beside {outside / GB:.1f} GB in use outside this run (other processes?)" if outside else ""
        return (f"the predicted peak {predicted['peak']:.1f} GB{held} passes the device's {device / GB:.1f} GB at "
                f"{plan}; segments and mlp_chunks (auto: planned to the least peak where nothing fits) and {smaller}")
    if "budget_gb" in predicted and predicted["peak"] > predicted["budget_gb"]:
        return (f"no memory plan fits the budget of {predicted['budget_gb']:.1f} GB: the least predicted peak is "
                f"{predicted['peak']:.1f} GB ({plan}), under the device's {device / GB:.1f} GB; {smaller}")
    return None
