"""The benchmarks' model-FLOPs count (MFU's numerator) against counts taken from a real model and explicit masks."""

import sys
from pathlib import Path

import numpy as np
import pytest
from mlx.utils import tree_flatten
from mlx_lm.models import llama

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
from engine_shapes import Shape  # noqa: E402

PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
SHAPE = Shape(hidden=64, layers=3, heads=4, kv_heads=2, intermediate=96, vocab=100, head_dim=8, pairs=3, prompt=10,
              response=6, prompt_spread=4)


def visible_pairs(prompt: int, response: int, shared: bool) -> int:
    """(query, key) pairs the causal masks of one pair's rows let through, counted on the masks themselves."""
    causal = np.tril(np.ones((prompt + response, prompt + response), bool))
    if not shared:  # [prompt; chosen] and [prompt; rejected], each a causal row
        return 2 * int(causal.sum())
    return int(causal.sum()) + int(causal[prompt:].sum())  # rejected's queries only: the prompt ran once


@pytest.mark.parametrize("method", ["lora", "full"])
@pytest.mark.parametrize("shared", [True, False])
def test_step_flops_count_the_models_projections_masks_and_head(method, shared):
    model = llama.Model(llama.ModelArgs(model_type="llama", **SHAPE.llama_config()))
    weights = sum(v.size for k, v in tree_flatten(model.parameters()) if k.split(".")[-2] in PROJECTIONS)
    lengths = SHAPE.prompt_lengths()
    assert len(set(lengths)) == SHAPE.pairs  # the spread gives each pair its own prompt
    r = SHAPE.response
    stack = sum(p + 2 * r if shared else 2 * (p + r) for p in lengths)
    pairs = sum(visible_pairs(p, r, shared) for p in lengths)
    passes = 3 if method == "full" else 2  # forward, input gradient (, weight gradient)
    attention = 3 * 2 * 2 * SHAPE.heads * SHAPE.head_dim * pairs * SHAPE.layers  # QK^T and PV; backward twice
    head = passes * 2 * SHAPE.hidden * SHAPE.vocab * 2 * r * SHAPE.pairs  # chosen's and rejected's scored tokens
    assert SHAPE.linear_params() == weights
    assert SHAPE.step_flops(method, shared) == 2 * weights * stack * passes + attention + head
