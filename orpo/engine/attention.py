"""Blockwise (flash-style) attention in pure MLX with an analytic backward, for training.

Why: under `value_and_grad`, `mx.fast.scaled_dot_product_attention` runs its unfused fallback (MLX's
`use_fallback` returns true while grad tracing): it materialises the [B, H, L, L] scores in the forward
and keeps them for the backward. Measured on an H200 at a Llama-1B shape that was 7.5 ms of fwd+bwd per
layer against 0.22 ms forward. Here the forward runs over query blocks and keeps only (q, k, v, out, lse);
the backward recomputes each block's probabilities from the float32 logsumexp (FlashAttention-2's
backward: dV += P^T dO, dP = dO V^T, dS = P (dP - rowsum(dO O)) scale, dQ = dS K, dK += dS^T Q).

GQA without repeating k/v: q [B, H, L, D] is viewed as [B, KVH, G*L_block, D] per block, so every matmul
is an ordinary [B, KVH] batched one and dK/dV sum over the G query heads of a kv head for free.
Causal (the string, or `causal=True` with an array mask) lets a query block skip the keys after it.
Matmuls run in the input dtype, softmax math in float32. A fully masked row gives output 0 and gradient 0.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from functools import cache
from typing import Any

import mlx.core as mx

from orpo.engine.queue import after

DEFAULT_BLOCK = 256


def _masked_scores(s: mx.array, keep: mx.array | None, bias: mx.array | None, scale: float) -> mx.array:
    """Scaled float32 scores with the additive bias added and the non-kept keys at -inf."""
    x = s.astype(mx.float32) * scale
    if bias is not None:
        x = x + bias
    if keep is not None:
        x = mx.where(keep, x, -mx.inf)
    return x


@cache
def _forward_block(scale: float, has_keep: bool, has_bias: bool) -> Callable:
    """Compiled: raw scores [.., Lb, Lk] -> (normalised P in the scores' dtype, lse [.., Lb] float32)."""

    def block(s: mx.array, *masks: mx.array) -> tuple[mx.array, mx.array]:
        it = iter(masks)
        keep = next(it) if has_keep else None
        bias = next(it) if has_bias else None
        x = _masked_scores(s, keep, bias, scale)
        m = mx.max(x, axis=-1, keepdims=True)
        m = mx.where(m == -mx.inf, 0.0, m)  # a fully masked row: exp(-inf - 0) = 0, no NaN
        p = mx.exp(x - m)
        total = mx.sum(p, axis=-1, keepdims=True)
        seen = total > 0
        # lse = +inf on a fully masked row, so the backward's exp(S - lse) is 0 there too.
        lse = mx.where(seen, m + mx.log(mx.where(seen, total, 1.0)), mx.inf)
        p = p * mx.where(seen, 1.0 / mx.where(seen, total, 1.0), 0.0)
        return p.astype(s.dtype), lse[..., 0]

    return mx.compile(block)


@cache
def _grad_block(scale: float, has_keep: bool, has_bias: bool) -> Callable:
    """Compiled: (raw scores, lse, dP = dO V^T, delta = rowsum(dO O)) -> (P, dS) in the scores' dtype."""

    def block(s: mx.array, lse: mx.array, dp: mx.array, delta: mx.array, *masks: mx.array) -> tuple[mx.array, mx.array]:
        it = iter(masks)
        keep = next(it) if has_keep else None
        bias = next(it) if has_bias else None
        p = mx.exp(_masked_scores(s, keep, bias, scale) - lse[..., None])
        ds = p * (dp.astype(mx.float32) - delta[..., None]) * scale
        return p.astype(s.dtype), ds.astype(s.dtype)

    return mx.compile(block)


def _mask_5d(mask: mx.array, batch: int, heads: int, kv_heads: int, length: int) -> mx.array:
    """An array mask broadcastable to [B, H, L, L] as [B|1, KVH|1, G|1, L|1, L|1] (head h = kv * G + g)."""
    m = mask.reshape((1,) * (4 - mask.ndim) + tuple(mask.shape)) if mask.ndim <= 4 else mask
    if m.ndim != 4 or any(n not in (1, want) for n, want in zip(m.shape, (batch, m.shape[1], length, length))):
        raise ValueError(f"blockwise_attention: mask has shape {tuple(mask.shape)}, expected one broadcastable "
                         f"to {(batch, heads, length, length)}")
    b, h, lq, lk = m.shape
    if h == 1:
        return m.reshape(b, 1, 1, lq, lk)
    if h != heads:
        raise ValueError(f"blockwise_attention: mask head dim {h} is neither 1 nor the {heads} query heads")
    return m.reshape(b, kv_heads, heads // kv_heads, lq, lk)


def _block_masks(mask: mx.array | None, causal: bool, s: int, e: int, keys: int) -> list[mx.array]:
    """The (keep, bias) masks of query rows s..e-1 against keys 0..keys-1, as [.., G|1, Lb|1, Lk|1] arrays."""
    keep = None
    if causal:
        keep = (mx.arange(s, e)[:, None] >= mx.arange(keys)[None, :])[None, None, None]
    bias = None
    if mask is not None:
        rows = mask if mask.shape[3] == 1 else mask[:, :, :, s:e]
        block = rows if rows.shape[4] == 1 else rows[..., :keys]
        if block.dtype == mx.bool_:
            keep = block if keep is None else keep & block
        else:
            bias = block.astype(mx.float32)
    return [x for x in (keep, bias) if x is not None]


def _kinds(mask: mx.array | None, causal: bool) -> tuple[bool, bool]:
    """(has_keep, has_bias) of the blocks `_block_masks` builds."""
    is_bool = mask is not None and mask.dtype == mx.bool_
    return causal or is_bool, mask is not None and not is_bool


@cache
def _attention(scale: float, causal: bool, has_mask: bool, block: int) -> Callable:
    """The custom function (q, k, v[, mask5]) -> out, with its blockwise analytic vjp."""

    def blocks(length: int) -> list[tuple[int, int, int]]:
        """(start, end, visible keys) per query block."""
        return [(s, min(s + block, length), min(s + block, length) if causal else length)
                for s in range(0, length, block)]

    def split(q: mx.array, kv_heads: int) -> mx.array:
        b, h, length, d = q.shape
        return q.reshape(b, kv_heads, h // kv_heads, length, d)

    def rows(x5: mx.array, s: int, e: int) -> mx.array:
        """Query rows s..e-1 of a [B, KVH, G, L, D] array as [B, KVH, G*(e-s), D]."""
        b, kvh, g, _, d = x5.shape
        return x5[:, :, :, s:e].reshape(b, kvh, g * (e - s), d)

    def forward(q: mx.array, k: mx.array, v: mx.array, *mask: mx.array) -> tuple[mx.array, mx.array]:
        b, h, length, _ = q.shape
        kvh, g = k.shape[1], h // k.shape[1]
        m5 = mask[0] if has_mask else None
        keep_bias = _kinds(m5, causal)
        step = _forward_block(scale, *keep_bias)
        q5 = split(q, kvh)
        outs, lses = [], []
        for s, e, n in blocks(length):
            qb = after(rows(q5, s, e), outs[-1:] + lses[-1:])
            scores = (qb @ k[:, :, :n].swapaxes(-1, -2)).reshape(b, kvh, g, e - s, n)
            p, lse = step(scores, *_block_masks(m5, causal, s, e, n))
            outs.append((p.reshape(b, kvh, g * (e - s), n) @ v[:, :, :n]).reshape(b, kvh, g, e - s, v.shape[-1]))
            lses.append(lse)
        out = mx.concatenate(outs, axis=3).reshape(b, h, length, v.shape[-1])
        return out, mx.concatenate(lses, axis=3).reshape(b, h, length)

    @mx.custom_function
    def attend(q: mx.array, k: mx.array, v: mx.array, *mask: mx.array) -> tuple[mx.array, mx.array]:
        return forward(q, k, v, *mask)

    @attend.vjp
    def attend_vjp(primals: list[mx.array], cotangents: list[mx.array], outputs: list[mx.array]) -> tuple[Any, ...]:
        q, k, v, *mask = primals
        out, lse = outputs
        d_out = cotangents[0]
        b, h, length, d = q.shape
        kvh, g = k.shape[1], h // k.shape[1]
        m5 = mask[0] if has_mask else None
        step = _grad_block(scale, *_kinds(m5, causal))
        q5, do5, lse4 = split(q, kvh), split(d_out.astype(q.dtype), kvh), lse.reshape(b, kvh, g, length)
        # delta_i = rowsum(dO * O) in float32: the softmax-Jacobian term, per query row
        delta = (d_out.astype(mx.float32) * out.astype(mx.float32)).sum(-1).reshape(b, kvh, g, length)
        dk = mx.zeros(k.shape, mx.float32)
        dv = mx.zeros(v.shape, mx.float32)
        dqs: list[mx.array] = []
        for s, e, n in blocks(length):
            # wait for all three of the previous block's results, so its P and dS are consumed and freed
            qb = after(rows(q5, s, e), [*dqs[-1:], dk, dv] if dqs else [])
            dob = rows(do5, s, e)
            kb, vb = k[:, :, :n], v[:, :, :n]
            scores = (qb @ kb.swapaxes(-1, -2)).reshape(b, kvh, g, e - s, n)
            dp = (dob @ vb.swapaxes(-1, -2)).reshape(b, kvh, g, e - s, n)
            p, ds = step(scores, lse4[..., s:e], dp, delta[..., s:e], *_block_masks(m5, causal, s, e, n))
            p, ds = p.reshape(b, kvh, g * (e - s), n), ds.reshape(b, kvh, g * (e - s), n)
            dqs.append((ds @ kb).reshape(b, kvh, g, e - s, d))
            pad = [(0, 0), (0, 0), (0, length - n), (0, 0)]
            dk = dk + mx.pad((ds.swapaxes(-1, -2) @ qb).astype(mx.float32), pad)
            dv = dv + mx.pad((p.swapaxes(-1, -2) @ dob).astype(mx.float32), pad)
        dq = mx.concatenate(dqs, axis=3).reshape(q.shape)
        return (dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype), *(mx.zeros_like(x) for x in mask))

    return attend


def blockwise_attention(q: mx.array, k: mx.array, v: mx.array, scale: float, mask: str | mx.array | None = None,
                        block: int = DEFAULT_BLOCK, causal: bool = False) -> mx.array:
    """softmax(q k^T scale + mask) v over query blocks of `block` rows, differentiable with a blockwise backward.

    q [B, H, L, D], k/v [B, KVH, L, D] with H a multiple of KVH. mask: "causal", None, or a boolean (True =
    may attend) / additive array broadcastable to [B, H, L, L]. causal=True also applies causality to an
    array mask (and lets blocks skip later keys): pass it only where the mask already includes causality
    or should. Same contract as mx.fast.scaled_dot_product_attention, except that a row with no visible
    key gives 0 (output and gradient), where mx.fast averages every value.
    """
    if q.ndim != 4 or k.ndim != 4 or v.ndim != 4:
        raise ValueError(f"blockwise_attention: q, k, v must be [B, heads, L, D], got {q.shape}, {k.shape}, {v.shape}")
    b, h, length, d = q.shape
    if k.shape[:3] != v.shape[:3] or k.shape[0] != b or k.shape[-1] != d or k.shape[2] != length:
        raise ValueError(f"blockwise_attention: self-attention shapes expected: q {q.shape}, k {k.shape}, v {v.shape}")
    if h % k.shape[1]:
        raise ValueError(f"blockwise_attention: {h} query heads is not a multiple of {k.shape[1]} kv heads")
    if block < 1:
        raise ValueError(f"blockwise_attention: block must be >= 1, got {block}")
    if isinstance(mask, str):
        if mask != "causal":
            raise ValueError(f"blockwise_attention: mask {mask!r} is not 'causal', None or an array")
        causal, mask = True, None
    args = [q, k, v] if mask is None else [q, k, v, _mask_5d(mask, b, h, k.shape[1], length)]
    out, _ = _attention(float(scale), bool(causal), mask is not None, int(block))(*args)
    return out


def _causal_sdpa(original: Callable, block: int) -> Callable:
    """mlx-lm's `scaled_dot_product_attention(queries, keys, values, cache, scale, mask, sinks)`, blockwise.

    Cache-free self-attention only; anything else (a KV cache, attention sinks) goes to `original`.
    """

    def sdpa(queries: mx.array, keys: mx.array, values: mx.array, cache: Any, scale: float, mask: Any,
             sinks: mx.array | None = None) -> mx.array:
        if cache is not None or sinks is not None or queries.shape[2] != keys.shape[2]:
            return original(queries, keys, values, cache=cache, scale=scale, mask=mask, sinks=sinks)
        return blockwise_attention(queries, keys, values, scale, mask, block, causal=True)

    return sdpa


# Extra head dims carrying the exclusion (cuDNN wants head dims in multiples of 8), and the magnitude in
# each: a query flag S times a key penalty -S in all 8 dims adds -8 S^2 = -131072 to the raw score, far
# below any real score, so exp() of it is exactly 0 in float32; 128 is exact in bf16 and fp16.
EXCLUSION_DIMS = 8
EXCLUSION_SCALE = 128.0
# MLX 0.32's CUDA attention runs cuDNN only for head dims up to 128 (supports_sdpa_cudnn); wider falls back
# to the unfused attention, which keeps [B, H, L, L] scores (a Mistral-7B step on real-length rows ran out
# of the H200's memory that way).
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
    kernel on CUDA). Costs the wider head dim: 2.05 vs 1.54 ms per layer fwd+bwd on the H200 (bench/README.md).
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
    computed. One H200 layer at the `h200-prefix` shape, fwd+bwd compiled: 1.53 ms vs 2.09-2.14 ms for the
    ExclusionMask and 1.68-1.78 ms for two forwards (bench/README.md).
    """

    rejected_start: int
    groups: tuple[tuple[int, int, int], ...]
    align: int = 1


def split_attention(sdpa: Callable[[mx.array, mx.array, mx.array], mx.array], q: mx.array, k: mx.array,
                    v: mx.array, split: SplitRows) -> mx.array:
    """Attention over SplitRows through `sdpa(q, k, v)` (causal, bottom-right aligned): [B, H, L, D] like q.

    Alignment: MLX 0.32's CUDA attention differentiates with cuDNN when the query length is a multiple of 128,
    and then returns wrong key/value gradients (or corrupts memory) unless the key length is one too
    (measured on an H200: relative error 1.0 at keys 188, 192, 1344; 2e-3 at 256, 1408, 1536). So for a
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


def _packed_sdpa(original: Callable) -> Callable:
    """mlx-lm's `scaled_dot_product_attention`, doing an ExclusionMask or SplitRows (anything else: `original`)."""

    def sdpa(queries: mx.array, keys: mx.array, values: mx.array, cache: Any, scale: float, mask: Any,
             sinks: mx.array | None = None) -> mx.array:
        if isinstance(mask, SplitRows):
            causal = lambda q, k, v: original(q, k, v, cache=cache, scale=scale, mask="causal", sinks=sinks)
            return split_attention(causal, queries, keys, values, mask)
        if not isinstance(mask, ExclusionMask):
            return original(queries, keys, values, cache=cache, scale=scale, mask=mask, sinks=sinks)
        b, h, length, _ = queries.shape
        q = mx.concatenate([queries, mx.broadcast_to(mask.queries, (b, h, length, EXCLUSION_DIMS))], axis=-1)
        k = mx.concatenate([keys, mx.broadcast_to(mask.keys, (b, keys.shape[1], length, EXCLUSION_DIMS))], axis=-1)
        return original(q, k, values, cache=cache, scale=scale, mask="causal", sinks=sinks)

    return sdpa


@contextmanager
def sdpa_swapped_in(module_names: list[str], wrap: Callable[[Callable], Callable]) -> Iterator[None]:
    """While inside, these mlx-lm model modules call wrap(their scaled_dot_product_attention); always restored.

    A module without a module-level `scaled_dot_product_attention` (gemma2: its own softcapped attention) is
    left alone. Process-global while active: not for models run concurrently in other threads.
    """
    swapped = []
    try:
        for name in dict.fromkeys(module_names):
            module = importlib.import_module(name)
            original = getattr(module, "scaled_dot_product_attention", None)
            if original is not None:
                module.scaled_dot_product_attention = wrap(original)
                swapped.append((module, original))
        yield
    finally:
        for module, original in reversed(swapped):
            module.scaled_dot_product_attention = original


def causal_blockwise_in(module_names: list[str], block: int = DEFAULT_BLOCK) -> Any:
    """While inside, these mlx-lm model modules call blockwise_attention instead of mlx-lm's sdpa; always restored.

    Every mask reaching them must already include causality (the engine stack's masks do: "causal", mlx-lm's
    causal/windowed arrays, prefix-sharing block masks), since key blocks after each query block are skipped.
    """
    return sdpa_swapped_in(module_names, lambda original: _causal_sdpa(original, block))


def packed_masks_in(module_names: list[str]) -> Any:
    """While inside, these mlx-lm model modules do an ExclusionMask or SplitRows mask; always restored."""
    return sdpa_swapped_in(module_names, _packed_sdpa)
