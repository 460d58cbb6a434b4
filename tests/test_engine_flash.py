"""The fused ordered attention backward (orpo.engine.flash, CUDA only): float64 gradients, the matmul path's
gradients, and the same bits on every run.

Oracle: numpy float64 gradients of sum(cot * attention) from the softmax's Jacobian (test_engine_attention's).
Half-precision operands: relative norms of about 1e-2 (inputs, P and dS rounded to the dtype), as the matmul
path's ordered backward and autodiff through mx.fast's attention give.
"""

import mlx.core as mx
import numpy as np
import pytest
from test_engine_attention import SCALE, numpy_attention_grads, qkv

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
