"""The quantize stage (LoRA on a quantized base): the folder it writes, the rounding bound of its weights against
numpy, training and bit-exact replay on it, generation with the trained adapter, and the config's checks.

Oracle for the weights: a numpy float64 implementation of affine quantization as MLX defines it (each group of
`group_size` weights on 2^b - 1 steps from the edge of larger magnitude, the step rounded so that zero is a grid
point), run on the source's float weights: every dequantized weight equals it within a thousandth of a step.
"""

import json
import subprocess
import sys

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from conftest import TINY_TRAIN, shortest_pairs

from orpo.config import ConfigError, validate_config
from orpo.train.settings import train_settings
from orpo.train.trainer import replay, train

SETTINGS = {"bits": 4, "group_size": 32}


@pytest.fixture(scope="module")
def quantized(tiny_base, tmp_path_factory):
    """The tiny base quantized by the `orpo quantize` command (a subprocess: the CLI as users run it)."""
    out = tmp_path_factory.mktemp("q") / "model"
    done = subprocess.run([sys.executable, "-m", "orpo.cli", "quantize", "--model", str(tiny_base), "--out", str(out),
                           "--settings", json.dumps(SETTINGS)], capture_output=True, text=True, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "orpo quantize: note: 4-bit affine, groups of 32" in done.stderr
    return out


def float_layers(folder):
    from mlx_lm.utils import load_model

    model, _ = load_model(folder)
    return {name: np.array(m.weight.astype(mx.float32)) for name, m in model.named_modules()
            if isinstance(m, (nn.Linear, nn.Embedding))}


def affine_reference(w, bits, group_size):
    """(dequantized groups [n, group_size], each group's step) of float weights w under MLX's affine rule."""
    g = w.reshape(-1, group_size).astype(np.float64)
    bins = 2 ** bits - 1
    lo, hi = g.min(axis=1), g.max(axis=1)
    low_edge = np.abs(lo) > np.abs(hi)  # the grid starts at the edge of larger magnitude
    edge = np.where(low_edge, lo, hi)
    step = np.where(low_edge, 1, -1) * np.maximum((hi - lo) / bins, 1e-7)
    q0 = np.round(edge / step)  # the edge's grid index from zero: the step is rounded to make zero a grid point
    step = np.where(q0 != 0, edge / np.where(q0 != 0, q0, 1), step)
    bias = np.where(q0 == 0, 0, edge)
    q = np.clip(np.round((g - bias[:, None]) / step[:, None]), 0, bins)
    return q * step[:, None] + bias[:, None], np.abs(step)


def test_the_folder_loads_and_its_weights_equal_the_numpy_reference(tiny_base, quantized):
    from mlx_lm.utils import load_model

    source = float_layers(tiny_base)
    model, config = load_model(quantized)
    assert config["quantization"] == {"group_size": 32, "bits": 4, "mode": "affine"}
    layers = {name: m for name, m in model.named_modules() if hasattr(m, "bits")}
    manifest = json.loads((quantized / "manifest.json").read_text())
    assert manifest["quantized_layers"] == len(layers) == len(source)  # the tiny widths are multiples of 32
    assert manifest["float_layers"] == [] and manifest["quantized_bytes"] < manifest["float_bytes"] / 3
    for name, m in layers.items():
        got = np.array(mx.dequantize(m.weight, m.scales, m.biases, m.group_size, m.bits).astype(mx.float32))
        want, step = affine_reference(source[name], bits=4, group_size=32)
        assert np.abs(got.reshape(want.shape) - want).max() <= 1e-3 * step.min(), name
        assert np.abs(got - source[name]).max() > 0, name  # quantized, not copied
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json"):
        assert (quantized / name).read_bytes() == (tiny_base / name).read_bytes(), name
    assert json.loads((quantized / "complete.json").read_text())["stage"] == "quantize"


def test_quantizing_a_quantized_model_is_refused(quantized, tmp_path):
    from orpo.base.quantize import QuantizeSettings, quantize

    with pytest.raises(ValueError, match="already quantized"):
        quantize(quantized, tmp_path / "twice", QuantizeSettings(4, 64))
    assert not (tmp_path / "twice").exists()


def test_lora_trains_on_the_quantized_base_and_replays_bit_exactly(quantized, tiny_rendered, tmp_path):
    """All engine options on (fused head on the quantized head, prefix sharing, segments, compile): the loss goes
    down, B moves, the final adapter replays from scratch to the same bytes, and generation loads it."""
    from orpo.generation import generate_counted, load_generator

    rendered = shortest_pairs(tiny_rendered, tmp_path / "rendered")
    engine = {"head": "fused", "head_chunk": 64, "segment_layers": 1, "prefix_sharing": True, "compile": True}
    settings = {**TINY_TRAIN, "max_steps": 8, "batch_size": 2, "grad_accum": 2, "engine": engine}
    run = tmp_path / "run"
    train(quantized, rendered, run, train_settings(settings))
    logs = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    losses = [x["loss"] for x in logs if x["split"] == "train"]
    assert all(np.isfinite(losses)) and losses[-1] < losses[0]
    weights = mx.load(str(run / "adapters.safetensors"))
    assert max(np.abs(np.array(v)).max() for k, v in weights.items() if k.endswith("lora_b")) > 1e-4
    assert replay(run, quantized, rendered, "final", "zero")["equal"]
    gen = load_generator(quantized, run)
    assert any(hasattr(m, "bits") for _, m in gen.model.named_modules())
    prompt = gen.prompt_ids([{"role": "user", "content": "Tell me about the dog."}])
    texts, counts, _ = generate_counted(gen, [prompt], {"max_tokens": 8, "temperature": 0.0, "top_p": 1.0,
                                                        "seed": 0, "batch_size": 1})
    assert counts[0] > 0


@pytest.mark.parametrize("engine", ["all", "all_compiled_ordered", "all_compiled_mlp_chunks_2", "prefix_compiled_gated_mlp",
                                    "all_compiled_mlp_chunks_2_gated"])
def test_lora_on_a_quantized_base_equals_the_naive_path(engine):
    """The oracle ladder's top rungs on a 4-bit model (its embedding and head too): the engine's loss and LoRA
    gradients match the naive two-forward ORPO on the same quantized weights."""
    from test_engine_ladder import ENGINES, assert_close, lora_model, naive
    from test_engine_stack import random_pairs

    from orpo.base.quantize import QuantizeSettings
    from orpo.train.step import pair_value_and_grad

    model, _ = lora_model("llama", quantize=QuantizeSettings(4, 32))
    assert {type(m).__name__ for _, m in model.named_modules()} >= {"QuantizedLinear", "QuantizedEmbedding"}
    pairs = random_pairs(1, 3)
    assert_close(pair_value_and_grad(model, pairs, 0.25, ENGINES[engine]), naive(model, pairs))


def test_a_quantized_base_refuses_full_parameter_training():
    with pytest.raises(ConfigError, match="quantize.bits: a quantized base trains only its LoRA adapters"):
        validate_config({"quantize": {"bits": 4}, "train": {"method": "full"}})


@pytest.mark.parametrize("mode, bits, group_size, bias", [("affine", 4, 32, True), ("affine", 8, 64, False),
                                                         ("mxfp4", 4, 32, False)])
def test_a_frozen_quantized_linear_is_its_dequantized_weight_times_x(mode, bits, group_size, bias):
    """Training's matmul through a quantized layer (orpo.engine.quantized) against float64 numpy with the layer's
    dequantized weight: output and the input's gradient."""
    from orpo.engine.quantized import frozen_linear

    mx.random.seed(3)
    layer = nn.QuantizedLinear.from_linear(nn.Linear(128, 48, bias=bias), group_size=group_size, bits=bits, mode=mode)
    x = mx.random.normal((2, 7, 128))
    cot = mx.random.normal((2, 7, 48))
    y, (dx,) = frozen_linear(layer, x), mx.vjp(lambda x: frozen_linear(layer, x), [x], [cot])[1]
    w = np.array(mx.dequantize(layer.weight, layer.scales, layer.get("biases"), group_size, bits, mode=mode)
                 .astype(mx.float32), dtype=np.float64)
    want = np.array(x, dtype=np.float64) @ w.T + (np.array(layer.bias, dtype=np.float64) if bias else 0)
    np.testing.assert_allclose(np.array(y), want, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.array(dx), np.array(cot, dtype=np.float64) @ w, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.array(y), np.array(layer(x)), rtol=1e-5, atol=1e-5)  # what the layer computes


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_a_quantized_stack_holds_no_float_copy_of_its_weights(compiled):
    """The gradient through a stack of frozen quantized layers: the step's peak above its inputs stays within a few
    float weights whatever the depth (were each layer's dequantized weight alive until the backward reached it, 24
    layers would peak ~18 weights above 6)."""
    from orpo.engine.quantized import frozen_linear

    width = 1024
    weight_bytes = width * width * 4

    def peak_above_active(depth):
        mx.random.seed(0)
        layers = [nn.QuantizedLinear.from_linear(nn.Linear(width, width, bias=False), group_size=64, bits=4)
                  for _ in range(depth)]
        mx.eval([layer.parameters() for layer in layers])
        x = mx.random.normal((32, width))
        scales = [mx.full((width,), 1.0) for _ in range(depth)]

        def loss(scales):
            h = x
            for layer, s in zip(layers, scales):
                h = mx.tanh(frozen_linear(layer, h) * s)
            return h.sum()

        step = mx.value_and_grad(loss)
        step = mx.compile(step) if compiled else step
        mx.eval(step(scales))  # compiles
        mx.clear_cache()
        mx.reset_peak_memory()
        active = mx.get_active_memory()
        mx.eval(step(scales))
        return mx.get_peak_memory() - active

    shallow, deep = peak_above_active(6), peak_above_active(24)
    assert deep - shallow < 4 * weight_bytes, (shallow / weight_bytes, deep / weight_bytes)
