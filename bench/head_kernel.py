"""The fused head's CUDA kernel tier against its pure-MLX forward block, on the CUDA device.

orpo.engine.head_kernel computes a [chunk, V] logit block's logsumexp and target log-prob in one kernel
(one read of the block); the pure-MLX block (orpo.engine.head._forward_block with kernel=False) casts the
block to float32 under mx.compile before MLX's logsumexp. This script times, at the auto chunk for each
vocabulary, (a) the block alone and (b) one head chunk's forward (projection matmul + block), both ways,
each call evaluated on its own, and checks the kernel's results against the MLX block's (with and without
a logit softcap). The head inside a full step: `engine.py --shape h200-head` (the `-auto-kernel` cases) and
`--shape h200` (`fused-prefix-128-c-kernel`).

    python3 bench/head_kernel.py        # needs MLX's CUDA backend
"""

from __future__ import annotations

import argparse
from collections.abc import Callable

import mlx.core as mx
from step_profile import timeit  # bench/'s timing loop (this script runs from bench/)

from orpo.device import on_cuda
from orpo.engine.head import LMHead, _forward_block, chunk_for


def timed(fn: Callable[[], object], reps: int) -> float:
    """Seconds per call, each evaluated, after 3 warm-up calls."""
    return timeit(fn, n=reps, warm=3)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--vocab", default="32000,128256,256000")
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--reps", type=int, default=50)
    a = ap.parse_args()
    if not on_cuda():
        raise SystemExit("head_kernel.py: needs MLX's CUDA backend as the default device")
    print(f"{'V':>8}{'chunk':>7}{'MLX block ms':>14}{'kernel ms':>11}{'x':>7}{'MLX chunk fwd ms':>18}"
          f"{'kernel chunk fwd ms':>21}{'x':>7}{'max |d logp|':>14}{'softcap 30':>12}")
    for v in (int(s) for s in a.vocab.split(",")):
        c = chunk_for(v, 0)
        head = LMHead((mx.random.normal((v, a.hidden)) * 0.02).astype(mx.bfloat16))
        h = mx.random.normal((c, a.hidden)).astype(mx.bfloat16)
        t = mx.random.randint(0, v, (c,))
        x = head.project(h)
        mx.eval(head.weight, h, t, x)
        diffs = []
        for cap in (None, 30.0):
            (lp_m, lse_m), (lp_k, lse_k) = _forward_block(cap, False)(x, t), _forward_block(cap, True)(x, t)
            diffs.append(max(mx.abs(lp_m - lp_k).max().item(), mx.abs(lse_m - lse_k).max().item()))
        mlx_block, kernel_block = _forward_block(None, False), _forward_block(None, True)
        tb_m, tb_k = timed(lambda: mlx_block(x, t), a.reps), timed(lambda: kernel_block(x, t), a.reps)
        tc_m = timed(lambda: mlx_block(head.project(h), t), a.reps)
        tc_k = timed(lambda: kernel_block(head.project(h), t), a.reps)
        print(f"{v:>8}{c:>7}{tb_m * 1e3:>14.3f}{tb_k * 1e3:>11.3f}{tb_m / tb_k:>7.2f}{tc_m * 1e3:>18.3f}"
              f"{tc_k * 1e3:>21.3f}{tc_m / tc_k:>7.2f}{diffs[0]:>14.2e}{diffs[1]:>12.2e}", flush=True)


if __name__ == "__main__":
    main()
