"""Our attention kernels (orpo.engine.flash, CUDA only): the ordered backward against float64 gradients and the
matmul path's, the forward and backward under hidden spans against float64, the same bits on every run, and tight
prefix rows of a head dim of 128 (where the exclusion dims do not fit cuDNN) against separate forwards.

Oracle: numpy float64 gradients of sum(cot * attention) from the softmax's Jacobian (test_engine_attention's).
Half-precision operands: relative norms of about 1e-2 (inputs, P and dS rounded to the dtype), as the matmul
path's ordered backward and autodiff through mx.fast's attention give.
"""

import mlx.core as mx
import numpy as np
import pytest
from test_engine_attention import (SCALE, exclusion_case, numpy_attention, numpy_attention_grads,
                                   packed_attention_case, qkv)

from orpo.device import on_cuda
from orpo.engine import attention, flash

pytestmark = pytest.mark.skipif(not on_cuda(), reason="the fused backward is a CUDA kernel")


def cases():
    """(name, q, k, v, mask): several blocks in both kernels, lengths off the tiles, GQA and MHA, head dims 64,
    128 and 72 (padded to 80), fewer queries than keys."""
    yield "gqa-d64", *qkv(2, 8, 2, 200, 64, seed=41), "causal"
    yield "d128", *qkv(1, 4, 1, 130, 128, seed=42), "causal"
    q, k, v = qkv(2, 4, 2, 150, 64, seed=43)
    yield "bottom-right", q[:, :, 80:], k, v, "causal"
    yield "no-mask-d72-mha", *qkv(2, 3, 3, 90, 72, seed=44), None


def backward(q, k, v, mask, cot, dtype):
    """ordered_attention's gradients in `dtype` as float32 numpy arrays."""
    def loss(q, k, v):
        return (attention.ordered_attention(q, k, v, SCALE, mask).astype(mx.float32) * cot).sum()

    g = mx.grad(loss, argnums=(0, 1, 2))(*(x.astype(dtype) for x in (q, k, v)))
    return [np.array(x.astype(mx.float32)) for x in g]


@pytest.mark.parametrize("dtype", [mx.bfloat16, mx.float16])
def test_flash_backward_equals_float64_and_the_matmul_path(monkeypatch, dtype):
    calls = []
    fused = flash.flash_backward
    monkeypatch.setattr(attention, "flash_backward", lambda *a: calls.append(1) or fused(*a))
    for name, q, k, v, mask in cases():
        cot = mx.array(np.random.default_rng(45).normal(size=q.shape).astype(np.float32))
        want = numpy_attention_grads(q, k, v, SCALE, mask, cot)
        n = len(calls)
        got = backward(q, k, v, mask, cot, dtype)
        assert len(calls) == n + 1, name
        with monkeypatch.context() as m:
            m.setattr(attention, "flash_fits", lambda *a: False)
            matmul = backward(q, k, v, mask, cot, dtype)
        for part, g, mm, w in zip("qkv", got, matmul, want):
            err = np.linalg.norm(g - w) / np.linalg.norm(w)
            assert err < 2e-2, (name, part, err)
            # no worse than the matmul path's own rounding (plus a margin)
            assert err < 1.5 * np.linalg.norm(mm - w) / np.linalg.norm(w) + 1e-3, (name, part)


def test_flash_backward_gives_the_same_bits_every_run():
    q, k, v = qkv(2, 8, 2, 1024, 64, seed=46, dtype=mx.bfloat16)
    cot = mx.array(np.random.default_rng(47).normal(size=q.shape).astype(np.float32))

    def step(q, k, v):
        return mx.grad(lambda q, k, v: (attention.ordered_attention(q, k, v, SCALE, "causal") * cot).sum(),
                       argnums=(0, 1, 2))(q, k, v)

    fn = mx.compile(step)
    first = [np.array(x.astype(mx.float32)) for x in fn(q, k, v)]
    for _ in range(3):
        for a, b in zip(first, fn(q, k, v)):
            np.testing.assert_array_equal(a, np.array(b.astype(mx.float32)))


def assert_bounded_attention_equals_float64(qkv32, bounds, keep, dtype, seed, name):
    """Our kernels' forward and compiled gradients under key `bounds` in `dtype` equal numpy's float64 attention
    under the mask `keep` to the dtype's rounding, and give the same bits again; returns the dtype's q, k, v and
    numpy's output."""
    from orpo.engine.attention import span_attention
    q, k, v = qkv32
    cot = mx.array(np.random.default_rng(seed).normal(size=q.shape).astype(np.float32))
    half = [x.astype(dtype) for x in qkv32]

    def loss(q, k, v):
        return (span_attention(q, k, v, SCALE, bounds).astype(mx.float32) * cot).sum()

    out = span_attention(*half, SCALE, bounds).astype(mx.float32)
    want = numpy_attention(q, k, v, SCALE, mx.array(keep))
    # inputs, P and the output rounded to the dtype: relative norms of about 1e-2 at most
    assert np.linalg.norm(np.array(out) - want) / np.linalg.norm(want) < 2e-2, name
    step = mx.compile(mx.grad(loss, argnums=(0, 1, 2)))
    got = [np.array(x.astype(mx.float32)) for x in step(*half)]
    for part, g, w in zip("qkv", got, numpy_attention_grads(q, k, v, SCALE, mx.array(keep), cot)):
        assert np.linalg.norm(g - w) / np.linalg.norm(w) < 3e-2, (name, part)
    for g, again in zip(got, step(*half)):
        np.testing.assert_array_equal(g, np.array(again.astype(mx.float32)))
    return half, want


@pytest.mark.parametrize("dtype", [mx.bfloat16, mx.float16])
def test_span_attention_equals_float64(dtype):
    """Forward and gradients under per-row hidden spans (rows differ, lengths off the tiles, GQA, head dims 64
    and 128) equal numpy's float64 attention under the block mask to the dtype's rounding; the same bits again
    under mx.compile; hiding nothing is plain causal attention."""
    from orpo.engine.attention import span_attention
    for name, (b, h, kvh, length, d) in {"gqa-d64": (3, 8, 2, 200, 64), "d128": (2, 4, 1, 130, 128)}.items():
        q, k, v = qkv(b, h, kvh, length, d, seed=51)
        spans, keep = exclusion_case(b, length, 52)
        bounds = attention.row_bounds(spans, length)
        half, want = assert_bounded_attention_equals_float64((q, k, v), bounds, keep, dtype, 53, name)
        assert np.abs(numpy_attention(q, k, v, SCALE, "causal") - want).max() > 0.1  # the spans hide something
        nothing = span_attention(*half, SCALE, flash.no_bounds(b, length)).astype(mx.float32)
        causal = mx.fast.scaled_dot_product_attention(*half, scale=SCALE, mask="causal").astype(mx.float32)
        assert np.linalg.norm(np.array(nothing) - np.array(causal)) / np.linalg.norm(np.array(causal)) < 2e-2, name


def test_tight_rows_at_head_dim_128_give_the_hidden_states_of_separate_forwards():
    """A bf16 model of head dim 128 (Mistral-7B's: the exclusion dims do not fit cuDNN) takes tight prefix rows
    through hidden spans, and its rows' hidden states equal the plain [chosen; rejected] rows' to bf16 rounding."""
    from test_engine_stack import random_pairs, tiny_model, with_unshared_pair

    from orpo.engine.attention import HiddenSpans
    from orpo.engine.stack import Stack
    from orpo.train.rows import plain_rows, shared_rows
    from orpo.train.step import tight_rows_fit
    model = tiny_model("llama", head_dim=128)
    model.set_dtype(mx.bfloat16)
    assert tight_rows_fit(model)
    pairs = with_unshared_pair(random_pairs(7, 5), 2)
    stack = Stack(model)
    plain, shared = plain_rows(pairs, 128), shared_rows(pairs, 128)  # targets padded to one rung
    assert shared.layout.split is None and shared.layout.tokens.shape[0] == len(pairs)  # tight rows
    assert all(isinstance(m, HiddenSpans) for m in stack.masks(shared.layout, stack.embed(shared.layout.tokens)))

    def gathered(packed) -> np.ndarray:
        h = stack.hidden(packed.layout).astype(mx.float32)
        return np.array(h.reshape(-1, h.shape[-1])[packed.index])

    want, got = gathered(plain), gathered(shared)
    assert np.linalg.norm(got - want) / np.linalg.norm(want) < 2e-2


@pytest.mark.parametrize("dtype", [mx.bfloat16, mx.float16])
def test_packed_rows_attend_within_their_pairs_as_float64(dtype):
    """Forward and gradients on packed rows' key bounds (several pairs a row, lengths off the tiles, GQA, head dims
    64 and 128) equal numpy's float64 attention under the pairs' block mask, with the blocks no row of a block sees
    skipped; the same bits again under mx.compile."""
    for name, (b, h, kvh, length, d) in {"gqa-d64": (2, 8, 2, 300, 64), "d128": (2, 4, 1, 260, 128)}.items():
        q, k, v = qkv(b, h, kvh, length, d, seed=61)
        bounds, keep = packed_attention_case(b, length, 62)
        assert_bounded_attention_equals_float64((q, k, v), bounds, keep, dtype, 63, name)


def test_packed_rows_at_head_dim_128_give_each_pair_the_hidden_states_it_has_alone():
    """A bf16 model of head dim 128 packs pairs through our kernels (the exclusion dims do not fit cuDNN), and each
    pair's hidden states at its scored positions equal those of the pair alone in its own row to bf16 rounding."""
    from test_engine_stack import random_pairs, tiny_model, with_unshared_pair

    from orpo.engine.attention import HiddenSpans
    from orpo.engine.stack import Stack
    from orpo.train.rows import packed_rows, shared_rows
    model = tiny_model("llama", head_dim=128)
    model.set_dtype(mx.bfloat16)
    pairs = with_unshared_pair(random_pairs(11, 7), 12)
    packed = packed_rows(pairs, [3, 3, 2], 48)
    stack = Stack(model)
    assert all(isinstance(m, HiddenSpans) for m in stack.masks(packed.layout, stack.embed(packed.layout.tokens)))
    h = stack.hidden(packed.layout).astype(mx.float32)
    got = np.array(h.reshape(-1, h.shape[-1])[packed.index])
    chosen, rejected = [], []
    for i in range(len(pairs)):
        alone = shared_rows(pairs.select([i]), attention="exclusion")
        ha = stack.hidden(alone.layout).astype(mx.float32)
        rows = np.array(ha.reshape(-1, ha.shape[-1])[alone.index])
        nc, nr = (int(x) for x in (np.array(alone.weights) > 0).sum(axis=1))
        chosen.append(rows[:nc])
        rejected.append(rows[nc:nc + nr])
    want = np.concatenate(chosen + rejected)
    assert np.linalg.norm(got[:len(want)] - want) / np.linalg.norm(want) < 2e-2
