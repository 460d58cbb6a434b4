"""The benchmarks' model-FLOPs count (MFU's numerator) against counts taken from a real model and explicit masks, and
kernel_times' reading of the profiler's Chrome trace."""

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


@pytest.mark.parametrize("method", ["lora", "full"])
@pytest.mark.parametrize("shared", [True, False])
def test_pair_flops_of_responses_of_their_own_lengths(method, shared):
    """Chosen and rejected of differing lengths: the projections on the stack tokens, the (query, key) pairs of the
    rows' causal masks counted on the masks, the head on both responses' tokens."""
    p, c, r = 7, 5, 9
    with_chosen = np.tril(np.ones((p + c, p + c), bool))
    with_rejected = np.tril(np.ones((p + r, p + r), bool))
    pairs = int(with_chosen.sum()) + int((with_rejected[p:] if shared else with_rejected).sum())
    stack = p + c + r if shared else 2 * p + c + r
    passes = 3 if method == "full" else 2
    attention = 3 * 2 * 2 * SHAPE.heads * SHAPE.head_dim * pairs * SHAPE.layers
    head = passes * 2 * SHAPE.hidden * SHAPE.vocab * (c + r)
    want = 2 * SHAPE.linear_params() * stack * passes + attention + head
    assert SHAPE.pair_flops(p, c, r, method, shared) == want
    # MFU over pairs of their own lengths: FLOPs per two-forward token times the rate, against the probe.
    from engine_shapes import real_length_mfu

    lengths = [(p, c, r), (3, 4, 2)]
    flops = want + SHAPE.pair_flops(3, 4, 2, method, shared)
    tokens = 2 * p + c + r + 2 * 3 + 4 + 2
    assert real_length_mfu(SHAPE, lengths, 1000.0, 2.0, method, shared) == pytest.approx(flops * 1000 / tokens / 2e12)



def test_kernel_times_reads_the_profilers_chrome_trace():
    """bench/kernel_times.py: kernels read from torch's profiler's Chrome trace (start and duration in us), the
    host-side events and the trace's other categories left out; time per kind and the idle gaps between kernels."""
    import json

    from kernel_times import read_chrome_trace, summarize

    events = [{"ph": "X", "cat": "kernel", "name": "nvjet_sm90_tst_192x192_64x3_1x2_h_bz_coopB_NNN", "ts": 10.0,
               "dur": 84.5},
              {"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "ts": 9.0, "dur": 3.0},
              {"ph": "X", "cat": "kernel", "name": "mlx::core::cu::custom_kernel_orpo_flash_dq_64_64", "ts": 100.0,
               "dur": 383.0},
              {"ph": "X", "cat": "gpu_memcpy", "name": "Memcpy HtoD", "ts": 500.0, "dur": 7.0},
              {"ph": "X", "cat": "kernel", "name": "cudnn_generated_fort_native_sdpa_sm90_flash_fprop", "ts": 510.0,
               "dur": 145.5},
              {"ph": "i", "cat": "kernel", "name": "marker", "ts": 600.0}]
    launches = read_chrome_trace(json.dumps({"traceEvents": events, "deviceProperties": []}))
    assert [(n[:8], round(t0 * 1e6), round(t * 1e9)) for n, t0, t in launches] == [
        ("nvjet_sm", 10, 84500), ("mlx::cor", 100, 383000), ("cudnn_ge", 510, 145500)]
    s = summarize(launches, wall_s=1e-3, top=1)
    assert {k: round(v["s"] * 1e9) for k, v in s["kinds"].items()} == {
        "attention (the engine's kernels)": 383000, "attention (cuDNN)": 145500, "matmul": 84500}
    assert s["kernels"] == 3 and abs(s["gpu_busy"] - 0.613) < 1e-9 and s["largest"][0]["name"].startswith("mlx::")
    # idle between kernels: 100 - 94.5 = 5.5 us, then 510 - 483 = 27 us (the memcpy is not a kernel)
    assert round(s["idle_s"] * 1e7) == 325 and s["idle_over_1ms_s"] == 0
    assert [(round(g["s"] * 1e7), g["after"][:3], g["before"][:3]) for g in s["longest_idle"]] == [
        (270, "mlx", "cud"), (55, "nvj", "mlx")]
