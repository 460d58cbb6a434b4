"""Training on other model folders: tiny random llama/mistral/qwen2/qwen3/gemma/gemma2/gemma3 and a 4-bit base."""

import json
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx.utils import tree_flatten
from mlx_lm import load
from mlx_lm.utils import _get_classes, load_model, quantize_model

from orpo.engine.head import mean_logps_from_logits, response_mean_logps
from orpo.train.data import load_pairs, pair_batch
from orpo.train.lora import LoRALinear, load_adapter_weights
from orpo.train.session import build_session
from orpo.train.settings import train_settings
from orpo.train.trainer import replay, train

from conftest import save_model_folder, shortest_pairs

COMMON = {
    "hidden_size": 32, "num_hidden_layers": 2, "intermediate_size": 64, "num_attention_heads": 2,
    "num_key_value_heads": 1, "rms_norm_eps": 1e-5, "vocab_size": 512, "max_position_embeddings": 512,
    "tie_word_embeddings": True,
}
FAMILIES = {
    "llama": {"model_type": "llama"},
    "mistral": {"model_type": "mistral", "rope_theta": 1e6},
    "qwen2": {"model_type": "qwen2"},  # q/k/v projections with bias
    "qwen3": {"model_type": "qwen3", "head_dim": 16, "rope_theta": 1e6},  # q/k norms
    "gemma": {"model_type": "gemma", "head_dim": 16},
    "gemma2": {"model_type": "gemma2", "head_dim": 16, "query_pre_attn_scalar": 16,
               "attn_logit_softcapping": 50.0, "final_logit_softcapping": 30.0},
    "gemma3_text": {"model_type": "gemma3_text", "head_dim": 16, "query_pre_attn_scalar": 16,
                    "sliding_window": 32, "sliding_window_pattern": 2},
}
SETTINGS = {"batch_size": 2, "max_steps": 3, "checkpoint_every": 0, "lr": 0.01,
            "lora": {"rank": 4, "alpha": 8, "dropout": 0.1, "plus_ratio": 2.0}}


@pytest.fixture(scope="module")
def short_rendered(tiny_rendered, tmp_path_factory) -> Path:
    """The shortest 16 train and 4 validation pairs of the tiny stack."""
    return shortest_pairs(tiny_rendered, tmp_path_factory.mktemp("short") / "rendered")


def build_family(family: str, tokenizer_from: Path, out: Path, **overrides) -> Path:
    """A tiny random-init model of `family` built with mlx-lm's own classes."""
    config = {**COMMON, **FAMILIES[family], **overrides}
    model_class, args_class = _get_classes(config)
    mx.random.seed(0)
    model = model_class(args_class.from_dict(config))
    mx.eval(model.parameters())
    return save_model_folder(model, config, tokenizer_from, out)


def assert_mlx_lm_matches_ours(base: Path, run: Path, rendered: Path) -> None:
    """mlx-lm with the run's adapter gives our eval-mode logits, and they differ from the base's."""
    settings = json.loads((run / "settings.json").read_text())["settings"]
    sess = build_session(base, rendered, train_settings(settings))
    load_adapter_weights(sess.model, run)
    sess.model.eval()
    pairs = load_pairs(rendered / "validation.parquet")
    tokens, _ = pair_batch(pairs, [0, 1])
    tuned, _ = load(str(base), adapter_path=str(run))
    plain, _ = load(str(base))
    ours, theirs, before = (np.array(m(tokens)) for m in (sess.model, tuned, plain))
    # A quantized base: training's linears dequantize and multiply (orpo.engine.quantized), mlx-lm's run its
    # quantized matmul: the same products summed in another order (measured: 5.8e-6 on logits up to ~5).
    quantized = any(isinstance(m, nn.QuantizedLinear) for _, m in plain.named_modules())
    atol = 1e-5 * np.abs(theirs).max() if quantized else 1e-6
    np.testing.assert_allclose(ours, theirs, rtol=1e-5, atol=atol)
    assert np.abs(theirs - before).max() > 1e-4


@pytest.mark.parametrize("family", list(FAMILIES))
def test_family_trains_replays_and_loads_in_mlx_lm(family, tiny_base, short_rendered, tmp_path):
    base = build_family(family, tiny_base, tmp_path / "base")
    pairs = load_pairs(short_rendered / "train.parquet")
    assert max(max(p + c + r) for p, c, r in zip(pairs.prompt, pairs.chosen, pairs.rejected)) < COMMON["vocab_size"]
    run = tmp_path / "run"
    index = train(base, short_rendered, run, train_settings(SETTINGS))
    assert index["final_step"] == 3
    losses = [json.loads(x)["loss"] for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert all(np.isfinite(losses))
    record = replay(run, base, short_rendered, "final", "zero")  # bit-identical from scratch
    assert record["equal"], record
    assert_mlx_lm_matches_ours(base, run, short_rendered)


def test_gemma2_softcapping_reaches_the_head(tiny_base, short_rendered, tmp_path):
    """The naive head calls the model, so gemma2's final-logit softcap is what it scores (a tight cap shows it)."""
    cap = 0.5
    model, _ = load_model(build_family("gemma2", tiny_base, tmp_path / "base", final_logit_softcapping=cap))
    tokens, mask = pair_batch(load_pairs(short_rendered / "train.parquet"), [0, 1])
    raw = model.model.embed_tokens.as_linear(model.model(tokens[:, :-1]))
    head = np.array(response_mean_logps(model, tokens, mask))
    capped = np.array(mean_logps_from_logits(cap * mx.tanh(raw / cap), tokens[:, 1:], mask[:, 1:]))
    uncapped = np.array(mean_logps_from_logits(raw, tokens[:, 1:], mask[:, 1:]))
    np.testing.assert_allclose(head, capped, rtol=1e-5)
    assert np.abs(head - uncapped).max() > 1e-2


def test_qlora_trains_on_a_4bit_base(tiny_base, short_rendered, tmp_path):
    model, config = load_model(tiny_base)
    model, config = quantize_model(model, config, group_size=32, bits=4)
    base = save_model_folder(model, config, tiny_base, tmp_path / "q4")
    run = tmp_path / "run"
    train(base, short_rendered, run, train_settings(SETTINGS))

    sess = build_session(base, short_rendered, train_settings(SETTINGS))
    loras = [m for _, m in sess.model.named_modules() if isinstance(m, LoRALinear)]
    assert loras and all(isinstance(m.linear, nn.QuantizedLinear) and m.linear.bits == 4 for m in loras)
    names = {k.rsplit(".", 1)[-1] for k, _ in tree_flatten(sess.model.trainable_parameters())}
    assert names == {"lora_a", "lora_b"}
    assert all(m.lora_a.dtype == mx.float32 for m in loras)
    assert replay(run, base, short_rendered, "final", "zero")["equal"]
    assert_mlx_lm_matches_ours(base, run, short_rendered)
