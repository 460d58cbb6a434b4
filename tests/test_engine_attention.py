"""Blockwise attention equals mx.fast sdpa and a numpy float64 attention; its analytic backward equals autodiff.

Oracles: the forward against mx.fast.scaled_dot_product_attention and an independent numpy float64 softmax
attention; the gradients against mx.grad through mx.fast sdpa (its unfused fallback under grad) with a
non-uniform cotangent, and against central finite differences; the engine ladder (loss and LoRA gradients
of tiny models) against the trainer's naive path. Float32 on the CPU: the two orders of the same sums
agree to ~1e-6 (measured: <= 1e-6 absolute on outputs and gradients of O(1)).
"""

import mlx.core as mx
import numpy as np
import pytest
from conftest import MATMUL_TOL
from mlx_lm.models import gemma2, llama
from test_engine_ladder import LAM, assert_close, lora_model, naive
from test_engine_stack import prompt_groups, random_pairs

from orpo.device import on_cuda
from orpo.engine.attention import blockwise_attention, causal_blockwise_in
from orpo.engine.objective import pair_value_and_grad, resolve_engine

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


def block_mask(b: int, length: int, seed: int) -> mx.array:
    """A [b, 1, L, L] prefix-sharing-like mask: causal, the second half cannot see a middle span; row 0 of
    batch 1 sees nothing (a padded row)."""
    keep = np.tril(np.ones((length, length), bool))
    keep[length // 2 :, length // 4 : length // 2] = False
    out = np.broadcast_to(keep, (b, 1, length, length)).copy()
    out[1, 0, 0, :] = False
    rng = np.random.default_rng(seed)
    out[0, 0, length - 1, rng.integers(0, length - 1)] = False  # rows differ between batch entries
    return mx.array(out)


# (heads, kv_heads, length, block): GQA and MHA, L not a multiple of the block, block > L, block of 1
GEOMETRIES = {"gqa": (4, 2, 37, 8), "mha": (3, 3, 21, 5), "block_gt_L": (4, 1, 9, 16), "block_1": (2, 1, 6, 1)}
MASKS = ["causal", "none", "block", "additive"]


def make_mask(kind: str, b: int, h: int, length: int):
    if kind == "causal":
        return "causal"
    if kind == "none":
        return None
    if kind == "block":
        return block_mask(b, length, 3)
    rng = np.random.default_rng(4)  # additive, per head, broadcast over the batch
    return mx.array(rng.normal(size=(1, h, length, length)).astype(np.float32))


@pytest.mark.parametrize("geometry", list(GEOMETRIES))
@pytest.mark.parametrize("kind", MASKS)
def test_forward_equals_sdpa_and_numpy(geometry, kind):
    h, kvh, length, block = GEOMETRIES[geometry]
    q, k, v = qkv(2, h, kvh, length, 8, seed=1)
    mask = make_mask(kind, 2, h, length)
    got = blockwise_attention(q, k, v, SCALE, mask, block=block)
    np.testing.assert_allclose(np.array(got), numpy_attention(q, k, v, SCALE, mask), atol=TOL, rtol=0)
    want = np.array(mx.fast.scaled_dot_product_attention(q, k, v, scale=SCALE, mask=mask))
    got = np.array(got)
    if kind == "block":  # mx.fast averages every value on a fully masked row; ours gives 0 (tested below)
        got[1, :, 0], want[1, :, 0] = 0.0, 0.0
    np.testing.assert_allclose(got, want, atol=TOL, rtol=0)


def test_causal_flag_on_an_array_mask_equals_the_anded_mask():
    """causal=True with a non-causal array mask = that mask AND the lower triangle (what the engine relies on)."""
    q, k, v = qkv(2, 4, 2, 19, 8, seed=2)
    rng = np.random.default_rng(5)
    loose = rng.random((2, 1, 19, 19)) > 0.3
    loose[:, :, :, 0] = True  # every row keeps a key
    anded = mx.array(loose & np.tril(np.ones((19, 19), bool)))
    got = blockwise_attention(q, k, v, SCALE, mx.array(loose), block=4, causal=True)
    np.testing.assert_allclose(np.array(got), numpy_attention(q, k, v, SCALE, anded), atol=TOL, rtol=0)


def grads(fn, q, k, v, cot) -> list[np.ndarray]:
    """d sum(cot * fn(q, k, v)) / d(q, k, v)."""
    g = mx.grad(lambda q, k, v: (fn(q, k, v).astype(mx.float32) * cot).sum(), argnums=(0, 1, 2))(q, k, v)
    return [np.array(x.astype(mx.float32)) for x in g]


@pytest.mark.parametrize("geometry", list(GEOMETRIES))
@pytest.mark.parametrize("kind", MASKS)
def test_gradients_equal_autodiff_through_sdpa(geometry, kind):
    h, kvh, length, block = GEOMETRIES[geometry]
    q, k, v = qkv(2, h, kvh, length, 8, seed=6)
    mask = make_mask(kind, 2, h, length)
    cot = mx.array(np.random.default_rng(7).normal(size=q.shape[:3] + (8,)).astype(np.float32))
    ref_mask = mask
    if kind == "block":
        # mx.fast's fully masked row attends to every key: give the reference one key on that row and the
        # row a zero cotangent, so the row contributes nothing to the reference's gradients either.
        m = np.array(mask)
        m[1, 0, 0, 0] = True
        ref_mask = mx.array(m)
        cot[1, :, 0] = 0.0
    want = grads(lambda q, k, v: mx.fast.scaled_dot_product_attention(q, k, v, scale=SCALE, mask=ref_mask), q, k, v, cot)
    got = grads(lambda q, k, v: blockwise_attention(q, k, v, SCALE, mask, block=block), q, k, v, cot)
    for name, g, w in zip("qkv", got, want):
        assert np.abs(w).max() > 0.1, name  # a real gradient
        np.testing.assert_allclose(g, w, atol=TOL, rtol=0, err_msg=name)


def test_fully_masked_row_gives_zero_output_and_zero_gradient():
    q, k, v = qkv(2, 2, 1, 10, 4, seed=8)
    mask = block_mask(2, 10, 9)
    out = blockwise_attention(q, k, v, SCALE, mask, block=3)
    assert np.all(np.array(out)[1, :, 0] == 0)
    dq, dk, dv = grads(lambda q, k, v: blockwise_attention(q, k, v, SCALE, mask, block=3), q, k, v, mx.ones(q.shape))
    assert all(np.isfinite(g).all() for g in (dq, dk, dv))
    assert np.all(dq[1, :, 0] == 0) and np.abs(dq[1, :, 1]).max() > 0


def test_gradients_equal_finite_differences():
    """Every element of q, k, v of a tiny GQA causal case: central differences in float64 inputs."""
    q, k, v = (x.astype(mx.float64) for x in qkv(1, 2, 1, 5, 3, seed=10))
    cot = mx.array(np.random.default_rng(11).normal(size=(1, 2, 5, 3)))

    def loss(q, k, v) -> mx.array:
        with mx.stream(mx.cpu):  # float64 runs on the CPU only
            return (blockwise_attention(q, k, v, SCALE, "causal", block=2) * cot).sum()

    with mx.stream(mx.cpu):
        analytic = mx.grad(loss, argnums=(0, 1, 2))(q, k, v)
    eps = 1e-3
    for i, (x, g) in enumerate(zip((q, k, v), analytic)):
        flat = np.array(x).reshape(-1)
        fd = np.zeros_like(flat)
        for j in range(flat.size):
            args = []
            for sign in (1, -1):
                moved = flat.copy()
                moved[j] += sign * eps
                a = [q, k, v]
                a[i] = mx.array(moved.reshape(x.shape))
                args.append(loss(*a).item())
            fd[j] = (args[0] - args[1]) / (2 * eps)
        # softmax stats are float32 inside: ~1e-7 relative noise / eps, plus O(eps^2) truncation
        np.testing.assert_allclose(np.array(g).reshape(-1), fd, atol=2e-4, rtol=1e-3, err_msg="qkv"[i])


def test_bfloat16_within_tolerance():
    """bf16 inputs: outputs and gradients near the float64 oracle / float32 autodiff (bf16 has 8 mantissa bits)."""
    q, k, v = qkv(2, 4, 2, 40, 16, seed=12, dtype=mx.bfloat16)
    out = blockwise_attention(q, k, v, SCALE, "causal", block=16)
    assert out.dtype == mx.bfloat16
    # Measured 4e-3 max abs (P rounded to bf16 before P V, output rounded to bf16); outputs are O(1).
    np.testing.assert_allclose(np.array(out.astype(mx.float32)), numpy_attention(q, k, v, SCALE, "causal"), atol=3e-2)
    cot = mx.array(np.random.default_rng(13).normal(size=out.shape).astype(np.float32))
    got = grads(lambda q, k, v: blockwise_attention(q, k, v, SCALE, "causal", block=16), q, k, v, cot)
    f32 = [x.astype(mx.float32) for x in (q, k, v)]
    want = grads(lambda q, k, v: mx.fast.scaled_dot_product_attention(q, k, v, scale=SCALE, mask="causal"), *f32, cot)
    for name, g, w in zip("qkv", got, want):
        # relative in norm: bf16 matmul outputs (scores, dP, dS) carry ~2^-8 relative rounding each
        assert np.linalg.norm(g - w) <= 2e-2 * np.linalg.norm(w), (name, np.linalg.norm(g - w) / np.linalg.norm(w))


def test_bad_input_is_refused():
    q, k, v = qkv(1, 3, 2, 4, 2)
    with pytest.raises(ValueError, match="not a multiple"):
        blockwise_attention(q, k, v, SCALE, None)
    q, k, v = qkv(1, 2, 1, 4, 2)
    with pytest.raises(ValueError, match="'sliding'"):
        blockwise_attention(q, k, v, SCALE, "sliding")
    with pytest.raises(ValueError, match="mask head dim 3"):
        blockwise_attention(q, k, v, SCALE, mx.zeros((1, 3, 4, 4)))
    with pytest.raises(ValueError, match=r"broadcastable to \(1, 2, 4, 4\)"):
        blockwise_attention(q, k, v, SCALE, mx.zeros((1, 1, 3, 4)))
    with pytest.raises(ValueError, match="train.engine.attention"):
        resolve_engine({"attention": "flash"})


def test_saved_activations_do_not_grow_with_the_score_matrix():
    """Four chained attention layers under grad: the mx.fast fallback keeps [B, H, L, L] per layer, ours doesn't."""
    q, k, v = qkv(1, 4, 4, 512, 16, seed=14)
    mx.eval(q, k, v)
    scores = 4 * 512 * 512 * 4  # one layer's [H, L, L] float32 scores, bytes

    def peak(attend) -> int:
        def loss(q):
            for _ in range(4):
                q = attend(q, k, v)
            return q.sum()

        mx.eval(mx.grad(loss)(q))  # warm-up: compilation, allocator
        mx.clear_cache()
        mx.reset_peak_memory()
        base = mx.get_active_memory()
        mx.eval(mx.grad(loss)(q))
        return mx.get_peak_memory() - base

    fallback = peak(lambda q, k, v: mx.fast.scaled_dot_product_attention(q, k, v, scale=SCALE, mask="causal"))
    ours = peak(lambda q, k, v: blockwise_attention(q, k, v, SCALE, "causal", block=64))
    assert fallback > 4 * scores  # the reference really holds every layer's scores
    assert ours < 1.5 * scores, (ours / scores, fallback / scores)


def test_one_layer_backward_holds_a_few_blocks_not_the_score_matrix():
    """16 query blocks: the backward's blocks are chained, so its peak is a few [block, L] blocks (measured ~6.5;
    left unchained, MLX computed every block's dS before the dK/dV sums and the peak was the full matrix)."""
    q, k, v = qkv(1, 2, 1, 2048, 16, seed=16)
    mx.eval(q, k, v)
    loss = lambda q, k, v: blockwise_attention(q, k, v, SCALE, "causal", block=128).sum()
    mx.eval(mx.grad(loss, argnums=(0, 1, 2))(q, k, v))
    mx.clear_cache()
    mx.reset_peak_memory()
    base = mx.get_active_memory()
    mx.eval(mx.grad(loss, argnums=(0, 1, 2))(q, k, v))
    block = 2 * 128 * 2048 * 4  # one block's [H, block, L] float32 scores, bytes
    assert mx.get_peak_memory() - base < 10 * block  # the full [H, L, L] matrix is 16 blocks


def test_swap_is_scoped_and_restored():
    original = llama.scaled_dot_product_attention
    with causal_blockwise_in(["mlx_lm.models.llama", "mlx_lm.models.gemma2"], block=4):
        assert llama.scaled_dot_product_attention is not original
        assert not hasattr(gemma2, "scaled_dot_product_attention")  # its own softcapped attention, left alone
        q, k, v = qkv(1, 2, 1, 7, 4, seed=15)
        got = llama.scaled_dot_product_attention(q, k, v, cache=None, scale=SCALE, mask="causal")
        want = mx.fast.scaled_dot_product_attention(q, k, v, scale=SCALE, mask="causal")
        np.testing.assert_allclose(np.array(got), np.array(want), atol=TOL)
    assert llama.scaled_dot_product_attention is original
    with pytest.raises(RuntimeError, match="boom"), causal_blockwise_in(["mlx_lm.models.llama"]):
        raise RuntimeError("boom")
    assert llama.scaled_dot_product_attention is original


BLOCKWISE = {"head": "naive", "segment_layers": 0, "prefix_sharing": False, "attention": "blockwise",
             "attention_block": 4}
ALL_AND_BLOCKWISE = {"head": "fused", "head_chunk": 7, "segment_layers": 2, "prefix_sharing": True,
                     "attention": "blockwise", "attention_block": 4}


@pytest.mark.parametrize("family", ["llama", "qwen3", "llama_sliding", "gemma3_text"])
@pytest.mark.parametrize("engine", [BLOCKWISE, ALL_AND_BLOCKWISE], ids=["blockwise", "all+blockwise"])
def test_engine_ladder_with_blockwise_attention(family, engine):
    """Loss and LoRA gradients equal the trainer's naive path (block 4 < rows of ~10-30 tokens: many blocks)."""
    model, _ = lora_model(family)
    pairs = random_pairs(1, 3)
    original = llama.scaled_dot_product_attention
    got = pair_value_and_grad(model, pairs, LAM, engine)
    assert llama.scaled_dot_product_attention is original  # restored after the step
    assert_close(got, naive(model, pairs))


def exclusion_case(b: int, length: int, seed: int) -> tuple[mx.array, mx.array, np.ndarray]:
    """Per-row query flags and excluded keys like prefix rows (rows differ), and the boolean mask they mean."""
    rng = np.random.default_rng(seed)
    flagged, excluded = np.zeros((b, length), bool), np.zeros((b, length), bool)
    for r in range(b):
        shared, start = sorted(rng.choice(np.arange(1, length - 1), 2, replace=False))
        flagged[r, start:], excluded[r, shared:start] = True, True
    keep = np.tril(np.ones((length, length), bool))[None] & ~(flagged[:, :, None] & excluded[:, None, :])
    return mx.array(flagged), mx.array(excluded), keep[:, None]


def packed_sdpa():
    """mlx-lm's sdpa as the engine's swap wraps it for packed rows (ExclusionMask, SplitRows)."""
    from orpo.engine.attention import _packed_sdpa

    return _packed_sdpa(lambda q, k, v, cache, scale, mask, sinks: mx.fast.scaled_dot_product_attention(
        q, k, v, scale=scale, mask=mask))


def exclusion_attention(q, k, v, flagged, excluded):
    """mlx-lm's sdpa as the engine's swap runs it with an ExclusionMask."""
    from orpo.engine.attention import exclusion_mask

    sdpa = packed_sdpa()
    return sdpa(q, k, v, None, SCALE, exclusion_mask(flagged, excluded, q.dtype))


@pytest.mark.parametrize("geometry", ["gqa", "mha"])
def test_exclusion_mask_equals_the_block_mask(geometry):
    """One causal attention with the exclusion dims = numpy's attention under the boolean block mask; its
    gradients = autodiff through mx.fast sdpa under that mask (the extra dims' gradient never reaches q, k)."""
    h, kvh, length, _ = GEOMETRIES[geometry]
    q, k, v = qkv(3, h, kvh, length, 8, seed=21)
    flagged, excluded, keep = exclusion_case(3, length, 22)
    assert (~keep).sum() > np.triu(np.ones((length, length)), 1).sum() * 3  # something beyond causality is hidden
    got = exclusion_attention(q, k, v, flagged, excluded)
    assert got.shape == q.shape
    np.testing.assert_allclose(np.array(got), numpy_attention(q, k, v, SCALE, mx.array(keep)), atol=TOL, rtol=0)
    cot = mx.array(np.random.default_rng(23).normal(size=q.shape).astype(np.float32))
    want = grads(lambda q, k, v: mx.fast.scaled_dot_product_attention(q, k, v, scale=SCALE, mask=mx.array(keep)),
                 q, k, v, cot)
    got = grads(lambda q, k, v: exclusion_attention(q, k, v, flagged, excluded), q, k, v, cot)
    for name, g, w in zip("qkv", got, want):
        assert np.abs(w).max() > 0.1, name
        np.testing.assert_allclose(g, w, atol=TOL, rtol=0, err_msg=name)
    # Control: without the exclusion it is plain causal attention, which differs.
    assert np.abs(numpy_attention(q, k, v, SCALE, "causal") - numpy_attention(q, k, v, SCALE, mx.array(keep))).max() > 0.1


@pytest.mark.parametrize("dtype", [mx.bfloat16, mx.float16])
def test_exclusion_mask_in_half_precision(dtype):
    """The penalty (-131072 on the raw score) is exact in bf16/fp16 and hides the keys completely: the output
    equals the masked sdpa's in the same dtype to its rounding, far from the unmasked one."""
    q, k, v = qkv(2, 4, 2, 48, 16, seed=24, dtype=dtype)
    flagged, excluded, keep = exclusion_case(2, 48, 25)
    got = np.array(exclusion_attention(q, k, v, flagged, excluded).astype(mx.float32))
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
    h, kvh, length, _ = GEOMETRIES[geometry]
    start = length // 2 + 1
    split, keep = split_case(prompts, start, length, align)
    q, k, v = qkv(len(prompts), h, kvh, length, 8, seed=26)
    sdpa = packed_sdpa()
    attend = lambda q, k, v: sdpa(q, k, v, None, SCALE, split)
    got = attend(q, k, v)
    assert got.shape == q.shape
    np.testing.assert_allclose(np.array(got), numpy_attention(q, k, v, SCALE, mx.array(keep)), atol=TOL, rtol=0)
    cot = mx.array(np.random.default_rng(27).normal(size=q.shape).astype(np.float32))
    want = grads(lambda q, k, v: mx.fast.scaled_dot_product_attention(q, k, v, scale=SCALE, mask=mx.array(keep)),
                 q, k, v, cot)
    for name, g, w in zip("qkv", grads(attend, q, k, v, cot), want):
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
    got = np.array(packed_sdpa()(q, k, v, None, SCALE, split).astype(mx.float32))
    want = numpy_attention(q, k, v, SCALE, mx.array(keep))
    np.testing.assert_allclose(got, want, atol=3e-2, rtol=0)  # the same bound as the exclusion's
    assert np.abs(numpy_attention(q, k, v, SCALE, "causal") - want).max() > 0.1


@pytest.mark.skipif(not on_cuda(), reason="cuDNN's attention runs on a CUDA GPU only")
def test_split_rows_through_cudnn_equal_float32_attention():
    """On CUDA, bf16 at widths of 128 (cuDNN's forward and backward), prompts of their own lengths (no multiple
    of 128: the aligned second attention) equal float32 attention under the block mask, gradients included."""
    from orpo.engine.attention import _packed_sdpa

    prompts, start, length = [300, 300, 517, 0], 768, 1024
    split, keep = split_case(prompts, start, length, 128)
    q, k, v = qkv(len(prompts), 8, 2, length, 64, seed=29)
    cot = mx.array(np.random.default_rng(30).normal(size=q.shape).astype(np.float32))
    fast = _packed_sdpa(lambda q, k, v, cache, scale, mask, sinks: mx.fast.scaled_dot_product_attention(
        q, k, v, scale=scale, mask=mask))
    bf16 = [x.astype(mx.bfloat16) for x in (q, k, v)]
    got = grads(lambda q, k, v: fast(q, k, v, None, SCALE, split).astype(mx.float32), *bf16, cot)
    out = np.array(fast(*bf16, None, SCALE, split).astype(mx.float32))
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
