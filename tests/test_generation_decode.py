"""The engine's batched decode (left-padded rows, a KV cache, one query a row) against full forwards of each
prompt alone: the same greedy tokens for every family, sliding windows, uneven budgets and stop tokens."""

from unittest.mock import patch

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.sample_utils import make_sampler
from mlx_lm.utils import quantize_model
from test_engine_stack import VARIANTS, VOCAB, WINDOW, tiny_model
from test_train_models import COMMON, FAMILIES

from orpo.engine.forward import KVCache, decode_attention
from orpo.engine.head import lm_head_of
from orpo.engine.stack import Stack
from orpo.generation import decode, forward_cached, prefill

GREEDY = make_sampler(temp=0.0)


def prompts_of(seed: int, lengths: list[int]) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [[int(x) for x in rng.integers(1, VOCAB, n)] for n in lengths]


def greedy_alone(model, prompt: list[int], budget: int, stops: set[int] = frozenset()) -> list[int]:
    """The oracle: each token the argmax of the model's own forward over the whole sequence so far."""
    seq, out = list(prompt), []
    while len(out) < budget:
        token = int(mx.argmax(model(mx.array([seq]))[0, -1]).item())
        if token in stops:
            break
        out.append(token)
        seq.append(token)
    return out


@pytest.mark.parametrize("variant", [*VARIANTS, "llama_4bit"])
def test_batched_decode_gives_each_prompts_own_greedy_tokens(variant):
    # Prompts of 3 to 13 tokens and 12 new ones: left padding of up to 10, and past the sliding window of 8.
    model = tiny_model("llama" if variant == "llama_4bit" else variant)
    if variant == "llama_4bit":  # a quantized model, as an mlx judge often is
        model, _ = quantize_model(model, {**COMMON, **FAMILIES["llama"]}, group_size=32, bits=4)
    prompts = prompts_of(1, [3, 13, 7, 10])
    got = decode(Stack(model), lm_head_of(model), prompts, [12] * 4, GREEDY, set())
    assert got == [greedy_alone(model, p, 12) for p in prompts]
    if variant in ("gemma3_text", "llama_sliding"):
        assert len(prompts[1]) + 12 > 2 * WINDOW


def test_prefill_logits_equal_the_models_forward_of_each_prompt():
    """Prompts longest first, in blocks of their own widths (PREFILL_TOKENS cut to 16: blocks of 1, 1 and 3 rows),
    the caches joined right-aligned at the longest prompt."""
    model = tiny_model("qwen3")
    prompts = prompts_of(2, [11, 9, 5, 4, 2])
    with patch("orpo.generation.PREFILL_TOKENS", 16):
        logits, caches = prefill(Stack(model), lm_head_of(model), prompts, room=4)
    for row, p in zip(np.array(logits), prompts):
        np.testing.assert_allclose(row, np.array(model(mx.array([p]))[0, -1]), rtol=1e-4, atol=1e-4)
    assert caches[0].keys.shape == (5, 1, 11 + 4, 16) and caches[0].offset == 11
    # the last block (prompts of 5, 4 and 2 tokens, 5 wide) written from column 6 to end at column 11
    keys = np.array(caches[0].keys)
    assert not np.any(keys[2:, :, :6]) and np.all(np.any(keys[2:, :, 9:11], -1)) and not np.any(keys[:, :, 11:])


def test_uneven_budgets_and_stop_tokens_end_rows_where_they_should():
    """Rows finish at different steps, so the batch is cut (at half) while others go on; a stop token ends a row
    and is left out."""
    model = tiny_model("llama")
    prompts = prompts_of(3, [4, 9, 6, 12, 5, 8])
    budgets = [1, 2, 3, 10, 0, 16]
    alone = [greedy_alone(model, p, 16) for p in prompts]
    got = decode(Stack(model), lm_head_of(model), prompts, budgets, GREEDY, set())
    assert got == [a[:b] for a, b in zip(alone, budgets)]
    stop = alone[5][4]  # the fifth token of the last prompt's answer
    stopped = decode(Stack(model), lm_head_of(model), prompts, [16] * 6, GREEDY, {stop})
    assert stopped == [greedy_alone(model, p, 16, {stop}) for p in prompts]
    assert stopped[5] == alone[5][:alone[5].index(stop)]


def test_decode_attention_equals_mx_fast_attention_with_the_same_mask():
    """GQA folded into the matmul rows, against mx.fast's attention with the bias as its mask, float32."""
    rng = np.random.default_rng(0)
    q, k, v = (mx.array(rng.standard_normal(s).astype(np.float32)) for s in ((3, 8, 1, 16), (3, 2, 9, 16),
                                                                             (3, 2, 9, 16)))
    pads = np.array([0, 4, 8])
    bias = mx.array(np.where(np.arange(9)[None] >= pads[:, None], 0.0, -np.inf).astype(np.float32))[:, None, None]
    want = mx.fast.scaled_dot_product_attention(q, k, v, scale=0.25, mask=bias)
    np.testing.assert_allclose(np.array(decode_attention(q, k, v, 0.25, bias)), np.array(want), rtol=1e-5, atol=1e-5)


def test_the_cache_writes_at_its_offset_and_returns_what_it_holds():
    cache = KVCache()
    k = mx.arange(2 * 3 * 4, dtype=mx.float32).reshape(1, 2, 3, 4)
    cache.update(k, k)
    cache = KVCache(mx.concatenate([cache.keys, mx.zeros((1, 2, 2, 4))], axis=2), mx.zeros((1, 2, 5, 4)), 3)
    keys, values = cache.update(-k[:, :, :1], -k[:, :, :1])
    assert keys.shape == (1, 2, 4, 4) and cache.offset == 4
    assert np.array_equal(np.array(keys[:, :, 3]), -np.array(k[:, :, 0]))
    assert np.array_equal(np.array(keys[:, :, :3]), np.array(k))


@pytest.mark.parametrize("variant", ["llama", "gemma2", "gemma3_text"])
def test_bf16_decode_logits_follow_the_models_own_forward(variant):
    """In the dtype generation runs in on a GPU: every step's logits of left-padded rows within bf16 rounding
    (1/64 of the largest logit) of the model's forward over the whole sequence so far."""
    model = tiny_model(variant)
    model.set_dtype(mx.bfloat16)
    prompts = prompts_of(4, [13, 7, 3])
    stack, head = Stack(model), lm_head_of(model)
    logits, caches = prefill(stack, head, prompts, room=6)
    pads = mx.array([13 - len(p) for p in prompts])
    rng = np.random.default_rng(5)
    for _ in range(6):
        for row, seq in zip(logits.astype(mx.float32), prompts):
            want = model(mx.array([seq]))[0, -1].astype(mx.float32)
            assert mx.abs(row - want).max().item() <= mx.abs(want).max().item() / 64
        tokens = [int(x) for x in rng.integers(1, VOCAB, len(prompts))]
        prompts = [p + [t] for p, t in zip(prompts, tokens)]
        logits = forward_cached(stack, head, mx.array(tokens)[:, None], pads, caches)
