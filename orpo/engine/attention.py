"""How prefix-sharing rows attend (SplitRows, ExclusionMask, HiddenSpans), and an attention backward in a fixed order.

SplitRows and ExclusionMask keep MLX's fused causal attention (cuDNN's forward and backward on CUDA) instead of a
mask array; on CUDA in bf16/fp16, HiddenSpans runs our own kernels (orpo.engine.flash) on each query's key bounds
instead of the exclusion's extra head dims, skipping the scores a query cannot see. `ordered_attention` sums its gradients in a fixed order, for
replays that are bit-exact on CUDA.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
import numpy as np

from orpo.device import on_cuda
from orpo.engine.flash import flash_backward, flash_fits, flash_forward, spans_fit


# Extra head dims carrying the exclusion (cuDNN wants head dims in multiples of 8), and the magnitude in
# each: a query flag S times a key penalty -S adds -S^2 = -16384 to the raw score (at most -1024 once scaled,
# for head dims up to 256), far below any real score, so exp() of it is exactly 0 in float32; 128 is exact in
# bf16 and fp16, and a product that is not hidden is exactly 0. Dim 0 hides chosen's keys from rejected's
# queries; dim 1 + b hides the keys of a row's pairs 0..b from the queries of its later pairs (packed rows).
EXCLUSION_DIMS = 8
EXCLUSION_SCALE = 128.0
# Packed rows (Layout.segments, Layout.roles): what each token is, and the most pairs a row holds.
PROMPT, CHOSEN, REJECTED = 0, 1, 2
MAX_PAIRS_PER_ROW = EXCLUSION_DIMS
# MLX 0.32's CUDA attention runs cuDNN only for head dims up to 128 (supports_sdpa_cudnn); wider falls back
# to the unfused attention, which keeps [B, H, L, L] scores (enough to put a Mistral-7B step on real-length
# rows out of an H200's memory).
CUDNN_MAX_HEAD_DIM = 128
# Scores per query block of ordered_attention's backward: each of its four float32 [B, H, block, keys]
# temporaries stays near 256 MB.
ORDERED_BLOCK_SCORES = 2**26


def exclusion_fits(head_dim: int, cuda: bool) -> bool:
    """Whether a head dim widened by the exclusion dims still runs MLX's fused attention (always off CUDA)."""
    return not cuda or head_dim + EXCLUSION_DIMS <= CUDNN_MAX_HEAD_DIM


def tight_attention_fits(head_dim: int, dtype: mx.Dtype, cuda: bool) -> bool:
    """Whether tight prefix rows attend fused here: by the exclusion dims, or on CUDA by our kernels' spans."""
    return exclusion_fits(head_dim, cuda) or (cuda and spans_fit(head_dim, dtype))


@dataclass(frozen=True, eq=False)
class ExclusionMask:
    """Causal attention in which flagged queries cannot see penalised keys, run as one causal sdpa: extra head dims
    `queries` [B, 1, L, EXCLUSION_DIMS] (S for a flagged query, else 0) and `keys` (-S for a penalised key)."""

    queries: mx.array
    keys: mx.array


@dataclass(frozen=True, eq=False)
class HiddenSpans:
    """Causal attention in which query i of row b sees no key below bounds[b, i, 0] and none of bounds[b, i, 1] ..
    bounds[b, i, 2] - 1 ([B, L, 3] int32), run by our CUDA kernels (`span_attention`)."""

    bounds: mx.array


def row_bounds(spans: mx.array, length: int) -> mx.array:
    """Key bounds [B, L, 3] of rows with hidden spans [B, 2]: queries from spans[b, 1] on do not see keys
    spans[b, 0] .. spans[b, 1] - 1."""
    pos = mx.arange(length)[None]
    hidden = pos >= spans[:, 1:]
    zero = mx.zeros_like(pos)
    return mx.stack([mx.broadcast_to(zero, hidden.shape), mx.where(hidden, spans[:, :1], zero),
                     mx.where(hidden, spans[:, 1:], zero)], axis=-1).astype(mx.int32)


def packed_key_bounds(segments: np.ndarray, roles: np.ndarray) -> np.ndarray:
    """Key bounds [B, L, 3] (host) of packed rows from each token's pair place and role [B, L]: a token sees no key
    before its pair's first token (padding: its own), and rejected's tokens none of their pair's chosen ones."""
    b, length = segments.shape
    pos = np.broadcast_to(np.arange(length), (b, length))
    first = np.ones((b, length), bool)
    first[:, 1:] = segments[:, 1:] != segments[:, :-1]
    lo = np.maximum.accumulate(np.where(first, pos, 0), axis=1)
    # Within a pair: prompt, then chosen, then rejected; the hidden span runs from its first token past the prompt
    # (rejected's own first token where chosen has none) to rejected's first.
    past_prompt = (roles != PROMPT) & (first | np.pad(roles[:, :-1] == PROMPT, ((0, 0), (1, 0))))
    into_rejected = (roles == REJECTED) & (first | np.pad(roles[:, :-1] != REJECTED, ((0, 0), (1, 0))))
    hs = np.maximum.accumulate(np.where(past_prompt, pos, 0), axis=1)
    he = np.maximum.accumulate(np.where(into_rejected, pos, 0), axis=1)
    rejected = roles == REJECTED
    return np.stack([lo, np.where(rejected, hs, 0), np.where(rejected, he, 0)], axis=-1).astype(np.int32)


def exclusion_mask(spans: mx.array, length: int, dtype: mx.Dtype) -> ExclusionMask:
    """The ExclusionMask of hidden spans [B, 2] over rows of `length` tokens."""
    pos = mx.arange(length)[None]
    flagged = pos >= spans[:, 1:]
    return _exclusion(flagged, (pos >= spans[:, :1]) & ~flagged, None, dtype)


def packed_exclusion_mask(segments: mx.array, roles: mx.array, dtype: mx.Dtype) -> ExclusionMask:
    """The ExclusionMask of packed rows: per token [B, L] its pair's place in the row and its role; a query sees
    only its own pair's keys, and rejected's queries not chosen's."""
    return _exclusion(roles == REJECTED, roles == CHOSEN, segments, dtype)


def _exclusion(flagged: mx.array, excluded: mx.array, segments: mx.array | None, dtype: mx.Dtype) -> ExclusionMask:
    if segments is None:  # one pair a row: the boundary dims stay 0
        later = earlier = mx.zeros((*flagged.shape, EXCLUSION_DIMS - 1), mx.bool_)
    else:
        boundary = mx.arange(EXCLUSION_DIMS - 1)
        later, earlier = segments[..., None] > boundary, segments[..., None] <= boundary
    q = mx.concatenate([flagged[..., None], later], axis=-1).astype(dtype) * EXCLUSION_SCALE
    k = mx.concatenate([excluded[..., None], earlier], axis=-1).astype(dtype) * -EXCLUSION_SCALE
    return ExclusionMask(q[:, None], k[:, None])


def kernels_attend(head_dim: int, dtype: mx.Dtype) -> bool:
    """Whether tight and packed rows attend through our kernels here: on CUDA in bf16 and fp16, where they skip the
    key blocks a query cannot see (the exclusion dims compute and discard them; bench/README.md)."""
    return on_cuda() and spans_fit(head_dim, dtype)


def span_attention(q: mx.array, k: mx.array, v: mx.array, scale: float, bounds: mx.array) -> mx.array:
    """Causal attention under key bounds [B, L, 3] (HiddenSpans) through our kernels: forward, and the ordered
    backward."""

    @mx.custom_function
    def fn(q: mx.array, k: mx.array, v: mx.array, bounds: mx.array) -> mx.array:
        return flash_forward(q, k, v, scale, True, bounds)

    @fn.vjp
    def fn_vjp(primals: list[mx.array], cotangent: mx.array, output: mx.array) -> tuple[mx.array, ...]:
        q, k, v, bounds = primals
        delta = (cotangent.astype(mx.float32) * output.astype(mx.float32)).sum(axis=-1)
        return (*flash_backward(q, k, v, scale, True, cotangent, delta, bounds), mx.zeros_like(bounds))

    return fn(q, k, v, bounds)


@dataclass(frozen=True)
class SplitRows:
    """Prefix-sharing rows [prompt; chosen; pad | rejected; pad] attended as two causal attentions, exactly.

    Every row's rejected block starts at `rejected_start`; rejected attends once per run of rows sharing a prompt
    length (`groups`: first row, end row, prompt length); `align` as split_attention takes it. Hashable and
    array-free: part of a compiled step's key (docs/architecture.md, `split`).
    """

    rejected_start: int
    groups: tuple[tuple[int, int, int], ...]
    align: int = 1


def split_attention(sdpa: Callable[[mx.array, mx.array, mx.array], mx.array], q: mx.array, k: mx.array,
                    v: mx.array, split: SplitRows) -> mx.array:
    """Attention over SplitRows through `sdpa(q, k, v)` (causal, bottom-right aligned): [B, H, L, D] like q.

    MLX 0.32's CUDA attention differentiates with cuDNN when the query length is a multiple of 128, and then
    needs the key length to be one too (bench/README.md): so for a prompt of a * align + x tokens, rejected's
    attention also takes the prompt's last x tokens as queries (outputs dropped) and align - x zero keys and
    queries at the end (causally invisible).
    """
    s, align = split.rejected_start, split.align
    # mx.split, not slicing: its gradient is one concatenation, where each slice's is a zero-filled full array.
    q_a, q_b = mx.split(q, [s], axis=2)
    cuts = [end for _, end, _ in split.groups[:-1]]
    parts = []
    for (first, end, p), q_g in zip(split.groups, mx.split(q_b, cuts, axis=0) if cuts else [q_b]):
        x = p % align
        pad = (align - x) % align
        k_g, v_g = (t[first:end] for t in (k, v))
        if x:
            zeros = lambda t: mx.zeros((*t.shape[:2], pad, t.shape[3]), t.dtype)
            q_g = mx.concatenate([q[first:end, :, p - x:p], q_g, zeros(q_g)], axis=2)
            k_g, v_g = (mx.concatenate([t[:, :, :p], t[:, :, s:], zeros(t)], axis=2) for t in (k_g, v_g))
        elif p:
            k_g, v_g = (mx.concatenate([t[:, :, :p], t[:, :, s:]], axis=2) for t in (k_g, v_g))
        else:
            k_g, v_g = k_g[:, :, s:], v_g[:, :, s:]
        out = sdpa(q_g, k_g, v_g)
        parts.append(out[:, :, x:x + q.shape[2] - s] if x else out)
    out_b = parts[0] if len(parts) == 1 else mx.concatenate(parts, axis=0)
    return mx.concatenate([sdpa(q_a, k[:, :, :s], v[:, :, :s]), out_b], axis=2)


def _visible(scores: mx.array, mask: Any, first: int, offset: int) -> mx.array:
    """Scores [B, kv heads, G, n, keys] of queries first..first+n-1 with what `mask` hides set to -inf; "causal" is
    bottom-right aligned (query i sees keys up to i + offset), an array mask is [B or 1, H or 1, L, keys]."""
    if mask is None:
        return scores
    n, keys = scores.shape[-2:]
    if isinstance(mask, str):
        visible = mx.arange(keys)[None] <= mx.arange(first + offset, first + offset + n)[:, None]
    else:
        b, h = mask.shape[:2]
        kv, g = scores.shape[1:3]
        block = mask[:, :, first:first + n, :keys]
        visible = block[:, :, None] if h == 1 else block.reshape(b, kv, g, n, keys)
    if visible.dtype != mx.bool_:
        return scores + visible.astype(scores.dtype)
    return mx.where(visible, scores, mx.array(-mx.inf, scores.dtype))


def ordered_backward(q: mx.array, k: mx.array, v: mx.array, scale: float, mask: Any,
                     cotangent: mx.array, output: mx.array) -> tuple[mx.array, mx.array, mx.array]:
    """Gradients of softmax attention (q [B, H, L, D], k/v [B, kv heads, keys, D]; `output` the forward's) by
    query blocks, in a fixed order.

    Each block recomputes its float32 scores and softmax (causal blocks read only the keys they see), forms
    dS = P * (dP - rowsum(dO * O)) and takes dQ and its share of dK and dV as matmuls in the input dtype, the
    shares summed block after block in float32; a key head's query heads are one matmul's rows. On CUDA, causal
    or unmasked half-precision attention runs the same sums as two kernels (orpo.engine.flash) that keep each
    block's scores on chip.
    """
    b, h, length, d = q.shape
    kv, keys = k.shape[1], k.shape[2]
    g = h // kv
    offset = keys - length
    qg, dog = q.reshape(b, kv, g, length, d), cotangent.reshape(b, kv, g, length, v.shape[-1])
    delta = (dog.astype(mx.float32) * output.reshape(dog.shape).astype(mx.float32)).sum(axis=-1, keepdims=True)
    if flash_fits(q, k, mask):
        return flash_backward(q, k, v, scale, mask == "causal", cotangent, delta)
    rows = max(1, min(length, ORDERED_BLOCK_SCORES // max(1, b * h * keys)))
    dq, dk, dv = [], mx.zeros(k.shape, mx.float32), mx.zeros(v.shape, mx.float32)
    for first in range(0, length, rows):
        n = min(rows, length - first)
        seen = min(keys, first + n + offset) if isinstance(mask, str) else keys
        qb, dob = qg[:, :, :, first:first + n], dog[:, :, :, first:first + n]
        kb, vb = k[:, :, None, :seen], v[:, :, None, :seen]
        scores = (qb.astype(mx.float32) @ kb.astype(mx.float32).swapaxes(-1, -2)) * scale
        p = mx.softmax(_visible(scores, mask, first, offset), axis=-1, precise=True)
        dp = dob.astype(mx.float32) @ vb.astype(mx.float32).swapaxes(-1, -2)
        ds = (p * (dp - delta[:, :, :, first:first + n])).astype(q.dtype)
        dq.append((ds @ kb) * scale)
        # [B, kv, G, n, seen] as [B, kv, G*n, seen], transposed as a view (no copy): a key head's share from all
        # its query heads in one matmul.
        by_key = lambda t: t.reshape(b, kv, g * n, seen).swapaxes(-1, -2)  # noqa: E731
        pad = [(0, 0), (0, 0), (0, keys - seen), (0, 0)]
        dk = dk + mx.pad(((by_key(ds) @ qb.reshape(b, kv, g * n, d)) * scale).astype(mx.float32), pad)
        dv = dv + mx.pad((by_key(p.astype(q.dtype)) @ dob.reshape(b, kv, g * n, -1)).astype(mx.float32), pad)
    dq = dq[0] if len(dq) == 1 else mx.concatenate(dq, axis=3)
    return dq.reshape(q.shape).astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype)


def ordered_attention(q: mx.array, k: mx.array, v: mx.array, scale: float, mask: Any = None) -> mx.array:
    """mx.fast's attention (same forward, same arguments) differentiated by `ordered_backward`: the same steps
    give the same gradients bit for bit on every run, where cuDNN's backward sums dQ in arrival order."""
    sdpa = mx.fast.scaled_dot_product_attention

    @mx.custom_function
    def fn(q: mx.array, k: mx.array, v: mx.array, *m: mx.array) -> mx.array:
        return sdpa(q, k, v, scale=scale, mask=m[0] if m else mask)

    @fn.vjp
    def fn_vjp(primals: list[mx.array], cotangent: mx.array, output: mx.array) -> tuple[mx.array, ...]:
        q, k, v, *m = primals
        grads = ordered_backward(q, k, v, scale, m[0] if m else mask, cotangent, output)
        return (*grads, *(mx.zeros_like(x) for x in m))

    return fn(q, k, v) if mask is None or isinstance(mask, str) else fn(q, k, v, mask)


def attend(queries: mx.array, keys: mx.array, values: mx.array, scale: float, mask: Any,
           ordered: bool = False) -> mx.array:
    """Scaled dot-product attention of q [B, H, L, D], k/v [B, kv heads, L, D] under any mask the engine builds.

    SplitRows and ExclusionMask run as causal attentions, HiddenSpans as our kernels'; anything else goes to mx.fast's
    attention as mlx-lm's layers call it. `ordered`: each attention is `ordered_attention`.
    """
    if isinstance(mask, HiddenSpans):
        return span_attention(queries, keys, values, scale, mask.bounds)
    sdpa = ordered_attention if ordered else mx.fast.scaled_dot_product_attention
    if isinstance(mask, SplitRows):
        causal = lambda q, k, v: sdpa(q, k, v, scale=scale, mask="causal")  # noqa: E731
        return split_attention(causal, queries, keys, values, mask)
    if not isinstance(mask, ExclusionMask):
        return sdpa(queries, keys, values, scale=scale, mask=mask)
    b, h, length, _ = queries.shape
    q = mx.concatenate([queries, mx.broadcast_to(mask.queries, (b, h, length, EXCLUSION_DIMS))], axis=-1)
    k = mx.concatenate([keys, mx.broadcast_to(mask.keys, (b, keys.shape[1], length, EXCLUSION_DIMS))], axis=-1)
    return sdpa(q, k, values, scale=scale, mask="causal")
