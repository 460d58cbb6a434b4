"""Where the trainer's step spends the GPU's time: each kernel's duration over whole `orpo train` steps (CUDA).

The step is the product's (orpo.train.session's Session.step: every micro-batch's forward and backward,
accumulation, clipping and the update), on UltraFeedback-like pairs at a real geometry, under the run's memory
policy as `orpo train` sets it. The child runs `--warm` steps, then `--steps` steps under CUPTI's activity trace
(torch's profiler, CUDA only: it records every kernel of the process, MLX's included, at its own duration,
without serializing launches as Nsight Compute does: ncu's replay of 8 warm 1B steps and one profiled did not
finish in 180 s on an H100). The same steps' wall time is measured in a run without the trace (CUDA graphs off in
both: the trace then sees each kernel), so the table shows the kernels' sum against the wall: the rest is the GPU
waiting on the host. Kernels are grouped by name into kinds (matmul, attention, ...), the largest listed, and the
longest gaps between consecutive kernels are named by the kernels on either side.

    python3 bench/kernel_times.py --geometry h200 --pairs 512 --warm 12 --steps 2 --json $OUT/kernels.json
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [p for p in (str(ROOT), str(Path(__file__).resolve().parent)) if p not in sys.path]

# Kinds of kernels, first match wins (names as MLX, cuBLAS, cuDNN and the engine's own kernels give them).
KINDS = [
    ("attention (the engine's kernels)", r"orpo_flash"),
    ("attention (cuDNN)", r"cudnn|sdpa|flash|fmha|attention"),
    ("matmul", r"gemm|nvjet|cutlass|xmma|sm90_|cublas|matmul"),
    ("copy", r"copy|Copy|gather|scatter|slice|concat|transpose"),
    ("reduction", r"reduce|Reduce|row_reduce|col_reduce|all_reduce|sum|logsumexp|softmax|arg"),
    ("norm / rope", r"rms|layer_norm|rope|RMS|Rope"),
    ("fused elementwise", r"[Cc]ompiled|fused"),
    ("elementwise", r"unary|binary|ternary|Unary|Binary|Ternary|elementwise"),
]


def kind_of(name: str) -> str:
    for kind, pattern in KINDS:
        if re.search(pattern, name):
            return kind
    return "other"


def child(job: dict[str, Any]) -> None:
    """Warm steps, then the profiled steps; their wall times as JSON on the last line."""
    import mlx.core as mx

    from orpo.train.session import build_session
    from orpo.train.settings import train_settings
    from orpo.train.trainer import bounded_memory

    sess = build_session(job["model"], job["rendered"], train_settings(job["settings"]))
    trace = None
    if job.get("trace"):
        from torch.profiler import ProfilerActivity, profile

        trace = profile(activities=[ProfilerActivity.CUDA])
    walls = []
    with bounded_memory(sess) as cache:
        for step in range(1, job["warm"] + job["steps"] + 1):
            if step == job["warm"] + 1:
                mx.synchronize()
                if trace:
                    trace.start()
            t0 = time.perf_counter()
            sess.step(step)
            mx.synchronize()
            walls.append(time.perf_counter() - t0)
            cache.update(step)
    if trace:
        trace.stop()
        trace.export_chrome_trace(job["trace"])
    print(json.dumps({"profiled_wall_s": walls[job["warm"]:], "engine": dataclasses.asdict(sess.engine)}))


def summarize(rows: list[tuple[str, float, float]], wall_s: float, top: int) -> dict[str, Any]:
    """Kernel time per kind and per name, and where the GPU sat idle between kernels (rows: name, start, seconds)."""
    total = sum(t for _, _, t in rows)
    kinds: dict[str, float] = defaultdict(float)
    names: dict[str, list[float]] = defaultdict(list)
    for name, _, t in rows:
        kinds[kind_of(name)] += t
        names[name].append(t)
    largest = sorted(names.items(), key=lambda kv: -sum(kv[1]))[:top]
    ordered = sorted(rows, key=lambda r: r[1])
    gaps = [(b[1] - a[1] - a[2], a[0], b[0]) for a, b in zip(ordered, ordered[1:])]
    return {"kernels": len(rows), "kernel_s": total, "wall_s": wall_s, "gpu_busy": total / wall_s if wall_s else None,
            "idle_s": sum(g for g, _, _ in gaps if g > 0), "idle_over_1ms_s": sum(g for g, _, _ in gaps if g > 1e-3),
            "kinds": {k: {"s": v, "share": v / total} for k, v in sorted(kinds.items(), key=lambda kv: -kv[1])},
            "largest": [{"name": n[:160], "kind": kind_of(n), "calls": len(ts), "s": sum(ts),
                         "mean_us": 1e6 * sum(ts) / len(ts)} for n, ts in largest],
            "longest_idle": [{"s": g, "after": a[:100], "before": b[:100]} for g, a, b in sorted(gaps)[::-1][:10]]}


def read_chrome_trace(text: str) -> list[tuple[str, float, float]]:
    """(kernel name, start, duration) in seconds per launch from torch's profiler's Chrome trace (its events of
    category "kernel", in us)."""
    events = json.loads(text).get("traceEvents", [])
    return [(e.get("name", "?"), float(e["ts"]) * 1e-6, float(e["dur"]) * 1e-6) for e in events
            if e.get("cat") == "kernel" and "dur" in e]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--geometry", default="h200")
    ap.add_argument("--pairs", type=int, default=512)
    ap.add_argument("--warm", type=int, default=12, help="steps before the profiled ones (traces and cache settle)")
    ap.add_argument("--steps", type=int, default=2, help="profiled steps")
    ap.add_argument("--engine", default="{}", help="train.engine keys (JSON) over the defaults")
    ap.add_argument("--top", type=int, default=40)
    ap.add_argument("--timeout", type=int, default=500)
    ap.add_argument("--work", help="folder for the model and data (default: a temporary one)")
    ap.add_argument("--json")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        child(json.loads(a.child))
        return
    from engine_shapes import ultrafeedback_lengths
    from trainer import GEOMETRIES, settings_for, write_model, write_rendered

    shape = GEOMETRIES[a.geometry]
    work = Path(a.work or tempfile.mkdtemp(prefix="orpo-kernels-"))
    model, rendered = work / "model", work / "rendered"
    if not (model / "config.json").exists():
        write_model(shape, model, 0)
    write_rendered(rendered, ultrafeedback_lengths(a.pairs, 1), shape.vocab, 2)
    job = {"model": str(model), "rendered": str(rendered), "warm": a.warm, "steps": a.steps,
           "settings": settings_for(4, 8, a.warm + a.steps, json.loads(a.engine))}
    env = {**os.environ, "MLX_USE_CUDA_GRAPHS": "0"}
    me = [sys.executable, str(Path(__file__).resolve()), "--child", json.dumps(job)]
    plain = subprocess.run(me, capture_output=True, text=True, timeout=a.timeout, cwd=ROOT, env=env)
    if plain.returncode:
        sys.exit(f"the step failed: {plain.stderr[-2000:]}")
    timed = json.loads(plain.stdout.strip().splitlines()[-1])
    t0 = time.perf_counter()
    report = work / "trace.json"
    traced = subprocess.run([*me[:-1], json.dumps({**job, "trace": str(report)})], capture_output=True, text=True,
                            timeout=a.timeout, cwd=ROOT, env=env)
    rows = read_chrome_trace(report.read_text()) if report.exists() else []
    if not rows:
        sys.exit(f"the trace holds no kernels (exit {traced.returncode}): {traced.stderr[-2000:]}{traced.stdout[-2000:]}")
    result = {"geometry": a.geometry, "pairs": a.pairs, "warm": a.warm, "steps": a.steps, "engine": timed["engine"],
              "trace_s": time.perf_counter() - t0,
              "traced_wall_s": json.loads(traced.stdout.strip().splitlines()[-1])["profiled_wall_s"],
              **summarize(rows, sum(timed["profiled_wall_s"]), a.top)}
    if a.json:
        Path(a.json).write_text(json.dumps(result, indent=1))
    print(f"{a.geometry}, {a.steps} steps: wall {result['wall_s']:.3f} s (graphs off), kernels "
          f"{result['kernel_s']:.3f} s in {result['kernels']} launches (GPU busy {result['gpu_busy']:.0%}; idle "
          f"{result['idle_s']:.3f} s between kernels, {result['idle_over_1ms_s']:.3f} s of it in gaps over 1 ms)")
    for k, v in result["kinds"].items():
        print(f"  {k:36s} {v['s']:8.3f} s  {v['share']:6.1%}")
    for x in result["largest"]:
        print(f"  {x['s']:8.4f} s  {x['calls']:6d} x {x['mean_us']:9.1f} us  [{x['kind']}] {x['name'][:110]}")


if __name__ == "__main__":
    main()
