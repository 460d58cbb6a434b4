"""Prefix-sharing attention: split rows and exclusion dims equal a numpy float64 attention under the block mask.

Oracles: the forward against an independent numpy float64 softmax attention; the gradients against mx.grad
through mx.fast sdpa under the same boolean mask, with a non-uniform cotangent. Float32 on the CPU: the two
orders of the same sums agree to ~1e-6 (measured: <= 1e-6 absolute on outputs and gradients of O(1)).
"""

import mlx.core as mx
import numpy as np
import pytest
from conftest import MATMUL_TOL
from test_engine_stack import prompt_groups

from orpo.device import on_cuda
from orpo.engine.attention import attend

TOL = 10 * MATMUL_TOL  # float32 outputs/gradients of O(1), absolute (1e-5 on the CPU)
SCALE = 0.4


def qkv(b: int, h: int, kvh: int, length: int, d: int, seed: int = 0, dtype=mx.float32) -> tuple[mx.array, ...]:
    """Random q [b, h, L, d], k/v [b, kvh, L, d]."""
    rng = np.random.default_rng(seed)
    shapes = ((b, h, length, d), (b, kvh, length, d), (b, kvh, length, d))
    return tuple(mx.array(rng.normal(size=s).astype(np.float32)).astype(dtype) for s in shapes)


def numpy_attention(q, k, v, scale: float, mask) -> np.ndarray:
    """Float64 softmax attention: k/v heads repeated for GQA, "causal" = lower triangle, rows with no key = 0."""
    q, k, v = (np.array(x.astype(mx.float32), dtype=np.float64) for x in (q, k, v))
    g = q.shape[1] // k.shape[1]
    k, v = np.repeat(k, g, axis=1), np.repeat(v, g, axis=1)
    s = scale * q @ k.swapaxes(-1, -2)
    length = q.shape[2]
    if isinstance(mask, str):
        s = np.where(np.tril(np.ones((length, length), bool)), s, -np.inf)
    elif mask is not None and mask.dtype == mx.bool_:
        s = np.where(np.array(mask), s, -np.inf)
    elif mask is not None:
        s = s + np.array(mask, dtype=np.float64)
    m = s.max(-1, keepdims=True)
    p = np.exp(s - np.where(np.isfinite(m), m, 0.0))
    total = p.sum(-1, keepdims=True)
    return (np.divide(p, total, out=np.zeros_like(p), where=total > 0)) @ v


# (heads, kv_heads, length)
GEOMETRIES = {"gqa": (4, 2, 37), "mha": (3, 3, 21)}


def grads(fn, q, k, v, cot) -> list[np.ndarray]:
    """d sum(cot * fn(q, k, v)) / d(q, k, v)."""
    g = mx.grad(lambda q, k, v: (fn(q, k, v).astype(mx.float32) * cot).sum(), argnums=(0, 1, 2))(q, k, v)
    return [np.array(x.astype(mx.float32)) for x in g]


def test_other_masks_go_to_mx_fast_attention_as_they_are():
    """"causal", None and an array mask: exactly mx.fast's attention (what mlx-lm's layers call without a cache)."""
    q, k, v = qkv(2, 4, 2, 9, 8, seed=15)
    keep = mx.array(np.random.default_rng(16).random((2, 1, 9, 9)) < 0.7) | mx.eye(9, dtype=mx.bool_)
    for mask in ("causal", None, keep, mx.where(keep, 0.0, -mx.inf)):
        want = mx.fast.scaled_dot_product_attention(q, k, v, scale=SCALE, mask=mask)
        np.testing.assert_array_equal(np.array(attend(q, k, v, SCALE, mask)), np.array(want))
    np.testing.assert_allclose(np.array(attend(q, k, v, SCALE, keep)), numpy_attention(q, k, v, SCALE, keep),
                               atol=TOL, rtol=0)


def exclusion_case(b: int, length: int, seed: int) -> tuple[mx.array, np.ndarray]:
    """Per-row hidden spans like prefix rows' (rows differ: [shared, start) hidden from queries at start on), and
    the boolean mask they mean."""
    rng = np.random.default_rng(seed)
    spans = np.array([sorted(rng.choice(np.arange(1, length - 1), 2, replace=False)) for _ in range(b)], np.int32)
    q, k = np.arange(length)[None, :, None], np.arange(length)[None, None, :]
    first, end = spans[:, 0, None, None], spans[:, 1, None, None]
    keep = (k <= q) & ~((q >= end) & (k >= first) & (k < end))
    return mx.array(spans), keep[:, None]


def packed_attention_case(b: int, length: int, seed: int) -> tuple[mx.array, np.ndarray]:
    """Key bounds of packed rows (several pairs of random lengths a row, one with no chosen token of its own,
    padding after) and the boolean mask they mean: same pair, causal, rejected blind to chosen."""
    from orpo.engine.attention import CHOSEN, PROMPT, REJECTED, packed_key_bounds
    rng = np.random.default_rng(seed)
    segments, roles = np.zeros((b, length), np.int32), np.zeros((b, length), np.int32)
    for r in range(b):
        at, place = 0, 0
        while at < length - 20 and place < 7:
            p, c, j = rng.integers(1, 40), 0 if place == 1 else rng.integers(1, 40), rng.integers(1, 40)
            n = min(p + c + j, length - at)
            segments[r, at:at + n] = place
            roles[r, at:at + n] = [PROMPT] * min(p, n) + [CHOSEN] * min(c, max(0, n - p)) + [REJECTED] * max(0, n - p - c)
            at, place = at + n, place + 1
        segments[r, at:] = place
    q, k = np.arange(length)[None, :, None], np.arange(length)[None, None, :]
    keep = ((segments[:, :, None] == segments[:, None, :]) & (k <= q)
            & ~((roles[:, :, None] == REJECTED) & (roles[:, None, :] == CHOSEN)))
    return mx.array(packed_key_bounds(segments, roles)), keep[:, None]


def bounds_mask(bounds: np.ndarray) -> np.ndarray:
    """The boolean mask [B, 1, L, L] key bounds [B, L, 3] mean, causal: what the kernels let a query see."""
    length = bounds.shape[1]
    q, k = np.arange(length)[None, :, None], np.arange(length)[None, None, :]
    lo, hs, he = (bounds[:, :, i, None] for i in range(3))
    return ((k <= q) & (k >= lo) & ~((k >= hs) & (k < he)))[:, None]


def test_key_bounds_mean_the_block_masks():
    """Per-query key bounds from hidden spans (tight rows) and from packed rows' pair places and roles (several
    pairs a row, one with no chosen token of its own, padding after) hide exactly what the block masks hide; first
    keys never decrease along a row."""
    from orpo.engine.attention import row_bounds
    spans, keep = exclusion_case(3, 50, 71)
    assert np.array_equal(bounds_mask(np.array(row_bounds(spans, 50))), keep)
    for seed in range(5):
        bounds, keep = packed_attention_case(3, 200, seed)
        bounds = np.array(bounds)
        assert np.array_equal(bounds_mask(bounds), keep), seed
        assert (np.diff(bounds[:, :, 0], axis=1) >= 0).all()
        hidden = bounds[:, :, 2] > 0  # rejected's queries: a chosen span, empty for the pair with none
        assert (bounds[:, :, 1] < bounds[:, :, 2])[hidden].any() and (bounds[:, :, 1] == bounds[:, :, 2])[hidden].any()


def exclusion_attention(q, k, v, spans):
    """The engine's attention with an ExclusionMask."""
    from orpo.engine.attention import exclusion_mask

    return attend(q, k, v, SCALE, exclusion_mask(spans, q.shape[2], q.dtype))


@pytest.mark.parametrize("geometry", ["gqa", "mha"])
def test_exclusion_mask_equals_the_block_mask(geometry):
    """One causal attention with the exclusion dims = numpy's attention under the boolean block mask; its
    gradients = autodiff through mx.fast sdpa under that mask (the extra dims' gradient never reaches q, k)."""
    h, kvh, length = GEOMETRIES[geometry]
    q, k, v = qkv(3, h, kvh, length, 8, seed=21)
    spans, keep = exclusion_case(3, length, 22)
    assert (~keep).sum() > np.triu(np.ones((length, length)), 1).sum() * 3  # something beyond causality is hidden
    got = exclusion_attention(q, k, v, spans)
    assert got.shape == q.shape
    np.testing.assert_allclose(np.array(got), numpy_attention(q, k, v, SCALE, mx.array(keep)), atol=TOL, rtol=0)
    cot = mx.array(np.random.default_rng(23).normal(size=q.shape).astype(np.float32))
    want = grads(lambda q, k, v: mx.fast.scaled_dot_product_attention(q, k, v, scale=SCALE, mask=mx.array(keep)),
                 q, k, v, cot)
    got = grads(lambda q, k, v: exclusion_attention(q, k, v, spans), q, k, v, cot)
    for name, g, w in zip("qkv", got, want):
        assert np.abs(w).max() > 0.1, name
        np.testing.assert_allclose(g, w, atol=TOL, rtol=0, err_msg=name)
    # Control: without the exclusion it is plain causal attention, which differs.
    assert np.abs(numpy_attention(q, k, v, SCALE, "causal") - numpy_attention(q, k, v, SCALE, mx.array(keep))).max() > 0.1


@pytest.mark.parametrize("dtype", [mx.bfloat16, mx.float16])
def test_exclusion_mask_in_half_precision(dtype):
    """The penalty (-16384 on the raw score) is exact in bf16/fp16 and hides the keys completely: the output
    equals the masked sdpa's in the same dtype to its rounding, far from the unmasked one."""
    q, k, v = qkv(2, 4, 2, 48, 16, seed=24, dtype=dtype)
    spans, keep = exclusion_case(2, 48, 25)
    got = np.array(exclusion_attention(q, k, v, spans).astype(mx.float32))
    want = numpy_attention(q, k, v, SCALE, mx.array(keep))
    # Measured 1.2e-2 max abs for bf16, 1.9e-3 for fp16 (outputs up to 2.8; inputs and P rounded to the dtype).
    np.testing.assert_allclose(got, want, atol=3e-2, rtol=0)
    assert np.abs(numpy_attention(q, k, v, SCALE, "causal") - want).max() > 0.1


def split_case(prompts: list[int], start: int, length: int, align: int = 1):
    """SplitRows of rows [prompt; chosen; pad | rejected; pad] (rejected from `start`) and the boolean mask they mean."""
    from orpo.engine.attention import SplitRows

    q, k = np.arange(length)[:, None], np.arange(length)[None, :]
    keep = np.stack([(k <= q) & ~((q >= start) & (k >= p) & (k < start)) for p in prompts])
    return SplitRows(start, prompt_groups(prompts), align), keep[:, None]


@pytest.mark.parametrize("geometry", ["gqa", "mha"])
@pytest.mark.parametrize("prompts", [[5, 5, 5], [3, 3, 6, 0]], ids=["one-group", "groups+unshared"])
@pytest.mark.parametrize("align", [1, 4])  # 4: prompt-tail queries and zero keys/queries appended (CUDA's 128)
def test_split_rows_equal_the_block_mask(geometry, prompts, align):
    """Two causal attentions (SplitRows) = numpy's attention under the boolean block mask on every row, pads
    included; gradients = autodiff through mx.fast sdpa under that mask."""
    h, kvh, length = GEOMETRIES[geometry]
    start = length // 2 + 1
    split, keep = split_case(prompts, start, length, align)
    q, k, v = qkv(len(prompts), h, kvh, length, 8, seed=26)
    split_attend = lambda q, k, v: attend(q, k, v, SCALE, split)  # noqa: E731
    got = split_attend(q, k, v)
    assert got.shape == q.shape
    np.testing.assert_allclose(np.array(got), numpy_attention(q, k, v, SCALE, mx.array(keep)), atol=TOL, rtol=0)
    cot = mx.array(np.random.default_rng(27).normal(size=q.shape).astype(np.float32))
    want = grads(lambda q, k, v: mx.fast.scaled_dot_product_attention(q, k, v, scale=SCALE, mask=mx.array(keep)),
                 q, k, v, cot)
    for name, g, w in zip("qkv", grads(split_attend, q, k, v, cot), want):
        assert np.abs(w).max() > 0.1, name
        np.testing.assert_allclose(g, w, atol=TOL, rtol=0, err_msg=name)
    # Control: the plain causal attention over the same rows differs (rejected would see chosen).
    assert np.abs(numpy_attention(q, k, v, SCALE, "causal") - np.array(got)).max() > 0.1


@pytest.mark.parametrize("dtype", [mx.bfloat16, mx.float16])
def test_split_rows_in_half_precision(dtype):
    """In bf16/fp16 SplitRows equals the masked attention to the dtype's rounding, far from the unmasked one."""
    prompts, length = [9, 9, 20], 48
    split, keep = split_case(prompts, 32, length)
    q, k, v = qkv(3, 4, 2, length, 16, seed=28, dtype=dtype)
    got = np.array(attend(q, k, v, SCALE, split).astype(mx.float32))
    want = numpy_attention(q, k, v, SCALE, mx.array(keep))
    np.testing.assert_allclose(got, want, atol=3e-2, rtol=0)  # the same bound as the exclusion's
    assert np.abs(numpy_attention(q, k, v, SCALE, "causal") - want).max() > 0.1


@pytest.mark.skipif(not on_cuda(), reason="cuDNN's attention runs on a CUDA GPU only")
def test_split_rows_through_cudnn_equal_float32_attention():
    """On CUDA, bf16 at widths of 128 (cuDNN's forward and backward), prompts of their own lengths (no multiple
    of 128: the aligned second attention) equal float32 attention under the block mask, gradients included."""
    prompts, start, length = [300, 300, 517, 0], 768, 1024
    split, keep = split_case(prompts, start, length, 128)
    q, k, v = qkv(len(prompts), 8, 2, length, 64, seed=29)
    cot = mx.array(np.random.default_rng(30).normal(size=q.shape).astype(np.float32))
    bf16 = [x.astype(mx.bfloat16) for x in (q, k, v)]
    got = grads(lambda q, k, v: attend(q, k, v, SCALE, split).astype(mx.float32), *bf16, cot)
    out = np.array(attend(*bf16, SCALE, split).astype(mx.float32))
    # The float32 oracle on the CPU: on the H200, float32 runs at small test shapes stopped with
    # "cudaGraphAddKernelNode: invalid argument" (every packed attention kind, the additive mask's too; cause not found).
    with mx.stream(mx.cpu):
        want = grads(lambda q, k, v: mx.fast.scaled_dot_product_attention(q, k, v, scale=SCALE, mask=mx.array(keep)),
                     q, k, v, cot)
        ref = numpy_attention(q, k, v, SCALE, mx.array(keep))
    # Relative norms: bf16 rounding gives about 1e-2 here (MLX's CPU bf16 path: 1.1-1.3e-2); a broken
    # cuDNN backward (key lengths not a multiple of 128) gave 1.0.
    assert np.linalg.norm(out - ref) / np.linalg.norm(ref) < 5e-2
    for name, g, w in zip("qkv", got, want):
        assert np.linalg.norm(g - w) / np.linalg.norm(w) < 5e-2, name


def numpy_attention_grads(q, k, v, scale: float, mask, cot) -> list[np.ndarray]:
    """Float64 gradients of sum(cot * attention(q, k, v)) by the softmax's Jacobian, with GQA's key heads repeated
    (and their gradients summed back); `mask` as numpy_attention's, "causal" bottom-right aligned."""
    q, k, v = (np.array(x.astype(mx.float32), dtype=np.float64) for x in (q, k, v))
    cot = np.array(cot, dtype=np.float64)
    kvh, g = k.shape[1], q.shape[1] // k.shape[1]
    kr, vr = np.repeat(k, g, axis=1), np.repeat(v, g, axis=1)
    s = scale * q @ kr.swapaxes(-1, -2)
    lq, lk = s.shape[-2:]
    if isinstance(mask, str):
        s = np.where(np.arange(lk)[None] <= np.arange(lq)[:, None] + lk - lq, s, -np.inf)
    elif mask is not None and mask.dtype == mx.bool_:
        s = np.where(np.array(mask), s, -np.inf)
    elif mask is not None:
        s = s + np.array(mask.astype(mx.float32), dtype=np.float64)
    p = np.exp(s - s.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    dp = cot @ vr.swapaxes(-1, -2)
    ds = p * (dp - (p * dp).sum(-1, keepdims=True))
    dq = scale * ds @ kr
    dk = (scale * ds.swapaxes(-1, -2) @ q).reshape(k.shape[0], kvh, g, *k.shape[2:]).sum(2)
    dv = (p.swapaxes(-1, -2) @ cot).reshape(v.shape[0], kvh, g, *v.shape[2:]).sum(2)
    return [dq, dk, dv]


def ordered_cases():
    """(name, q, k, v, mask): causal, no mask, boolean and additive arrays, fewer queries than keys."""
    q, k, v = qkv(2, 4, 2, 23, 8, seed=31)
    keep = mx.array(np.random.default_rng(32).random((2, 1, 23, 23)) < 0.7) | mx.eye(23, dtype=mx.bool_)
    per_head = mx.array(np.random.default_rng(33).random((2, 4, 23, 23)) < 0.7) | mx.eye(23, dtype=mx.bool_)
    yield "causal", q, k, v, "causal"
    yield "none", q, k, v, None
    yield "bool", q, k, v, keep
    yield "bool-per-head", q, k, v, per_head
    yield "additive", q, k, v, mx.where(keep, 0.0, -mx.inf)
    yield "mha", *qkv(2, 3, 3, 23, 8, seed=34), "causal"
    yield "bottom-right", q[:, :, 9:], k, v, "causal"


@pytest.mark.parametrize("rows", [0, 5], ids=["one-block", "blocks"])
def test_ordered_attention_equals_float64_attention(monkeypatch, rows):
    """ordered_attention's forward is mx.fast's exactly; its gradients equal numpy's float64 gradients and
    autodiff through mx.fast's attention, in one query block and in blocks of 5 queries (causal blocks read
    only the keys they see)."""
    from orpo.engine import attention

    if rows:
        monkeypatch.setattr(attention, "ORDERED_BLOCK_SCORES", rows * 2 * 4 * 23)
    for name, q, k, v, mask in ordered_cases():
        got = attention.ordered_attention(q, k, v, SCALE, mask)
        np.testing.assert_array_equal(np.array(got), np.array(
            mx.fast.scaled_dot_product_attention(q, k, v, scale=SCALE, mask=mask)), err_msg=name)
        cot = mx.array(np.random.default_rng(35).normal(size=q.shape).astype(np.float32))
        ordered = grads(lambda q, k, v: attention.ordered_attention(q, k, v, SCALE, mask), q, k, v, cot)
        fused = grads(lambda q, k, v: mx.fast.scaled_dot_product_attention(q, k, v, scale=SCALE, mask=mask),
                      q, k, v, cot)
        for part, o, f, w in zip("qkv", ordered, fused, numpy_attention_grads(q, k, v, SCALE, mask, cot)):
            assert np.abs(w).max() > 0.1, (name, part)
            np.testing.assert_allclose(o, w, atol=TOL, rtol=0, err_msg=f"{name} d{part}")
            np.testing.assert_allclose(f, w, atol=TOL, rtol=0, err_msg=f"{name} d{part} (mx.fast)")


@pytest.mark.parametrize("dtype", [mx.bfloat16, mx.float16])
def test_ordered_attention_in_half_precision_compiled(dtype):
    """In bf16/fp16 under mx.compile, through SplitRows and the exclusion dims as the engine calls it, the
    ordered backward equals float64 gradients to the dtype's rounding, like autodiff through mx.fast does."""
    prompts, length = [9, 9, 20], 48
    split, keep = split_case(prompts, 32, length)
    spans, tight = exclusion_case(3, length, 36)
    q, k, v = qkv(3, 4, 2, length, 16, seed=37)
    cot = mx.array(np.random.default_rng(38).normal(size=q.shape).astype(np.float32))
    half = [x.astype(dtype) for x in (q, k, v)]
    from orpo.engine.attention import exclusion_mask

    for name, mask, block in (("split", split, keep), ("exclusion", None, tight)):
        m = mask or exclusion_mask(spans, length, dtype)
        want = numpy_attention_grads(q, k, v, SCALE, mx.array(block), cot)
        for ordered in (True, False):
            fn = mx.compile(lambda q, k, v: attend(q, k, v, SCALE, m, ordered=ordered).astype(mx.float32))
            for part, g, w in zip("qkv", grads(fn, *half, cot), want):
                # Relative norms: rounding of inputs and P to the dtype gives about 1e-2.
                assert np.linalg.norm(g - w) / np.linalg.norm(w) < 3e-2, (name, ordered, part)
