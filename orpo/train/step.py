"""One training step, top to bottom: pairs -> rows -> log-probs -> loss -> gradients (docs/architecture.md).

All train.engine settings off is the plain path (full logits of [chosen; rejected] rows under
nn.value_and_grad), the oracle the others are tested against.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from orpo.batching import first_fit, ladder
from orpo.device import on_cuda, on_gpu
from orpo.engine.attention import MAX_PAIRS_PER_ROW, tight_attention_fits
from orpo.engine.compiled import kept, layout_arrays, layout_from
from orpo.engine.head import (LMHead, fused_logp_eager, lm_head_of, mean_logps_from_logits, response_mean_logps,
                              token_logp)
from orpo.engine.segmented import Params, add_into, segmented_value_and_grad
from orpo.engine.stack import Stack, activation_dtype, head_dim_of
from orpo.train.data import Pairs, pair_batch, pair_lengths, pair_tokens
from orpo.train.lora import adapters_off, refuse_mlp_dropout
from orpo.train.objectives import PairLoss, pair_loss_of, pair_objective
from orpo.train.rows import PackedPairs, packed_rows, plain_rows, shared_rows
from orpo.train.settings import EngineSettings

# --- the settings ---


def resolve_engine(engine: EngineSettings) -> EngineSettings:
    """`engine` with this machine's choices made for its `auto` values (once per run: the run records them);
    the memory plan's auto values are the plain backward's here (segments 0, MLP whole) and packing's are off, the
    trainer then plans them for its data (footprint.plan_memory, plan_packing)."""
    choices = {
        # faster on CUDA (bench/README.md); on the CPU each new shape's first call pays a trace and a C++ build
        "compile": on_cuda(),
        # faster and smaller on the CPU and on CUDA (bench/README.md)
        "prefix_sharing": True,
        # ordered where the fused backward sums with atomics (a GPU), so replay is bit-exact
        "attention_backward": "ordered" if on_gpu() else "fused",
        # less memory at equal or better speed on CUDA; slower on the CPU, where the recompute's sigmoid is the cost
        "gated_mlp": on_cuda(),
        "segment_layers": 0, "segment_min_positions": 0, "mlp_chunks": 1, "pack_width": 0, "pack_rows": 1,
    }
    return dataclasses.replace(engine, **{k: v for k, v in choices.items() if getattr(engine, k) == "auto"},
                               width_multiple=engine.width_multiple or (CUDA_ATTENTION_MULTIPLE if on_cuda() else 0))


def plan_packing(configured: EngineSettings, model: nn.Module, lengths: list[int], batch_size: int,
                 cuda: bool) -> dict[str, int]:
    """pack_width and pack_rows for the values `configured` leaves auto, from the pairs' block_lengths: on CUDA,
    for pairs of differing lengths, where shared rows are built and attend fused (the exclusion dims or our
    kernels), rows of the longest pair's positions on the width ladder, as many a micro-batch as hold about
    batch_size pairs of the mean length; else off (pairs of one length already make one shape, attended split)."""
    e = resolve_engine(configured)
    width = e.pack_width
    if configured.pack_width == "auto":
        fits = (e.prefix_sharing is True and e.prefix_attention != "split"
                and tight_attention_fits(head_dim_of(model), activation_dtype(model), cuda))
        width = ladder(max(lengths), e.input_multiple or 16) if cuda and fits and len(set(lengths)) > 1 else 0
    rows = e.pack_rows
    if configured.pack_rows == "auto" and width:
        rows = max(1, round(batch_size * sum(lengths) / len(lengths) / width))
    return {"pack_width": width, "pack_rows": rows}


# MLX's CUDA attention runs its cuDNN backward only for query lengths that are a multiple of 128; other
# lengths differentiate the unfused fallback ([B, H, L, L] scores kept), several times slower (bench/README.md).
CUDA_ATTENTION_MULTIPLE = 128


# The plain path: naive head, plain backward, no sharing (the oracle).
PLAIN: dict[str, Any] = {"head": "naive", "segment_layers": 0, "prefix_sharing": False}


def _resolved(engine: EngineSettings) -> EngineSettings:
    if not engine.resolved:
        raise ValueError("train.engine has auto values left: resolve them once per run (orpo.train.step.resolve_engine)")
    return engine


def tight_rows_fit(model: nn.Module) -> bool:
    """Whether prefix rows of pairs of their own lengths may be tight here (their attention fused)."""
    return tight_attention_fits(head_dim_of(model), activation_dtype(model), on_cuda())


def check_attention(model: nn.Module, engine: EngineSettings) -> None:
    """Refuse a prefix attention that would run MLX's unfused fallback on this model and device, and packed rows
    where they cannot be built or attended."""
    if engine.prefix_sharing is True and engine.prefix_attention == "exclusion" and not tight_rows_fit(model):
        raise ValueError(f"train.engine.prefix_attention: exclusion rows of this model (head dim "
                         f"{head_dim_of(model)}, {activation_dtype(model)}) have no fused attention on CUDA (the "
                         "fallback keeps [B, H, L, L] scores); use auto or split, or compute in bfloat16")
    if not engine.pack_width:
        return
    where = f"train.engine.pack_width {engine.pack_width}"
    if engine.prefix_sharing is not True or engine.prefix_attention == "split":
        raise ValueError(f"{where}: packed rows are prefix-shared rows attended as one causal attention: set "
                         "prefix_sharing true (or auto) and prefix_attention auto or exclusion")
    if not tight_rows_fit(model):
        raise ValueError(f"{where}: rows of this model (head dim {head_dim_of(model)}, {activation_dtype(model)}) "
                         "have no fused attention here (the exclusion dims pass the head dim MLX's CUDA attention "
                         "takes, and our kernels take bfloat16/float16 up to 128); set pack_width 0")
    multiple = engine.input_multiple or 16
    if engine.pack_width % multiple:
        raise ValueError(f"{where}: not a multiple of the rows' width multiple {multiple}")


# --- pairs -> rows ---


def pack(pairs: Pairs, engine: EngineSettings, tight: bool = True, nll_span: str = "response") -> PackedPairs:
    """The forward rows of `pairs`: shared-prefix rows (tight ones only where `tight`), or the plain rows."""
    m = _resolved(engine).input_multiple
    if not engine.prefix_sharing:
        return plain_rows(pairs, m, nll_span)
    return shared_rows(pairs, m, engine.prefix_attention, tight, nll_span)


def row_lengths(pairs: Pairs, engine: EngineSettings, tight: bool) -> list[int]:
    """Per pair, the length its forward rows pad to, by which micro-batches are cut: its prefix-shared row where
    tight rows are built, else the longer of its two sequences (the two-forward rows a micro-batch of differing
    prompts falls back to)."""
    return pair_tokens(pairs) if engine.prefix_sharing is True and tight else pair_lengths(pairs)


def plain_batch(pairs: Pairs, input_multiple: int | None,
                nll_span: str = "response") -> tuple[mx.array, mx.array, mx.array | None]:
    """pair_batch's [chosen; rejected] tokens and mask of `pairs`, and for the prompt_and_response span the chosen
    rows' NLL mask [B, T]: their response mask plus every prompt token after the first (None for the response)."""
    tokens, mask = pair_batch(pairs, list(range(len(pairs))), input_multiple)
    if nll_span == "response":
        return tokens, mask, None
    nll = np.array(mask[: len(pairs)])
    for i, p in enumerate(pairs.prompt):
        nll[i, 1: len(p)] = 1
    return tokens, mask, mx.array(nll)


@dataclass(frozen=True)
class MicroBatch:
    """One micro-batch as the step reads it, built on the host ahead of its step.

    `packed`: the engine's rows; `plain`: the oracle path's [chosen; rejected] tokens and mask, `plain_nll` its
    NLL mask for the prompt_and_response span. Counts as PackedPairs has them; `positions` includes padding.
    """

    n: int
    scored: int
    row_tokens: int
    two_forward_tokens: int
    positions: int
    packed: PackedPairs | None = None
    plain: tuple[mx.array, mx.array] | None = None
    plain_nll: mx.array | None = None

    def signature(self) -> tuple:
        """The shapes (and split structure) a compiled step is traced for: one trace per distinct signature."""
        return self.packed.signature() if self.packed is not None else (tuple(self.plain[0].shape),)


def prepare(pairs: Pairs, engine: EngineSettings, tight: bool = True, nll_span: str = "response") -> MicroBatch:
    """The forward rows of `pairs` for the resolved engine settings (host work only; `tight` as `pack` takes it)."""
    e = _resolved(engine)
    if not e.plain:
        return _micro_batch(pairs, pack(pairs, e, tight, nll_span))
    tokens, mask, nll = plain_batch(pairs, e.input_multiple, nll_span)
    full = sum(2 * len(p) + len(c) + len(r) for p, c, r in zip(pairs.prompt, pairs.chosen, pairs.rejected))
    return MicroBatch(len(pairs), _scored_tokens(pairs), full, full, int(tokens.size), plain=(tokens, mask),
                      plain_nll=nll)


def prepare_packed_step(pairs: Pairs, lengths: list[int], engine: EngineSettings,
                        nll_span: str = "response") -> list[MicroBatch]:
    """One step's pairs (`lengths`: their block_lengths) in rows of train.engine.pack_width positions, placed
    first-fit longest first, pack_rows rows a micro-batch; each micro-batch's loss is scaled by its share of the
    step's pairs, so the summed gradients are the step's mean."""
    e = _resolved(engine)
    bins = first_fit(lengths, e.pack_width, MAX_PAIRS_PER_ROW)
    out = []
    for first in range(0, len(bins), e.pack_rows):
        group = bins[first:first + e.pack_rows]
        chosen = pairs.select([i for row in group for i in row])
        packed = packed_rows(chosen, [len(row) for row in group], e.pack_width, e.input_multiple or 16, nll_span)
        share = len(chosen) / len(pairs)
        out.append(_micro_batch(chosen, dataclasses.replace(packed, share=mx.array(share, mx.float32))))
    return out


def _scored_tokens(pairs: Pairs) -> int:
    return sum(map(sum, pairs.chosen_mask + pairs.rejected_mask))


def _micro_batch(pairs: Pairs, packed: PackedPairs) -> MicroBatch:
    return MicroBatch(len(pairs), _scored_tokens(pairs), packed.row_tokens, packed.two_forward_tokens,
                      int(packed.layout.tokens.size), packed=packed)


# --- rows -> log-probs ---


def scored_rows(hidden: mx.array, packed: PackedPairs) -> mx.array:
    """The final hidden states [M, H] that predict the scored tokens, in packed.targets' order."""
    return mx.take(hidden.reshape(-1, hidden.shape[-1]), packed.index, axis=0)


def packed_token_logps(head: LMHead, hidden: mx.array, packed: PackedPairs, engine: EngineSettings) -> mx.array:
    """log p of each of packed.targets [M] from final hidden states."""
    return token_logp(head, scored_rows(hidden, packed), packed.targets, engine.head == "fused", engine.head_chunk)


def sequence_logps(logp: mx.array, packed: PackedPairs) -> tuple[mx.array, mx.array | None]:
    """Mean response log-probs [2B] (chosen rows, then rejected) from those of packed.targets, and the chosen
    sequences' mean log-prob over the NLL span [B] where it is not the response."""
    return packed.weights @ logp, None if packed.nll_weights is None else packed.nll_weights @ logp


def packed_logps(model: nn.Module, packed: PackedPairs, engine: EngineSettings) -> tuple[mx.array, mx.array | None]:
    """`sequence_logps` of packed rows through the whole stack and the head, one forward."""
    hidden = Stack(model).hidden(packed.layout)
    return sequence_logps(packed_token_logps(lm_head_of(model), hidden, packed, engine), packed)


# --- log-probs -> loss (train.objective: orpo.train.objectives) ---


def naive_logps(model: nn.Module, tokens: mx.array, mask: mx.array, n: int,
                nll_mask: mx.array | None = None) -> tuple[mx.array, mx.array | None]:
    """Mean response log-probs [2n] of a [chosen; rejected] batch from full logits, and the chosen rows' mean
    log-prob over `nll_mask` [n, T] where given (plain_batch)."""
    logits = model(tokens[:, :-1])
    logps = mean_logps_from_logits(logits, tokens[:, 1:], mask[:, 1:])
    if nll_mask is None:
        return logps, None
    return logps, mean_logps_from_logits(logits[:n], tokens[:n, 1:], nll_mask[:, 1:])


def naive_pair_loss(model: nn.Module, tokens: mx.array, mask: mx.array, n: int, loss: PairLoss | float,
                    nll_mask: mx.array | None = None) -> tuple[mx.array, dict[str, mx.array]]:
    """The loss (`loss`: its objective and λ; a number is ORPO's λ) and metrics of a [chosen; rejected] batch of n
    pairs, full logits (the plain path)."""
    counts = mask[:, 1:].astype(mx.float32).sum(axis=-1)
    logps, nll_logp = naive_logps(model, tokens, mask, n, nll_mask)
    return pair_objective(loss, logps, counts, nll_logp)


def packed_loss(logp: mx.array, packed: PackedPairs, loss: PairLoss | float) -> tuple[mx.array, dict[str, mx.array]]:
    """The loss and metrics of packed pairs from the log-probs of packed.targets."""
    logps, nll_logp = sequence_logps(logp, packed)
    value, metrics = pair_objective(loss, logps, (packed.weights > 0).astype(mx.float32).sum(axis=-1), nll_logp)
    return (value if packed.share is None else value * packed.share), metrics


def whole_loss(model: nn.Module, packed: PackedPairs, loss: PairLoss | float,
               e: EngineSettings) -> tuple[mx.array, dict[str, mx.array]]:
    """The loss and metrics of packed rows through the whole stack and the head (one graph)."""
    hidden = Stack(model, e.attention_backward == "ordered", e.gated_mlp).hidden(packed.layout)
    return packed_loss(packed_token_logps(lm_head_of(model), hidden, packed, e), packed, loss)


@contextmanager
def reference_model(model: nn.Module, reference: nn.Module | None = None) -> Iterator[nn.Module]:
    """dpo's reference model while inside: `reference` (a frozen copy, full-parameter training), else `model`
    with its LoRA adapters off."""
    if reference is not None:
        yield reference
        return
    with adapters_off(model):
        yield model


def reference_logps(model: nn.Module, batch: MicroBatch, engine: EngineSettings,
                    reference: nn.Module | None = None) -> mx.array:
    """Mean response log-probs [2n] of a micro-batch under the reference model, one forward without gradients."""
    with reference_model(model, reference) as net:
        logps = mx.stop_gradient(response_mean_logps(net, *batch.plain) if batch.plain is not None
                                 else packed_logps(net, batch.packed, engine)[0])
        mx.eval(logps)  # while the adapters are off
    return logps


# --- loss -> gradients ---


def segmented(batch: MicroBatch, engine: EngineSettings) -> bool:
    """Whether `batch_value_and_grad` takes this micro-batch through the segmented backward, which evaluates as it
    builds (segment by segment, into the running sums)."""
    return engine.segments_for(batch.positions) > 0  # the plain path has no segments


def batch_value_and_grad(model: nn.Module, batch: MicroBatch, loss: PairLoss | float, engine: EngineSettings,
                         into: dict[str, mx.array] | None = None,
                         reference: nn.Module | None = None) -> tuple[tuple[mx.array, dict[str, mx.array]], Any]:
    """((loss, metrics), grads) of the objective `loss` names (a number: ORPO's λ) over a prepared micro-batch;
    metrics as pair_objective's plus prefix_fallbacks (pairs whose prompts differ: no sharing for them).

    grads has model.trainable_parameters()'s tree; given running sums `into`, they are added in and returned.
    `reference`: dpo's reference model where it is not `model` with its adapters off.
    """
    loss = pair_loss_of(loss)
    if loss.objective.needs_reference and loss.ref is None:
        loss = dataclasses.replace(loss, ref=reference_logps(model, batch, engine, reference))
    if batch.plain is not None:
        (value, metrics), grads = nn.value_and_grad(model, naive_pair_loss)(model, *batch.plain, batch.n, loss,
                                                                            batch.plain_nll)
        return (value, {**metrics, "prefix_fallbacks": mx.array(0.0)}), grads if into is None else add_into(into, grads)
    packed = batch.packed
    if segmented(batch, engine):  # adds into the running sums segment by segment
        (value, metrics), grads = _segmented(model, packed, loss, engine, into)
    else:
        if engine.compile:
            (value, metrics), grads = _compiled_whole(model, packed, loss, engine)
        else:
            (value, metrics), grads = nn.value_and_grad(model, lambda: whole_loss(model, packed, loss, engine))()
        if into is not None:
            grads = add_into(into, grads)
    return (value, {**metrics, "prefix_fallbacks": mx.array(float(packed.fallbacks))}), grads


def pair_value_and_grad(model: nn.Module, pairs: Pairs, loss: PairLoss | float, engine: EngineSettings,
                        nll_span: str = "response") -> tuple[tuple[mx.array, dict[str, mx.array]], Any]:
    """`batch_value_and_grad` of `prepare(pairs)`: the rows built and differentiated in one call."""
    return batch_value_and_grad(model, prepare(pairs, engine, tight_rows_fit(model), nll_span), loss, engine)


def _compiled_whole(model: nn.Module, packed: PackedPairs, loss: PairLoss,
                    e: EngineSettings) -> tuple[tuple[mx.array, dict[str, mx.array]], Any]:
    """nn.value_and_grad of `whole_loss` under mx.compile (the model's arrays are its implicit inputs; λ and the
    reference log-probs are inputs, so a λ that moves each step reuses the trace)."""
    structure, arrays = layout_arrays(packed.layout)
    nll = [] if packed.nll_weights is None else [packed.nll_weights]
    ref = [] if loss.ref is None else [loss.ref]
    share = [] if packed.share is None else [packed.share]

    def build() -> Any:
        def value(arrays: dict[str, mx.array], index: mx.array, targets: mx.array, weights: mx.array,
                  nll: list[mx.array], lam: mx.array, ref: list[mx.array], share: list[mx.array]) -> Any:
            p = PackedPairs(layout_from(structure, arrays), index, targets, weights, 0,
                            nll_weights=nll[0] if nll else None, share=share[0] if share else None)
            return whole_loss(model, p, PairLoss(loss.objective, lam, ref[0] if ref else None), e)

        return mx.compile(nn.value_and_grad(model, value), inputs=model.state, outputs=model.state)

    key = ("whole", e, loss.objective, structure, len(nll), len(ref), len(share))
    lam = mx.array(loss.lam, mx.float32)
    return kept(model, key, build)(arrays, packed.index, packed.targets, packed.weights, nll, lam, ref, share)


def _segmented(model: nn.Module, packed: PackedPairs, loss: PairLoss, e: EngineSettings,
               into: dict[str, mx.array] | None = None) -> tuple[tuple[mx.array, dict[str, mx.array]], Any]:
    """((loss, metrics), grads) through the segmented backward; a fused head runs eagerly, chunk by chunk. The
    head is read from the model inside each function: where it trains, the replaced arrays are differentiated."""
    stack = Stack(model, e.attention_backward == "ordered", e.gated_mlp)
    if e.mlp_chunks > 1:
        refuse_mlp_dropout(stack.layers)

    def loss_of(logp: mx.array) -> tuple[mx.array, dict[str, mx.array]]:
        return packed_loss(logp, packed, loss)

    def loss_of_last(h: mx.array) -> tuple[mx.array, dict[str, mx.array]]:
        return loss_of(packed_token_logps(lm_head_of(model), stack.norm(h), packed, e))

    def head_value_and_grad(h: mx.array, top: Params) -> tuple[tuple[mx.array, dict[str, mx.array]], mx.array, list]:
        """The fused head's value and cotangents on h and the parameters outside the layers, chunk by chunk."""

        def rows(h: mx.array, *arrays: mx.array) -> mx.array:
            with top.replaced(arrays):
                return scored_rows(stack.norm(h), packed)

        x = rows(h, *top.arrays)
        mx.eval(x)
        head = lm_head_of(model)
        logp, grad_fn = fused_logp_eager(head, x, packed.targets, e.head_chunk, e.overlap)
        (loss, metrics), g = mx.value_and_grad(loss_of)(logp)
        mx.eval(loss, metrics, g)
        cots = grad_fn(g)
        _, (cot, *grads) = mx.vjp(lambda h, *arrays: [rows(h, *arrays)], [h, *top.arrays], [cots.hidden])
        of_head = cots.by_name(head)  # the head's weight is not in rows(): its vjp gave zeros there
        return (loss, metrics), cot, [of_head[k] + gr if k in of_head else gr for k, gr in zip(top.names, grads)]

    eager = head_value_and_grad if e.head == "fused" else None
    return segmented_value_and_grad(model, stack, packed.layout, loss_of_last, e.segment_layers, eager,
                                    e.compile, e.overlap, e.mlp_chunks, into)


# --- validation: log-probs without gradients ---


def pair_scores(model: nn.Module, pairs: Pairs, engine: EngineSettings, nll_span: str = "response",
                tight: bool | None = None) -> tuple[mx.array, mx.array, mx.array | None]:
    """Mean response log-probs (chosen [B], rejected [B]) and, for the prompt_and_response NLL span, the chosen
    sequences' mean log-prob over it [B] (None for the response span), without gradients: validation's. `tight`
    as `pack` takes it (None: as this machine decides, tight_rows_fit)."""
    e = _resolved(engine)
    n = len(pairs)
    if e.head == "naive" and not e.prefix_sharing:  # segments only change the backward
        tokens, mask, nll_mask = plain_batch(pairs, e.input_multiple, nll_span)
        logps, nll_logp = naive_logps(model, tokens, mask, n, nll_mask)
    else:
        packed = pack(pairs, e, tight_rows_fit(model) if tight is None else tight, nll_span)
        logps, nll_logp = packed_logps(model, packed, e)
    logps = mx.stop_gradient(logps)
    return logps[:n], logps[n:], None if nll_logp is None else mx.stop_gradient(nll_logp)
