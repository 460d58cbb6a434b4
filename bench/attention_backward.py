"""Attention forward + backward alone at the engine's shapes: cuDNN's (mx.fast's autodiff), the ordered backward
through matmuls, and the fused ordered kernels (orpo.engine.flash), then each of the two kernels alone (the dQ
kernel with its log-sum-exp pass, the dK/dV kernel) at each tile size of `--tiles` (the dQ kernel's key block x
the dK/dV kernel's query block; gradients against the default tiles'). Milliseconds per call, TFLOP/s of the attention's model
FLOPs (causal: half the pairs; forward 4 x pairs x head_dim, backward twice that; the same count for the tight
prefix rows' hidden spans, our kernels', and their exclusion dims, cuDNN's forward, where those fit).

    python3 bench/attention_backward.py --json $OUT/attention-backward.json

`--candidates FILE,...` times other versions of orpo/engine/flash.py (each file defines `flash_forward` and
`flash_backward` with their signatures) beside the product's on the hidden-span rows, forward alone and forward +
backward, with their outputs' and gradients' largest relative difference from the product kernels' and whether two
runs give the same bits.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
import time
from pathlib import Path

import mlx.core as mx
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from orpo.engine import attention, flash  # noqa: E402

SHAPES = {  # (batch, heads, kv heads, length, head dim)
    "llama-1b-1024": (4, 32, 8, 1024, 64),
    "llama-1b-2048": (4, 32, 8, 2048, 64),
    "mistral-7b-1024": (4, 32, 8, 1024, 128),
    "mistral-7b-2048": (4, 32, 8, 2048, 128),
    "exclusion-1b-1536": (4, 32, 8, 1536, 72),
}


def timed(fn, args, repeats: int) -> float:
    for _ in range(3):
        mx.eval(fn(*args))
    start = time.perf_counter()
    for _ in range(repeats):
        mx.eval(fn(*args))
    return (time.perf_counter() - start) / repeats


def load_candidate(path: str):
    """A module from a file (another version of orpo/engine/flash.py)."""
    spec = importlib.util.spec_from_file_location(f"candidate_{Path(path).stem}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def run(shape: tuple, repeats: int, candidates: dict | None = None) -> dict:
    b, h, kvh, length, d = shape
    key = mx.random.key(0)
    q = mx.random.normal((b, h, length, d), key=key).astype(mx.bfloat16)
    k = mx.random.normal((b, kvh, length, d), key=mx.random.key(1)).astype(mx.bfloat16)
    v = mx.random.normal((b, kvh, length, d), key=mx.random.key(2)).astype(mx.bfloat16)
    cot = mx.random.normal((b, h, length, d), key=mx.random.key(3)).astype(mx.bfloat16)
    scale = d ** -0.5
    sdpa = mx.fast.scaled_dot_product_attention
    fits = attention.flash_fits
    # Tight prefix rows' shape: a quarter prompt, then chosen hidden from the queries after it.
    spans = mx.array([[length // 4, length * 5 // 8]] * b, mx.int32)
    bounds = attention.row_bounds(spans, length)
    # Packed rows of two such pairs (half the row each): our kernels skip the other pair's key blocks.
    half = length // 2
    segments = np.broadcast_to((np.arange(length) >= half).astype(np.int32), (b, length))
    within = np.arange(length) % half
    roles = np.broadcast_to(np.select([within < half // 4, within < half * 5 // 8], [attention.PROMPT, attention.CHOSEN],
                                      attention.REJECTED), (b, length))
    packed = mx.array(attention.packed_key_bounds(segments, roles))
    paths = {
        "cudnn": lambda q, k, v: sdpa(q, k, v, scale=scale, mask="causal"),
        "ordered-matmul": lambda q, k, v: attention.ordered_attention(q, k, v, scale, "causal"),
        "ordered-flash": lambda q, k, v: attention.ordered_attention(q, k, v, scale, "causal"),
        "flash-forward-causal": lambda q, k, v: attention.span_attention(q, k, v, scale, flash.no_bounds(b, length)),
        "flash-spans": lambda q, k, v: attention.span_attention(q, k, v, scale, bounds),
        "flash-packed-2": lambda q, k, v: attention.span_attention(q, k, v, scale, packed),
    }
    if attention.exclusion_fits(d, cuda=True):  # the same rows by the exclusion dims (cuDNN's forward)
        paths["exclusion-dims"] = lambda q, k, v: attention.attend(
            q, k, v, scale, attention.exclusion_mask(spans, length, q.dtype), ordered=True)
        mask = attention.packed_exclusion_mask(mx.array(segments), mx.array(roles), q.dtype)
        paths["exclusion-dims-packed-2"] = lambda q, k, v: attention.attend(q, k, v, scale, mask, ordered=True)
    pairs = b * h * length * (length + 1) / 2
    flops = 3 * 4 * pairs * d
    out = {"shape": dict(zip(("batch", "heads", "kv_heads", "length", "head_dim"), shape))}
    for name, f in paths.items():
        attention.flash_fits = (lambda *a: False) if name == "ordered-matmul" else fits
        fn = mx.compile(lambda q, k, v, f=f: mx.vjp(f, [q, k, v], [cot]))
        mx.reset_peak_memory()
        sec = timed(fn, (q, k, v), repeats)
        out[name] = {"ms": round(sec * 1e3, 3), "tflops": round(flops / sec / 1e12, 1),
                     "peak_gb": round(mx.get_peak_memory() / 1e9, 2)}
        print(name, shape, out[name], flush=True)
    attention.flash_fits = fits
    forward_alone = lambda fwd: fwd(q, k, v, scale, True, spans)  # noqa: E731
    out["flash-forward-alone"] = {"ms": round(timed(forward_alone, (flash.flash_forward,), repeats) * 1e3, 3)}
    print("flash-forward-alone", shape, out["flash-forward-alone"], flush=True)
    product = attention.flash_forward, attention.flash_backward

    def spans_vjp():  # a new function each time, so mx.compile traces whichever kernels are installed now
        return mx.compile(lambda q, k, v: mx.vjp(paths["flash-spans"], [q, k, v], [cot]))

    def outputs_and_grads() -> list[mx.array]:
        outputs, grads = spans_vjp()(q, k, v)
        return [*outputs, *grads]

    want = outputs_and_grads()
    for name, module in (candidates or {}).items():
        attention.flash_forward, attention.flash_backward = module.flash_forward, module.flash_backward
        try:
            fn = spans_vjp()
            mx.reset_peak_memory()
            sec = timed(fn, (q, k, v), repeats)
            first, second = outputs_and_grads(), outputs_and_grads()
            diff = max((mx.abs(g.astype(mx.float32) - w.astype(mx.float32)).max()
                        / mx.abs(w.astype(mx.float32)).max()).item() for g, w in zip(first, want))
            row = {"ms": round(sec * 1e3, 3), "tflops": round(flops / sec / 1e12, 1),
                   "peak_gb": round(mx.get_peak_memory() / 1e9, 2), "max_relative_difference": diff,
                   "forward_alone_ms": round(timed(forward_alone, (module.flash_forward,), repeats) * 1e3, 3),
                   "same_bits": all(mx.array_equal(a, b).item() for a, b in zip(first, want)),
                   "same_bits_twice": all(mx.array_equal(a, b).item() for a, b in zip(first, second))}
        except Exception as e:  # a candidate that does not compile or launch is a result, not the end of the run
            row = {"error": f"{type(e).__name__}: {e}"[:2000]}
        finally:
            attention.flash_forward, attention.flash_backward = product
        out[f"candidate:{name}"] = row
        print(f"candidate:{name}", shape, row, flush=True)
    return out


def tile_sweep(shape: tuple, tiles: list[tuple[int, int]], repeats: int) -> dict:
    """kernels_alone at each (dQ key block, dK/dV query block), and the largest relative difference of the three
    gradients from those of the default tiles (the sums' order within a block moves the last bits)."""
    b, h, kvh, length, d = shape
    q, k, v, cot = (mx.random.normal(s, key=mx.random.key(i)).astype(mx.bfloat16) for i, s in
                    enumerate(((b, h, length, d), (b, kvh, length, d), (b, kvh, length, d), (b, h, length, d))))
    delta = mx.random.normal((b, h, length))
    default = (flash.DQ_KEYS, flash.KV_ROWS)
    want = None
    out = {}
    for dq_keys, kv_rows in [default] + [t for t in tiles if t != default]:
        flash.DQ_KEYS, flash.KV_ROWS = dq_keys, kv_rows
        flash._kernels.cache_clear()
        got = flash.flash_backward(q, k, v, d ** -0.5, True, cot, delta)
        mx.eval(got)
        want = want or got
        diff = max((mx.abs(g.astype(mx.float32) - w.astype(mx.float32)).max()
                    / mx.abs(w.astype(mx.float32)).max()).item() for g, w in zip(got, want))
        row = {"max_relative_difference": diff, **kernels_alone(q, k, v, cot, d ** -0.5, repeats)}
        out[f"{dq_keys}x{kv_rows}"] = row
        print("tiles", f"{dq_keys}x{kv_rows}", shape, row, flush=True)
    flash.DQ_KEYS, flash.KV_ROWS = default
    flash._kernels.cache_clear()
    return out


def kernels_alone(q, k, v, cot, scale: float, repeats: int) -> dict:
    """Each flash kernel's time on its own (inputs evaluated first; the dK/dV kernel given the dQ kernel's lse)."""
    d = -(-q.shape[-1] // 16) * 16  # as flash_backward pads it
    q, k, v, cot = (flash.pad_head_dim(x, d) for x in (q, k, v, cot))
    delta = mx.random.normal(q.shape[:3])
    scale_arr, spans = mx.array([scale], mx.float32), flash.no_bounds(q.shape[0], q.shape[2])
    lse = flash.dq_and_lse(q, k, v, cot, delta, spans, scale_arr, True)[1]
    mx.eval(lse, delta, q, k, v, cot)
    out = {}
    for name, call in (("flash-dq-kernel", lambda: flash.dq_and_lse(q, k, v, cot, delta, spans, scale_arr, True)),
                       ("flash-dkv-kernel",
                        lambda: flash.dk_and_dv(q, k, v, cot, delta, lse, spans, scale_arr, True))):
        out[name] = {"ms": round(timed(call, (), repeats) * 1e3, 3)}
        print(name, tuple(q.shape), out[name], flush=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--tiles", default="32x32,64x32,32x16,32x64,64x64",
                    help="tile sizes to sweep (dQ key block x dK/dV query block), comma-separated; '' for none")
    ap.add_argument("--candidates", default="", help="other versions of orpo/engine/flash.py to time, comma-separated")
    ap.add_argument("--json")
    a = ap.parse_args()
    candidates = {Path(p).stem: load_candidate(p) for p in a.candidates.split(",") if p}
    tiles = [tuple(map(int, t.split("x"))) for t in a.tiles.split(",") if t]
    rows = []
    for s in a.shapes.split(","):
        rows.append({**run(SHAPES[s], a.repeats, candidates),
                     "tiles": tile_sweep(SHAPES[s], tiles, a.repeats) if tiles else {}})
        if a.json:  # after every shape: a run cut short by a time limit keeps what it measured
            Path(a.json).write_text(json.dumps({"mlx": mx.__version__, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
