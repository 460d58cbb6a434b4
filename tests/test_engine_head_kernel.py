"""The fused head's CUDA kernel tier equals the pure-MLX forward block (run where MLX has CUDA: the lent GPU)."""

import mlx.core as mx
import numpy as np
import pytest

from orpo.device import on_cuda
from orpo.engine.head import LMHead, _forward_block, fused_logp
from orpo.engine.head_kernel import logsumexp_block
from orpo.engine.objective import resolve_engine

cuda = pytest.mark.skipif(not on_cuda(), reason="the kernel tier runs on a CUDA GPU only")


def test_the_kernel_is_chosen_only_where_it_runs():
    """Off by default; auto resolves to the kernel exactly on a CUDA GPU; true elsewhere is refused with the field's name."""
    assert resolve_engine({})["head_kernel"] is False
    assert resolve_engine({"head_kernel": "auto"})["head_kernel"] is on_cuda()
    assert (logsumexp_block(None) is not None) is on_cuda()
    assert resolve_engine({"head_kernel": False})["head_kernel"] is False
    if not on_cuda():
        with pytest.raises(ValueError, match="train.engine.head_kernel: true needs a CUDA GPU"):
            resolve_engine({"head_kernel": True})
    with pytest.raises(ValueError, match="train.engine.head_kernel"):
        resolve_engine({"head_kernel": "on"})


@cuda
@pytest.mark.parametrize("dtype", [mx.bfloat16, mx.float16, mx.float32])
@pytest.mark.parametrize("vocab", [4096, 1001])  # 1001: no 16-byte loads (the scalar loop)
@pytest.mark.parametrize("cap", [None, 30.0])
def test_kernel_block_equals_the_mlx_block(dtype, vocab, cap):
    """logp and logsumexp per row within float32 rounding of the MLX block's, with a float64 numpy oracle."""
    rows = 37
    x = (mx.random.normal((rows, vocab), key=mx.random.key(3)) * 4).astype(dtype)
    t = mx.random.randint(0, vocab, (rows,), key=mx.random.key(4))
    got_lp, got_lse = logsumexp_block(cap)(x, t)
    want_lp, want_lse = _forward_block(cap, False)(x, t)
    z = np.array(x.astype(mx.float32)).astype(np.float64)
    if cap is not None:
        z = np.tanh(z / cap) * cap
    lse = np.log(np.exp(z - z.max(1, keepdims=True)).sum(1)) + z.max(1)
    np.testing.assert_allclose(np.array(got_lse), lse, rtol=1e-6, atol=1e-5)
    np.testing.assert_allclose(np.array(got_lp), z[np.arange(rows), np.array(t)] - lse, rtol=1e-6, atol=1e-5)
    np.testing.assert_allclose(np.array(got_lp), np.array(want_lp), rtol=1e-6, atol=1e-5)
    np.testing.assert_allclose(np.array(got_lse), np.array(want_lse), rtol=1e-6, atol=1e-5)


@cuda
def test_fused_head_with_the_kernel_equals_it_without():
    """The whole fused head (value and gradient) is the same with the kernel tier on or off."""
    v, hidden, m = 3000, 64, 200
    head = LMHead((mx.random.normal((v, hidden), key=mx.random.key(5)) * 0.1).astype(mx.bfloat16))
    h = mx.random.normal((m, hidden), key=mx.random.key(6)).astype(mx.bfloat16)
    t = mx.random.randint(0, v, (m,), key=mx.random.key(7))
    g = mx.random.normal((m,), key=mx.random.key(8))
    outs = [mx.value_and_grad(lambda x: (fused_logp(head, x, t, chunk=48, kernel=k) * g).sum())(h) for k in (True, False)]
    np.testing.assert_allclose(outs[0][0].item(), outs[1][0].item(), rtol=1e-5)
    np.testing.assert_allclose(np.array(outs[0][1].astype(mx.float32)), np.array(outs[1][1].astype(mx.float32)),
                               rtol=1e-2, atol=1e-3)
