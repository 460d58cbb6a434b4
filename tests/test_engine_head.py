"""The fused (flash-CCE) log-prob head against float64 numpy, autograd through the naive head, finite
differences, mlx-lm's own model outputs, and its memory bound."""

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx.utils import tree_flatten
from mlx_lm.utils import _get_classes, load_model, quantize_model

from orpo.engine.head import (AUTO_BLOCK_LOGITS, LMHead, _fused, chunk_for, fused_logp, fused_logp_eager, head_logits,
                              lm_head_of)
from orpo.train.data import load_pairs, pair_batch

from conftest import MATMUL_TOL, ON_GPU
from test_train_models import COMMON, FAMILIES

V, H = 257, 24  # a vocabulary that no chunk or quantization group divides evenly


def f64(a: mx.array) -> np.ndarray:
    return np.array(a.astype(mx.float32), dtype=np.float64)


def ref_logp(h: np.ndarray, w: np.ndarray, targets: np.ndarray, cap: float | None = None, bias=None) -> np.ndarray:
    """float64 log softmax(softcap(h W^T + b))[target]: the independent reference."""
    z = h @ w.T + (0 if bias is None else bias)
    if cap is not None:
        z = cap * np.tanh(z / cap)
    m = z.max(-1, keepdims=True)
    lse = (m + np.log(np.exp(z - m).sum(-1, keepdims=True)))[:, 0]
    return z[np.arange(len(targets)), targets] - lse


def naive_logp(head: LMHead, h: mx.array, targets: mx.array) -> mx.array:
    """The naive path: full logits from head_logits, then float32 log-softmax gathered (autograd's oracle)."""
    z = head_logits(head, h).astype(mx.float32)
    return mx.take_along_axis(z, targets[:, None], axis=-1)[:, 0] - mx.logsumexp(z, axis=-1)


def case(m: int, seed: int = 0, scale: float = 0.5) -> tuple[mx.array, mx.array, mx.array, mx.array]:
    """Random weight [V, H], hidden [m, H], targets [m] and a non-uniform cotangent (both signs) [m]."""
    k = mx.random.split(mx.random.key(seed), 4)
    w = mx.random.normal((V, H), key=k[0]) * scale
    h = mx.random.normal((m, H), key=k[1])
    t = mx.random.randint(0, V, (m,), key=k[2])
    g = mx.random.normal((m,), key=k[3])
    return w, h, t, g


def grad_of(fn, head: LMHead, h: mx.array, t: mx.array, g: mx.array) -> mx.array:
    return mx.grad(lambda x: (fn(head, x, t) * g).sum())(h)


# float32 throughout: logsumexp of O(10) logits and a 24-term dot product agree with float64 to ~1e-6.
FWD_TOL = 10 * MATMUL_TOL
GRAD_TOL = 10 * MATMUL_TOL


@pytest.mark.parametrize("cap", [None, 3.0])
@pytest.mark.parametrize("m, chunk", [(37, 8), (37, 1), (37, 37), (37, 64), (40, 8)])
def test_forward_matches_float64_reference(m, chunk, cap):
    """Chunks that divide M, that don't, of one token, of exactly M and larger than M; with and without a softcap."""
    w, h, t, _ = case(m)
    head = LMHead(w, softcap=cap)
    got = fused_logp(head, h, t, chunk=chunk)
    assert got.dtype == mx.float32 and got.shape == (m,)
    np.testing.assert_allclose(np.array(got), ref_logp(f64(h), f64(w), np.array(t), cap), rtol=FWD_TOL, atol=FWD_TOL)


@pytest.mark.parametrize("cap", [None, 3.0])
@pytest.mark.parametrize("m, chunk", [(37, 8), (37, 37), (37, 64)])
def test_gradient_matches_autograd_through_the_naive_head(m, chunk, cap):
    w, h, t, g = case(m, seed=1)
    head = LMHead(w, softcap=cap)
    fused = grad_of(lambda hd, x, tt: fused_logp(hd, x, tt, chunk=chunk), head, h, t, g)
    naive = grad_of(naive_logp, head, h, t, g)
    assert fused.dtype == h.dtype and fused.shape == h.shape
    np.testing.assert_allclose(np.array(fused), np.array(naive), rtol=GRAD_TOL, atol=GRAD_TOL)
    assert np.abs(np.array(naive)).max() > 0.1  # a real gradient, not two zeros


@pytest.mark.parametrize("cap", [None, 2.0])
def test_gradient_matches_float64_finite_differences(cap):
    """Central differences of the float64 reference, step 1e-6 (truncation and rounding ~1e-9)."""
    w, h, t, g = case(6, seed=2, scale=1.0)
    head = LMHead(w, softcap=cap)
    got = np.array(grad_of(lambda hd, x, tt: fused_logp(hd, x, tt, chunk=4), head, h, t, g))
    h64, w64, t64, g64 = f64(h), f64(w), np.array(t), f64(g)
    fd, step = np.zeros_like(h64), 1e-6
    for idx in np.ndindex(*h64.shape):
        up, down = h64.copy(), h64.copy()
        up[idx] += step
        down[idx] -= step
        fd[idx] = (g64 @ ref_logp(up, w64, t64, cap) - g64 @ ref_logp(down, w64, t64, cap)) / (2 * step)
    np.testing.assert_allclose(got, fd, rtol=1e-4, atol=1e-5)
    assert np.abs(fd).max() > 0.1


def test_logsumexp_output_has_its_own_exact_vjp():
    """The internal (logp, lse) function: a loss on both outputs gets d lse/dz = softmax right too."""
    w, h, t, g = case(21, seed=3)
    a = mx.random.normal((21,), key=mx.random.key(9))
    head = LMHead(w, softcap=4.0)

    def fused(x):
        logp, lse = _fused(head, 8)(x, t)
        return (g * logp + a * lse).sum()

    def naive(x):
        z = head_logits(head, x)
        lse = mx.logsumexp(z, axis=-1)
        return (g * (mx.take_along_axis(z, t[:, None], axis=-1)[:, 0] - lse) + a * lse).sum()

    np.testing.assert_allclose(np.array(mx.grad(fused)(h)), np.array(mx.grad(naive)(h)), rtol=GRAD_TOL, atol=GRAD_TOL)


def quantized_heads() -> dict[str, tuple[LMHead, np.ndarray, np.ndarray | None]]:
    """4-bit heads, each with its dequantized float64 weight (and bias): tied embedding, lm_head, lm_head + bias."""
    mx.random.seed(4)
    emb = nn.QuantizedEmbedding.from_embedding(nn.Embedding(V, 64), group_size=32, bits=4)
    lin = nn.QuantizedLinear.from_linear(nn.Linear(64, V, bias=False), group_size=32, bits=4)
    lin_b = nn.QuantizedLinear.from_linear(nn.Linear(64, V, bias=True), group_size=32, bits=4)
    out = {}
    for name, layer in (("tied", emb), ("lm_head", lin), ("lm_head_bias", lin_b)):
        head = LMHead(layer.weight, layer.scales, layer.biases, layer.group_size, layer.bits,
                      bias=layer.get("bias"))
        w = mx.dequantize(layer.weight, layer.scales, layer.biases, layer.group_size, layer.bits)
        out[name] = (head, f64(w), None if "bias" not in layer else f64(layer.bias))
    return out


@pytest.mark.parametrize("name", ["tied", "lm_head", "lm_head_bias"])
def test_quantized_head_forward_and_gradient(name):
    head, w64, b64 = quantized_heads()[name]
    assert head.quantized and head.hidden_size == 64
    k = mx.random.split(mx.random.key(5), 3)
    h, t, g = mx.random.normal((29, 64), key=k[0]), mx.random.randint(0, V, (29,), key=k[1]), mx.random.normal((29,), key=k[2])
    got = fused_logp(head, h, t, chunk=8)
    np.testing.assert_allclose(np.array(got), ref_logp(f64(h), w64, np.array(t), bias=b64), rtol=FWD_TOL, atol=FWD_TOL)
    np.testing.assert_allclose(np.array(head_logits(head, h)), f64(h) @ w64.T + (0 if b64 is None else b64),
                               rtol=FWD_TOL, atol=FWD_TOL)
    fused = grad_of(lambda hd, x, tt: fused_logp(hd, x, tt, chunk=8), head, h, t, g)
    naive = grad_of(naive_logp, head, h, t, g)
    np.testing.assert_allclose(np.array(fused), np.array(naive), rtol=GRAD_TOL, atol=GRAD_TOL)


def test_float_head_with_bias():
    w, h, t, g = case(19, seed=6)
    b = mx.random.normal((V,), key=mx.random.key(7))
    head = LMHead(w, bias=b)
    np.testing.assert_allclose(np.array(fused_logp(head, h, t, chunk=5)), ref_logp(f64(h), f64(w), np.array(t), bias=f64(b)),
                               rtol=FWD_TOL, atol=FWD_TOL)
    np.testing.assert_allclose(np.array(grad_of(lambda hd, x, tt: fused_logp(hd, x, tt, chunk=5), head, h, t, g)),
                               np.array(grad_of(naive_logp, head, h, t, g)), rtol=GRAD_TOL, atol=GRAD_TOL)


@pytest.mark.parametrize("cap", [None, 3.0])
def test_bf16_hidden_state_with_a_float32_head(cap):
    """bf16 h promotes to a float32 matmul (as the model's own layer does): float32 accuracy on the rounded h."""
    w, h, t, g = case(33, seed=8)
    hb = h.astype(mx.bfloat16)
    head = LMHead(w, softcap=cap)
    got = fused_logp(head, hb, t, chunk=8)
    assert got.dtype == mx.float32
    np.testing.assert_allclose(np.array(got), ref_logp(f64(hb), f64(w), np.array(t), cap), rtol=FWD_TOL, atol=FWD_TOL)
    dh = grad_of(lambda hd, x, tt: fused_logp(hd, x, tt, chunk=8), head, hb, t, g)
    assert dh.dtype == mx.bfloat16
    naive = grad_of(naive_logp, head, hb, t, g)
    np.testing.assert_allclose(f64(dh), f64(naive), rtol=2**-7, atol=2**-7 * float(mx.abs(naive).max()))


def test_bf16_head_and_hidden_state():
    """A bf16 model: logits come out of the matmul in bf16 (as in model(...)), so logp carries their rounding.

    Bound: each logit is rounded to 8 significant bits (relative error <= 2^-9), so |logp error| <=
    2 * max|z| * 2^-9 against float64; the naive path rounds the same logits, so it agrees far closer.
    """
    w, h, t, g = case(33, seed=10)
    wb, hb = w.astype(mx.bfloat16), h.astype(mx.bfloat16)
    head = LMHead(wb)
    got = np.array(fused_logp(head, hb, t, chunk=8))
    z = f64(hb) @ f64(wb).T
    np.testing.assert_allclose(got, ref_logp(f64(hb), f64(wb), np.array(t)), rtol=0, atol=2 * np.abs(z).max() * 2**-9)
    np.testing.assert_allclose(got, np.array(naive_logp(head, hb, t)), rtol=FWD_TOL, atol=FWD_TOL)
    dh = grad_of(lambda hd, x, tt: fused_logp(hd, x, tt, chunk=8), head, hb, t, g)
    naive = grad_of(naive_logp, head, hb, t, g)
    assert dh.dtype == mx.bfloat16
    # both round dz to bf16 before the same bf16 matmul: at most a couple of bf16 ulps apart
    np.testing.assert_allclose(f64(dh), f64(naive), rtol=2**-6, atol=2**-7 * float(mx.abs(naive).max()))


def test_leading_dims_flatten_and_bad_input_is_named():
    w, h, t, _ = case(12, seed=11)
    head = LMHead(w)
    flat = fused_logp(head, h, t, chunk=5)
    np.testing.assert_array_equal(np.array(fused_logp(head, h.reshape(3, 4, H), t.reshape(3, 4), chunk=5)),
                                  np.array(flat).reshape(3, 4))
    assert fused_logp(head, h[:0], t[:0]).shape == (0,)
    with pytest.raises(ValueError, match="hidden size"):
        fused_logp(head, h[:, :-1], t)
    with pytest.raises(ValueError, match="targets has shape"):
        fused_logp(head, h, t[:-1])
    with pytest.raises(ValueError, match="targets int"):
        fused_logp(head, h, t.astype(mx.float32))
    with pytest.raises(ValueError, match="chunk"):
        fused_logp(head, h, t, chunk=-1)  # 0 is auto (chunk_for)


# --- a trainable head: the weight's (and bias's) gradient too ---


def ref_grads(h, w, targets, g, cap=None, bias=None):
    """float64 (d/dh, d/dW, d/db) of sum_i g_i log softmax(softcap(h W^T + b))_i[t_i]: the independent reference."""
    x = h @ w.T + (0 if bias is None else bias)
    z = x if cap is None else cap * np.tanh(x / cap)
    p = np.exp(z - z.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    onehot = np.zeros_like(z)
    onehot[np.arange(len(targets)), targets] = 1.0
    dx = g[:, None] * (onehot - p)
    if cap is not None:
        dx *= 1.0 - np.tanh(x / cap) ** 2
    return dx @ w, dx.T @ h, dx.sum(0)


def trainable_grads(w, h, t, g, cap=None, b=None, chunk=8):
    """mx.grad of sum(g * fused_logp) with respect to (h, W[, b]) through the trainable head's custom vjp."""

    def loss(h, w, *bias):
        head = LMHead(w, softcap=cap, bias=bias[0] if bias else None, trainable=True)
        return (fused_logp(head, h, t, chunk=chunk) * g).sum()

    args = (h, w) if b is None else (h, w, b)
    return mx.grad(loss, argnums=list(range(len(args))))(*args)


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("cap", [None, 3.0])
@pytest.mark.parametrize("m, chunk", [(37, 8), (37, 37), (37, 64), (40, 1)])
def test_trainable_head_gradients_match_float64_reference(m, chunk, cap, bias):
    """d loss/dh, d loss/dW (accumulated over the chunks in float32) and d loss/db against float64 numpy."""
    w, h, t, g = case(m, seed=21)
    b = mx.random.normal((V,), key=mx.random.key(22)) * 0.3 if bias else None
    got = trainable_grads(w, h, t, g, cap, b, chunk)
    want = ref_grads(f64(h), f64(w), np.array(t), f64(g), cap, None if b is None else f64(b))
    assert got[1].dtype == w.dtype and got[1].shape == w.shape
    for name, a, e in zip(("dh", "dW", "db"), got, want):
        np.testing.assert_allclose(f64(a), e, rtol=GRAD_TOL, atol=GRAD_TOL * np.abs(e).max(), err_msg=name)
        assert np.abs(e).max() > 0.1, name  # a real gradient, not two zeros
    # The forward is the frozen head's, bit for bit.
    trainable = fused_logp(LMHead(w, softcap=cap, bias=b, trainable=True), h, t, chunk=chunk)
    assert np.array_equal(np.array(trainable), np.array(fused_logp(LMHead(w, softcap=cap, bias=b), h, t, chunk=chunk)))


def test_trainable_head_gradient_matches_float64_finite_differences():
    """dW by central differences of the float64 reference forward (step 1e-6), a few entries of each kind."""
    w, h, t, g = case(6, seed=23, scale=1.0)
    _, dw = trainable_grads(w, h, t, g, cap=2.0, chunk=4)
    h64, w64, t64, g64 = f64(h), f64(w), np.array(t), f64(g)
    rows = sorted(set(np.array(t).tolist()))[:3] + [0, V - 1]  # target rows get the onehot term
    for r in rows:
        for c in (0, H // 2, H - 1):
            up, down = w64.copy(), w64.copy()
            up[r, c] += 1e-6
            down[r, c] -= 1e-6
            fd = (g64 @ ref_logp(h64, up, t64, 2.0) - g64 @ ref_logp(h64, down, t64, 2.0)) / 2e-6
            assert float(dw[r, c].item()) == pytest.approx(fd, rel=1e-4, abs=1e-6), (r, c)


def test_trainable_head_in_bfloat16():
    """A bf16 model's head: dW accumulated in float32, rounded to bf16 once at the end, so within a couple
    of bf16 ulps of float64 (on the bf16-rounded inputs), as the naive head's autodiff is."""
    w, h, t, g = case(65, seed=24)
    wb, hb = w.astype(mx.bfloat16), h.astype(mx.bfloat16)
    dh, dw = trainable_grads(wb, hb, t, g, chunk=16)
    assert dh.dtype == dw.dtype == mx.bfloat16
    want_dh, want_dw, _ = ref_grads(f64(hb), f64(wb), np.array(t), f64(g))
    # The logits come out of a bf16 matmul (as the model's own layer computes them): softmax carries 2^-8.
    scale = np.abs(want_dw).max()
    np.testing.assert_allclose(f64(dw), want_dw, rtol=2**-6, atol=2**-6 * scale)
    np.testing.assert_allclose(f64(dh), want_dh, rtol=2**-6, atol=2**-6 * np.abs(want_dh).max())
    naive = mx.grad(lambda w: (naive_logp(LMHead(w), hb, t) * g).sum())(wb)
    np.testing.assert_allclose(f64(dw), f64(naive), rtol=2**-6, atol=2**-7 * scale)


def test_eager_trainable_head_equals_the_lazy_one():
    """The segmented path's head gives the same dh, dW and db as the custom vjp, bit for bit."""
    w, h, t, g = case(45, seed=25)
    b = mx.random.normal((V,), key=mx.random.key(26))
    head = LMHead(w, bias=b, softcap=5.0, trainable=True)
    lazy = trainable_grads(w, h, t, g, 5.0, b, chunk=8)
    logp, grad_fn = fused_logp_eager(head, h, t, 8)
    eager = grad_fn(g)
    assert np.array_equal(np.array(logp), np.array(fused_logp(head, h, t, chunk=8)))
    assert set(eager.by_name(head)) == {"lm_head.weight", "lm_head.bias"}
    for a, e in zip(lazy, (eager.hidden, eager.weight, eager.bias)):
        assert np.array_equal(np.array(a), np.array(e))
    frozen = fused_logp_eager(LMHead(w, bias=b, softcap=5.0), h, t, 8)[1](g)
    assert frozen.weight is None and frozen.by_name(head) == {}
    assert np.array_equal(np.array(frozen.hidden), np.array(eager.hidden))


def test_tied_embedding_gets_the_gradient_of_both_uses():
    """A tied llama, every weight trainable: through the fused head, d loss/d embed_tokens.weight is the sum of
    the lookup's and the head's parts (each non-zero), and equals the naive head's autodiff through model(x)."""
    model = tiny_model(MODELS["llama_tied"])
    model.unfreeze()
    tokens = mx.random.randint(0, COMMON["vocab_size"], (2, 9), key=mx.random.key(27))
    t = tokens[:, 1:].reshape(-1)
    g = mx.random.normal(t.shape, key=mx.random.key(28))

    def fused(m, hidden_gradient=True, head_gradient=True):
        h = m.model(tokens[:, :-1]).reshape(-1, COMMON["hidden_size"])
        head = lm_head_of(m)
        if not head_gradient:
            head = LMHead(mx.stop_gradient(head.weight))
        h = h if hidden_gradient else mx.stop_gradient(h)
        return (fused_logp(head, h, t, chunk=5) * g).sum()

    def naive(m):
        z = m(tokens[:, :-1]).reshape(-1, COMMON["vocab_size"])
        return ((mx.take_along_axis(z, t[:, None], axis=-1)[:, 0] - mx.logsumexp(z, axis=-1)) * g).sum()

    def embed_grad(fn, **kw):
        return np.array(dict(tree_flatten(nn.value_and_grad(model, lambda m: fn(m, **kw))(model)[1]))
                        ["model.embed_tokens.weight"])

    both, want = embed_grad(fused), embed_grad(naive)
    head_part, lookup_part = embed_grad(fused, hidden_gradient=False), embed_grad(fused, head_gradient=False)
    assert np.linalg.norm(head_part) > 0.1 * np.linalg.norm(both) and np.linalg.norm(lookup_part) > 0.1 * np.linalg.norm(both)
    np.testing.assert_allclose(both, head_part + lookup_part, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(both, want, rtol=1e-4, atol=1e-5 + 10 * MATMUL_TOL)


# --- the model's own head: lm_head_of + head_logits == model(tokens) ---

MODELS = {
    "llama_tied": {**FAMILIES["llama"]},
    "llama_untied": {**FAMILIES["llama"], "tie_word_embeddings": False},
    "qwen2": {**FAMILIES["qwen2"]},
    "gemma": {**FAMILIES["gemma"]},
    "gemma2": {**FAMILIES["gemma2"], "final_logit_softcapping": 5.0},  # a tight cap: most logits feel it
    "gemma3_text_untied": {**FAMILIES["gemma3_text"]},  # keeps its lm_head (no sanitize tying here)
}


def tiny_model(overrides: dict, quantize: bool = False) -> nn.Module:
    config = {**COMMON, **overrides}
    model_class, args_class = _get_classes(config)
    mx.random.seed(0)
    model = model_class(args_class.from_dict(config))
    if quantize:
        model, _ = quantize_model(model, config, group_size=32, bits=4)
    model.freeze()
    mx.eval(model.parameters())
    return model


MODEL_CASES = [(name, False) for name in MODELS] + [("llama_tied", True), ("llama_untied", True)]


@pytest.mark.parametrize("name, quantize", MODEL_CASES, ids=[f"{n}{'_q4' if q else ''}" for n, q in MODEL_CASES])
def test_head_of_reproduces_the_model_and_fused_agrees(name, quantize):
    """head_logits(lm_head_of(model), model.model(x)) is bit-identical to model(x); fused logp matches its log-softmax."""
    model = tiny_model(MODELS[name], quantize)
    head = lm_head_of(model)
    tied = "lm_head" not in model or getattr(model, "tie_word_embeddings", False)
    assert head.quantized == quantize
    assert (head.softcap == 5.0) if name == "gemma2" else head.softcap is None
    assert tied == (name in ("llama_tied", "qwen2", "gemma", "gemma2"))
    tokens = mx.random.randint(0, COMMON["vocab_size"], (2, 11), key=mx.random.key(12))
    h = model.model(tokens)
    logits = model(tokens)
    np.testing.assert_array_equal(np.array(head_logits(head, h)), np.array(logits))
    z = logits.astype(mx.float32).reshape(-1, logits.shape[-1])
    t = mx.roll(tokens, -1, axis=1).reshape(-1)
    want = mx.take_along_axis(z, t[:, None], axis=-1)[:, 0] - mx.logsumexp(z, axis=-1)
    got = fused_logp(head, h.reshape(-1, h.shape[-1]), t, chunk=7)
    np.testing.assert_allclose(np.array(got), np.array(want), rtol=FWD_TOL, atol=FWD_TOL)


def test_fused_parameter_gradients_equal_the_naive_heads():
    """Through a whole tiny llama (layers trainable, head frozen): every parameter gradient agrees."""
    model = tiny_model(MODELS["llama_untied"])
    for layer in model.model.layers:
        layer.unfreeze()
    head = lm_head_of(model)
    tokens = mx.random.randint(0, COMMON["vocab_size"], (2, 9), key=mx.random.key(13))
    t = tokens[:, 1:].reshape(-1)
    g = mx.random.normal(t.shape, key=mx.random.key(14))

    def fused(m):
        h = m.model(tokens[:, :-1])
        return (fused_logp(head, h.reshape(-1, h.shape[-1]), t, chunk=5) * g).sum()

    def naive(m):
        z = m(tokens[:, :-1]).reshape(-1, COMMON["vocab_size"])
        return ((mx.take_along_axis(z, t[:, None], axis=-1)[:, 0] - mx.logsumexp(z, axis=-1)) * g).sum()

    got = dict(tree_flatten(nn.value_and_grad(model, fused)(model)[1]))
    want = dict(tree_flatten(nn.value_and_grad(model, naive)(model)[1]))
    assert got.keys() == want.keys() and any(k.startswith("model.layers.") for k in got)
    for k, v in want.items():
        np.testing.assert_allclose(np.array(got[k]), np.array(v), rtol=1e-4, atol=1e-5 + 10 * MATMUL_TOL, err_msg=k)


def test_head_of_marks_a_trainable_head_and_refuses_what_it_cannot_train():
    """A trainable float head (full-parameter training) is marked trainable with its path; a head adapted by
    LoRA, a quantized head left trainable, or a head whose bias trains without its weight is an error."""
    model = tiny_model(MODELS["llama_untied"])
    assert not lm_head_of(model).trainable
    model.lm_head.unfreeze()
    head = lm_head_of(model)
    assert head.trainable and head.path == "lm_head"
    tied = tiny_model(MODELS["llama_tied"])
    tied.model.embed_tokens.unfreeze()
    head = lm_head_of(tied)
    assert head.trainable and head.path == "model.embed_tokens"
    from mlx_lm.tuner.lora import LoRALinear

    adapted = tiny_model(MODELS["llama_untied"])
    adapted.lm_head = LoRALinear.from_base(adapted.lm_head, r=4)
    with pytest.raises(ValueError, match="lm_head is a LoRALinear"):
        lm_head_of(adapted)
    quantized = tiny_model(MODELS["llama_untied"], quantize=True)
    quantized.lm_head.unfreeze()
    with pytest.raises(ValueError, match="lm_head has trainable parameters .*a quantized head cannot be trained"):
        lm_head_of(quantized)
    biased = tiny_model({**MODELS["llama_untied"]})
    biased.lm_head = nn.Linear(COMMON["hidden_size"], COMMON["vocab_size"], bias=True)
    biased.lm_head.freeze(keys=["weight"])
    with pytest.raises(ValueError, match=r"lm_head: trainable \['bias'\] but not \['weight'\]"):
        lm_head_of(biased)


def test_head_of_refuses_a_family_that_scales_its_logits():
    cohere = tiny_model({"model_type": "cohere", "layer_norm_eps": 1e-5, "logit_scale": 0.0625})
    assert "lm_head" not in cohere  # tied, yet model(x) != head(h): it multiplies by logit_scale
    with pytest.raises(ValueError, match="logit_scale"):
        lm_head_of(cohere)


# --- on a real trained model ---


def test_fused_gradient_equals_the_naive_on_the_trained_tiny_model(tiny_base, tiny_rendered):
    """The embedded trained model and real rendered pairs (8 pairs = 16 rows, the ORPO mean-logp cotangent):
    the fused head's dh equals the naive head's."""
    model, _ = load_model(tiny_base)
    model.freeze()
    head = lm_head_of(model)
    tokens, mask = pair_batch(load_pairs(tiny_rendered / "train.parquet"), list(range(8)))
    h = model.model(tokens[:, :-1]).reshape(-1, head.hidden_size)
    t = tokens[:, 1:].reshape(-1)
    scored = mask[:, 1:].astype(mx.float32)
    g = (scored / scored.sum(axis=1, keepdims=True)).reshape(-1)  # d(mean response logp)/d(token logp)
    mx.eval(h, t, g)
    exact = np.array(mx.grad(lambda x: (fused_logp(head, x, t, chunk=64) * g).sum())(h))
    np.testing.assert_allclose(exact, np.array(mx.grad(lambda x: (naive_logp(head, x, t) * g).sum())(h)),
                               rtol=GRAD_TOL, atol=GRAD_TOL)


# --- memory: the fused backward's peak does not grow with the token count ---


def peak_bytes(fn, *args) -> int:
    """Peak MLX memory above what was allocated before, for one evaluation (after a warm-up)."""
    mx.eval(fn(*args))
    mx.synchronize()
    mx.reset_peak_memory()
    before = mx.get_active_memory()
    mx.eval(fn(*args))
    return mx.get_peak_memory() - before


def test_fused_backward_peak_does_not_grow_with_tokens():
    """Value and gradient at M = 16 and 64 chunks: the fused peak stays put while the naive one grows ~4x.

    A trainable head's dW (the same blocks, plus a [V, H] float32 accumulator) stays flat the same way:
    measured 9.9 -> 10.3 blocks.
    Measured (CPU, V=4096, chunk=64, one block = [64, 4096] float32 = 1 MiB): fused 8.2 -> 8.6 blocks
    (the blocks alive at once are the backend's run-ahead window, not M); naive 48 -> 193 MiB. M = 4
    chunks would sit inside that window, so the comparison starts at 16. Unchained chunks (no `after`)
    measured 36 -> 46 blocks: bounded by MLX's breadth-first width, hence the absolute bound too.
    """
    vocab, hidden, chunk = 4096, 32, 64
    w = mx.random.normal((vocab, hidden), key=mx.random.key(15)) * 0.1
    head = LMHead(w)
    mx.eval(w)

    def fused(h, t, g):
        return (fused_logp(head, h, t, chunk=chunk) * g).sum()

    def naive(h, t, g):
        return (naive_logp(head, h, t) * g).sum()

    def trainable(h, t, g):  # d/dW as well: a [V, H] float32 accumulator, still no [M, V] array
        return mx.grad(lambda w, h: (fused_logp(LMHead(w, trainable=True), h, t, chunk=chunk) * g).sum(),
                       argnums=[0, 1])(w, h)

    peaks = {}
    for name, fn in (("fused", fused), ("naive", naive), ("trainable", trainable)):
        for n_chunks in (16, 64):
            m = n_chunks * chunk
            k = mx.random.split(mx.random.key(n_chunks), 3)
            args = (mx.random.normal((m, hidden), key=k[0]), mx.random.randint(0, vocab, (m,), key=k[1]),
                    mx.random.normal((m,), key=k[2]))
            mx.eval(*args)
            peaks[name, n_chunks] = peak_bytes(fn if name == "trainable" else mx.value_and_grad(fn), *args)
    block = chunk * vocab * 4
    print({k: round(v / block, 2) for k, v in peaks.items()}, "blocks")
    assert peaks["fused", 64] < 1.3 * peaks["fused", 16]
    assert peaks["naive", 64] > 3 * peaks["naive", 16]
    assert peaks["fused", 64] < peaks["naive", 64] / 4
    assert peaks["fused", 64] < 16 * block
    # The weight's gradient: flat in M too, and far below the naive head's [M, V] logits.
    assert peaks["trainable", 64] < 1.3 * peaks["trainable", 16]
    assert peaks["trainable", 64] < peaks["naive", 64] / 4


@pytest.mark.skipif(ON_GPU, reason="CUDA's pooling allocator makes peaks of small graphs too noisy to compare")
def test_eager_head_equals_the_fused_head_and_holds_one_block():
    """The segmented path's head (chunk by chunk, evaluated as it goes): same value and gradient as fused_logp
    bit for bit, and about one [chunk, V] block alive instead of the backend's run-ahead window.

    Measured (CPU, V=4096, chunk=64, 64 chunks, softcap): 1.56 blocks eager against 12.3 under value_and_grad.
    """
    vocab, hidden, chunk, m = 4096, 32, 64, 64 * 64
    w = mx.random.normal((vocab, hidden), key=mx.random.key(16)) * 0.1
    head = LMHead(w, softcap=30.0)
    k = mx.random.split(mx.random.key(17), 3)
    h, t, g = (mx.random.normal((m, hidden), key=k[0]), mx.random.randint(0, vocab, (m,), key=k[1]),
               mx.random.normal((m,), key=k[2]))
    mx.eval(w, h, t, g)
    want_value, want_grad = mx.vjp(lambda h: [fused_logp(head, h, t, chunk=chunk)], [h], [g])
    mx.eval(want_value, want_grad)

    def eager() -> tuple[mx.array, mx.array]:
        value, grad_fn = fused_logp_eager(head, h, t, chunk)
        grad = grad_fn(g).hidden
        mx.eval(value, grad)
        return value, grad

    value, grad = eager()
    assert np.array_equal(np.array(value), np.array(want_value[0]))
    assert np.array_equal(np.array(grad), np.array(want_grad[0]))
    block = chunk * vocab * 4
    before = mx.get_active_memory()
    mx.reset_peak_memory()
    eager()
    eager_peak = mx.get_peak_memory() - before
    lazy_peak = peak_bytes(mx.value_and_grad(lambda h: (fused_logp(head, h, t, chunk=chunk) * g).sum()), h)
    print(round(eager_peak / block, 2), round(lazy_peak / block, 2), "blocks")
    assert eager_peak < 3 * block and eager_peak < lazy_peak / 2, (eager_peak / block, lazy_peak / block)


def test_auto_chunk_holds_the_block_size_across_vocabularies():
    """head_chunk 0: a [chunk, V] block holds ~2^25 logits at 32k and at 256k (the fixed chunk grows 8x)."""
    sizes = {v: chunk_for(v, 0) * v for v in (32_000, 128_256, 256_000)}
    assert all(0.9 * AUTO_BLOCK_LOGITS <= n <= AUTO_BLOCK_LOGITS for n in sizes.values()), sizes
    assert chunk_for(256_000, 0) < chunk_for(32_000, 0) and chunk_for(32_000, 7) == 7
    assert chunk_for(10**9, 0) == 16  # never fewer than 16 tokens per chunk
