"""The engine's own decoder-layer forward: the mlx-lm it mirrors, LoRA/DoRA-wrapped layers, nothing patched.

Oracle: mlx-lm's own model forward (`model.model(tokens)` bit for bit on plain rows, `model(tokens)` logits
within float32 matmul tolerance), for every supported family.
"""

import math
import re
import tomllib
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx.utils import tree_flatten
from mlx_lm.models import base, llama
from mlx_lm.tuner.utils import linear_to_lora_layers
from test_engine_stack import VARIANTS, random_pairs, tiny_model

from conftest import MATMUL_TOL, ON_GPU
from orpo.engine import forward
from orpo.engine import mlp as mlp_module
from orpo.engine.forward import (FAMILIES, MLX_LM_TESTED, UnsupportedModel, check_mlx_lm, missing_parts,
                                 mlx_lm_version_supported)
from orpo.engine.head import head_logits, lm_head_of
from orpo.engine.segmented import segmented_value_and_grad
from orpo.engine.stack import Layout, Stack
from orpo.train.rows import shared_rows

VOCAB = 512
PYPROJECT = Path(__file__).resolve().parents[1] / "pyproject.toml"


def test_installed_mlx_lm_is_in_the_tested_range_pyproject_pins():
    pins = [d for d in tomllib.loads(PYPROJECT.read_text())["project"]["dependencies"] if re.match(r"mlx-lm\b", d)]
    assert pins == [f"mlx-lm{MLX_LM_TESTED}"]
    assert mlx_lm_version_supported(check_mlx_lm())
    assert mlx_lm_version_supported("0.32.2") and mlx_lm_version_supported("0.32.9")
    assert not mlx_lm_version_supported("0.32.1") and not mlx_lm_version_supported("0.33.0")
    assert not mlx_lm_version_supported("0.33.0rc1")


def test_an_untested_mlx_lm_is_refused_with_the_range(monkeypatch):
    monkeypatch.setattr(forward.importlib.metadata, "version", lambda name: "0.33.1")
    check_mlx_lm.cache_clear()
    try:
        with pytest.raises(UnsupportedModel, match=r"mlx-lm 0\.33\.1 is installed.*>=0\.32\.2,<0\.33"):
            Stack(tiny_model("llama"))
    finally:
        monkeypatch.undo()
        check_mlx_lm.cache_clear()
    Stack(tiny_model("llama"))


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_each_family_has_the_parts_its_forward_calls(variant):
    model = tiny_model(variant)
    family = forward.family_of(model)
    assert family in FAMILIES and missing_parts(model, family) == []


def test_a_model_lacking_a_part_is_refused_naming_it():
    """A llama layer read as qwen3 (q/k norms) or gemma2 (softcap, sandwich norms) lacks those parts."""
    model = tiny_model("llama")
    assert missing_parts(model, "qwen3") == ["model.layers.0.self_attn.q_norm", "model.layers.0.self_attn.k_norm"]
    assert "model.layers.0.pre_feedforward_layernorm" in missing_parts(model, "gemma2")
    with pytest.raises(UnsupportedModel, match="lacks model.layers.0.self_attn.q_norm"):
        forward.check_parts(model, "qwen3")


PROJECTIONS = ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj",
               "mlp.up_proj", "mlp.down_proj"]


def adapted(model: nn.Module, keys: list[str], use_dora: bool = False) -> nn.Module:
    """The model with mlx-lm's own LoRA or DoRA layers on `keys` of every layer, their B factors random (not 0)."""
    linear_to_lora_layers(model, len(model.model.layers), {"rank": 4, "scale": 2.0, "dropout": 0.0, "keys": keys},
                          use_dora=use_dora)
    rng = np.random.default_rng(7)
    for _, m in model.named_modules():
        if hasattr(m, "lora_b"):
            m.lora_b = mx.array(rng.normal(scale=0.1, size=m.lora_b.shape).astype(np.float32))
    mx.eval(model.parameters())
    model.eval()
    return model


@pytest.mark.parametrize("use_dora", [False, True], ids=["lora", "dora"])
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_forward_through_mlx_lm_adapters_equals_the_model(variant, use_dora):
    """mlx-lm's LoRALinear/DoRALinear wrap the projections; they are called as modules, so the stack's hidden
    states stay bit-identical to the model's and its logits equal `model(tokens)`."""
    model = adapted(tiny_model(variant), PROJECTIONS, use_dora)
    kind = "DoRALinear" if use_dora else "LoRALinear"
    assert type(model.model.layers[0].self_attn.q_proj).__name__ == kind
    assert type(model.model.layers[0].mlp.down_proj).__name__ == kind
    tokens = mx.array(np.random.default_rng(8).integers(0, VOCAB, (2, 21)), mx.int32)
    hidden = Stack(model).hidden(Layout(tokens))
    assert np.array_equal(np.array(hidden), np.array(model.model(tokens)))
    np.testing.assert_allclose(np.array(head_logits(lm_head_of(model), hidden)), np.array(model(tokens)),
                               rtol=MATMUL_TOL, atol=MATMUL_TOL)
    # Control: the adapters change the output (their B factors are not zero).
    assert np.abs(np.array(hidden) - np.array(tiny_model(variant).model(tokens))).max() > 1e-3


class Probe(nn.Module):
    """Stands in for a projection: calls it and, each time, records whatever of mlx-lm differs from `before`."""

    def __init__(self, inner: nn.Module, check):
        super().__init__()
        self.inner = inner
        self._check = check  # a function: a plain attribute, not a child module

    def __call__(self, x: mx.array) -> mx.array:
        self._check()
        return self.inner(x)


def mlx_lm_state(model: nn.Module) -> dict:
    """The objects a patching engine would replace: module-level attention functions, each layer's rope and mlp."""
    state = {"llama.sdpa": llama.scaled_dot_product_attention, "base.sdpa": base.scaled_dot_product_attention}
    for i, layer in enumerate(model.model.layers):
        state[f"{i}.rope"], state[f"{i}.mlp"] = layer.self_attn.rope, layer.mlp
        state[f"{i}.attn"] = layer.self_attn
    return state


def test_nothing_of_mlx_lm_is_replaced_while_the_engine_runs():
    """While prefix-shared rows (split and exclusion attention) go forward and through the segmented backward
    with tiled MLPs, mlx-lm's attention functions and every layer's rope, mlp and attention are its own."""
    model = adapted(tiny_model("llama", num_hidden_layers=3), ["self_attn.q_proj", "mlp.down_proj"])
    calls, changed = [], []

    def check():
        calls.append(1)
        now = mlx_lm_state(model)
        changed.extend(k for k in before if now[k] is not before[k])

    for layer in model.model.layers:
        layer.self_attn.o_proj = Probe(layer.self_attn.o_proj, check)
    before = mlx_lm_state(model)
    stack = Stack(model)
    pairs = random_pairs(3, 3)
    for attention in ("split", "exclusion"):
        layout = shared_rows(pairs, attention=attention).layout
        assert (layout.split is not None) == (attention == "split")
        mx.eval(stack.hidden(layout))

        def head_loss(h):
            return (stack.norm(h) ** 2).mean(), {}

        (loss, _), grads = segmented_value_and_grad(model, stack, layout, head_loss, 1, mlp_chunks=2)
        want, want_grads = nn.value_and_grad(model, lambda: head_loss(stack.run(
            stack.embed(layout.tokens), stack.masks(layout, stack.embed(layout.tokens)), 0, 3, layout.positions))[0])()
        np.testing.assert_allclose(float(loss), float(want), rtol=10 * MATMUL_TOL)
        for (name, g), (_, w) in zip(tree_flatten(grads), tree_flatten(want_grads)):
            assert np.abs(np.array(w)).max() > 0, name
            np.testing.assert_allclose(np.array(g), np.array(w), rtol=20 * MATMUL_TOL, atol=20 * MATMUL_TOL,
                                       err_msg=name)
    assert len(calls) >= 4 * 3 and changed == []


def _erf(x):
    return np.vectorize(math.erf)(x)


GATED = {  # activation, mlx's act, its float64 value and derivative
    "swiglu": (mlp_module.SWIGLU, nn.silu, lambda g: g / (1 + np.exp(-g)),
               lambda g: (s := 1 / (1 + np.exp(-g))) * (1 + g * (1 - s))),
    "geglu": (mlp_module.GEGLU, nn.gelu, lambda g: g * (1 + _erf(g / np.sqrt(2))) / 2,
              lambda g: (1 + _erf(g / np.sqrt(2))) / 2 + g * np.exp(-g * g / 2) / np.sqrt(2 * np.pi)),
    "geglu_approx": (mlp_module.GEGLU_APPROX, nn.gelu_approx,
                     lambda g: 0.5 * g * (1 + np.tanh(np.sqrt(2 / np.pi) * (g + 0.044715 * g**3))),
                     None),  # its derivative: central differences of the value, in float64
}


@pytest.mark.parametrize("name", GATED)
@pytest.mark.parametrize("dtype, tol", [(mx.float32, 1e-6), (mx.bfloat16, 2e-2)])
def test_gated_activation_value_and_gradients_equal_float64(name, dtype, tol):
    """mlp.gated's activations against float64 numpy: act(gate) * up and its gradients (d gate = c up act'(g),
    d up = c act(g)), errors relative to each result's largest magnitude; the forward is mlx-lm's act(gate) * up
    bit for bit (the same ops in the same order)."""
    activation, act, value, grad = GATED[name]
    rng = np.random.default_rng(0)
    gate, up, cot = (mx.array(rng.normal(size=(48, 80)) * 3).astype(dtype) for _ in range(3))
    out = activation.forward(gate, up)
    d_gate, d_up = activation.backward(gate, up, cot)
    theirs = np.array((act(gate) * up).astype(mx.float32))
    if ON_GPU and name == "geglu_approx":  # a GPU's fused kernel contracts the tanh argument's products into FMAs
        assert np.abs(np.array(out.astype(mx.float32)) - theirs).max() <= tol * np.abs(theirs).max()
    else:
        assert np.array_equal(np.array(out.astype(mx.float32)), theirs)
    g, u, c = (np.array(a.astype(mx.float32), dtype=np.float64) for a in (gate, up, cot))
    derivative = grad(g) if grad else (value(g + 1e-6) - value(g - 1e-6)) / 2e-6
    for got, want in ((out, value(g) * u), (d_gate, c * u * derivative), (d_up, c * value(g))):
        assert got.dtype == dtype
        err = np.abs(np.array(got.astype(mx.float32), dtype=np.float64) - want).max() / np.abs(want).max()
        assert err < tol, err


@pytest.mark.parametrize("name", ["swiglu", "geglu"])
def test_gated_backward_writes_only_its_two_gradients_under_compile(name):
    """The activation's backward in bf16 under an enclosing mx.compile (as the compiled step runs it) peaks at its
    two outputs: nothing it computes in float32 on the way is written out as a [tokens, intermediate] array."""
    activation = GATED[name][0]
    gate, up, cot = (mx.random.normal((512, 1024), key=mx.random.key(i)).astype(mx.bfloat16) for i in range(3))
    step = mx.compile(lambda g, u, c: activation.backward(g, u, c))
    mx.eval(gate, up, cot, step(gate, up, cot))
    mx.clear_cache()
    base = mx.get_active_memory()
    mx.reset_peak_memory()
    out = step(gate, up, cot)
    mx.eval(out)
    assert mx.get_peak_memory() - base <= 1.1 * sum(o.nbytes for o in out)


def test_gated_mlps_keep_gate_and_up_alone_for_the_backward():
    """A stack of Llama MLPs (residual, down_proj trainable: its gradient reads the activation's product) through
    mlp.mlp_of: the same loss and gradients as mlx-lm's own MLPs, and each layer keeps at least 2 [tokens,
    intermediate] arrays less for the backward, eager and under mx.compile (the slope of the peak from 6 to 12
    layers, on the CPU: below 6 the backend's queued work makes it uneven); every supported family's MLP takes its
    gated activation, any other module is left as it is."""
    from types import SimpleNamespace

    from mlx.utils import tree_flatten

    tokens, hidden, inter = 1024, 64, 2048
    x = mx.array(np.random.default_rng(1).normal(size=(tokens, hidden)) * 0.5, mx.float32)

    def run(layers, ours, compiled=False):
        mx.random.seed(0)
        net = nn.Module()
        net.mlps = [llama.MLP(SimpleNamespace(hidden_size=hidden, intermediate_size=inter, mlp_bias=False))
                    for _ in range(layers)]
        net.freeze()
        for m in net.mlps:
            m.down_proj.unfreeze()
        calls = [mlp_module.mlp_of(m) if ours else m for m in net.mlps]

        def loss(x):
            for call in calls:
                x = x + call(x)
            return x.square().sum()

        step = nn.value_and_grad(net, loss)
        if compiled:
            step = mx.compile(step, inputs=[net], outputs=[net])
        mx.eval(net.parameters(), step(x))
        mx.reset_peak_memory()
        base = mx.get_active_memory()
        value, grads = step(x)
        mx.eval(value, grads)
        return (mx.get_peak_memory() - base) / (tokens * inter * 4), value.item(), tree_flatten(grads)

    theirs, ours = run(2, False), run(2, True)
    assert ours[1] == pytest.approx(theirs[1], rel=MATMUL_TOL)
    tol = 2e-3 if ON_GPU else 1e-5  # a GPU's float32 products round their inputs to tf32, in another order here
    for (name, a), (_, b) in zip(theirs[2], ours[2]):
        assert np.allclose(np.array(a), np.array(b), rtol=10 * tol, atol=tol * float(mx.abs(a).max())), name
    # Not on a GPU: CUDA's peak also counts queued work's buffers, which at these shapes swamps a layer's arrays (the
    # same MLPs measured 2.4 to 14.4 a layer across processes there); bench/ measures the saving at real shapes.
    for compiled in () if ON_GPU else (False, True):
        per_layer = {o: (run(12, o, compiled)[0] - run(6, o, compiled)[0]) / 6 for o in (False, True)}
        assert per_layer[False] - per_layer[True] >= 2, (compiled, per_layer)
    for family in FAMILIES:
        mlp = tiny_model(family).model.layers[0].mlp
        assert type(mlp) in mlp_module.GATED_MLPS and mlp_module.mlp_of(mlp) is not mlp
    linear = nn.Linear(4, 4)
    assert mlp_module.mlp_of(linear) is linear
