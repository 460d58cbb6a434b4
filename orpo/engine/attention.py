"""How prefix-sharing rows attend: split attention or exclusion dims, through mx.fast's attention.

Shared rows hold a pair's prompt, chosen and rejected; rejected's queries must not see chosen's keys. Two
ways keep MLX's fused causal attention (cuDNN's forward and backward on CUDA) instead of a mask array:
SplitRows runs aligned rows as two causal attentions, ExclusionMask hides chosen's keys from rejected's
queries with extra head dims. `attend` is the attention the engine's forward (orpo.engine.forward) calls:
it does these masks and hands any other to mx.fast's attention.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import mlx.core as mx


# Extra head dims carrying the exclusion (cuDNN wants head dims in multiples of 8), and the magnitude in
# each: a query flag S times a key penalty -S in all 8 dims adds -8 S^2 = -131072 to the raw score, far
# below any real score, so exp() of it is exactly 0 in float32; 128 is exact in bf16 and fp16.
EXCLUSION_DIMS = 8
EXCLUSION_SCALE = 128.0
# MLX 0.32's CUDA attention runs cuDNN only for head dims up to 128 (supports_sdpa_cudnn); wider falls back
# to the unfused attention, which keeps [B, H, L, L] scores (enough to put a Mistral-7B step on real-length
# rows out of an H200's memory).
CUDNN_MAX_HEAD_DIM = 128


def exclusion_fits(head_dim: int, cuda: bool) -> bool:
    """Whether a head dim widened by the exclusion dims still runs MLX's fused attention (always off CUDA)."""
    return not cuda or head_dim + EXCLUSION_DIMS <= CUDNN_MAX_HEAD_DIM


@dataclass(frozen=True, eq=False)
class ExclusionMask:
    """Causal attention in which flagged queries cannot see penalised keys, run as one causal sdpa.

    Prefix-sharing rows [prompt; chosen; rejected; pad]: rejected's queries must not see chosen's keys.
    Instead of an additive [B, 1, L, L] bias (built per step, read by cuDNN's masked kernel), each query
    gets EXCLUSION_DIMS extra head dims holding `queries` ([B, 1, L, EXCLUSION_DIMS]: S for a rejected
    query, 0 otherwise) and each key `keys` (-S for a chosen key, 0 otherwise): the extra dims' dot
    product is 0 except for (rejected query, chosen key), where it sends the score to -inf in effect.
    Values keep their dims, so the output is the masked attention's, under mask="causal" (cuDNN's causal
    kernel on CUDA). Costs the wider head dim (bench/README.md).
    """

    queries: mx.array
    keys: mx.array


def exclusion_mask(flagged: mx.array, excluded: mx.array, dtype: mx.Dtype) -> ExclusionMask:
    """An ExclusionMask from per-row booleans: `flagged` [B, L] queries may not see `excluded` [B, L] keys."""
    shape = (*flagged.shape, EXCLUSION_DIMS)
    q = mx.broadcast_to(flagged[..., None], shape).astype(dtype) * EXCLUSION_SCALE
    k = mx.broadcast_to(excluded[..., None], shape).astype(dtype) * -EXCLUSION_SCALE
    return ExclusionMask(q[:, None], k[:, None])


@dataclass(frozen=True)
class SplitRows:
    """Prefix-sharing rows [prompt; chosen; pad | rejected; pad] attended as two causal attentions, exactly.

    Every row's rejected block starts at `rejected_start`. The first attention is causal over the columns
    before it ([prompt; chosen]: what the prompt's and chosen's queries may see). The second takes rejected's
    queries against [prompt; rejected]'s keys, causal from the bottom right, so rejected's token t sees the
    whole prompt and its own tokens up to t, and never chosen's. The prompt length differs between pairs, so
    the second runs once per group of consecutive rows sharing it: `groups` holds (first row, end row, prompt
    length). With `align` > 1 the second attention's query and key lengths are multiples of it (see
    split_attention). Hashable and array-free: it is part of a compiled step's key, not an input.
    Why: no mask array and no widened head dim, so each part is MLX's fused causal attention (cuDNN's forward
    and backward on CUDA at widths of 128), and the masked-out (rejected query, chosen key) area is never
    computed: faster than the ExclusionMask and than two forwards (bench/README.md).
    """

    rejected_start: int
    groups: tuple[tuple[int, int, int], ...]
    align: int = 1


def split_attention(sdpa: Callable[[mx.array, mx.array, mx.array], mx.array], q: mx.array, k: mx.array,
                    v: mx.array, split: SplitRows) -> mx.array:
    """Attention over SplitRows through `sdpa(q, k, v)` (causal, bottom-right aligned): [B, H, L, D] like q.

    Alignment: MLX 0.32's CUDA attention differentiates with cuDNN when the query length is a multiple of 128,
    and then returns wrong key/value gradients (or corrupts memory) unless the key length is one too
    (bench/README.md). So for a
    prompt of p = a * align + x tokens, rejected's attention also takes the prompt's last x tokens as queries
    (their outputs are dropped; the first attention gives them) and align - x zero keys and queries at the
    end (after every real token: causally invisible), which makes both lengths multiples of `align`.
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


def attend(queries: mx.array, keys: mx.array, values: mx.array, scale: float, mask: Any) -> mx.array:
    """Scaled dot-product attention of q [B, H, L, D], k/v [B, kv heads, L, D] under any mask the engine builds.

    SplitRows and ExclusionMask run as causal attentions (above); anything else ("causal", None, an array)
    goes to mx.fast's attention as it is, the call mlx-lm's layers make without a cache.
    """
    sdpa = mx.fast.scaled_dot_product_attention
    if isinstance(mask, SplitRows):
        causal = lambda q, k, v: sdpa(q, k, v, scale=scale, mask="causal")  # noqa: E731
        return split_attention(causal, queries, keys, values, mask)
    if not isinstance(mask, ExclusionMask):
        return sdpa(queries, keys, values, scale=scale, mask=mask)
    b, h, length, _ = queries.shape
    q = mx.concatenate([queries, mx.broadcast_to(mask.queries, (b, h, length, EXCLUSION_DIMS))], axis=-1)
    k = mx.concatenate([keys, mx.broadcast_to(mask.keys, (b, keys.shape[1], length, EXCLUSION_DIMS))], axis=-1)
    return sdpa(q, k, values, scale=scale, mask="causal")
