"""Where the trainer's step spends the GPU's time: each kernel's duration over whole `orpo train` steps (CUDA).

The step is the product's (orpo.train.session's Session.step: every micro-batch's forward and backward,
accumulation, clipping and the update), on UltraFeedback-like pairs at a real geometry, under the run's memory
policy as `orpo train` sets it. The child runs `--warm` steps, then `--steps` steps between cuProfilerStart and
cuProfilerStop; Nsight Compute (`ncu --profile-from-start off`, one metric: gpu__time_duration) times each
kernel launched in between. The same steps' wall time is measured in a run without ncu (CUDA graphs off in
both: ncu then sees each kernel), so the table shows the kernels' sum against the wall: the rest is the GPU
waiting on the host. Kernels are grouped by name into kinds (matmul, attention, ...), the largest listed.

    python3 bench/kernel_times.py --geometry h200 --pairs 512 --warm 12 --steps 2 --json $OUT/kernels.json
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import gzip
import io
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


def profiler(start: bool) -> None:
    import ctypes

    try:
        cuda = ctypes.CDLL("libcuda.so.1")
    except OSError:  # no CUDA driver: nothing to profile (the child still times its steps)
        return
    rc = cuda.cuProfilerStart() if start else cuda.cuProfilerStop()
    if rc:
        print(f"cuProfiler{'Start' if start else 'Stop'}: {rc}", file=sys.stderr)


def child(job: dict[str, Any]) -> None:
    """Warm steps, then the profiled steps; their wall times as JSON on the last line."""
    import mlx.core as mx

    from orpo.train.session import build_session
    from orpo.train.settings import train_settings
    from orpo.train.trainer import bounded_memory

    sess = build_session(job["model"], job["rendered"], train_settings(job["settings"]))
    walls = []
    with bounded_memory(sess) as cache:
        for step in range(1, job["warm"] + job["steps"] + 1):
            if step == job["warm"] + 1:
                mx.synchronize()
                profiler(True)
            t0 = time.perf_counter()
            sess.step(step)
            mx.synchronize()
            walls.append(time.perf_counter() - t0)
            cache.update(step)
        profiler(False)
    print(json.dumps({"profiled_wall_s": walls[job["warm"]:], "engine": dataclasses.asdict(sess.engine)}))


def summarize(rows: list[tuple[str, float]], wall_s: float, top: int) -> dict[str, Any]:
    total = sum(t for _, t in rows)
    kinds: dict[str, float] = defaultdict(float)
    names: dict[str, list[float]] = defaultdict(list)
    for name, t in rows:
        kinds[kind_of(name)] += t
        names[name].append(t)
    largest = sorted(names.items(), key=lambda kv: -sum(kv[1]))[:top]
    return {"kernels": len(rows), "kernel_s": total, "wall_s": wall_s, "gpu_busy": total / wall_s if wall_s else None,
            "kinds": {k: {"s": v, "share": v / total} for k, v in sorted(kinds.items(), key=lambda kv: -kv[1])},
            "largest": [{"name": n[:160], "kind": kind_of(n), "calls": len(ts), "s": sum(ts),
                         "mean_us": 1e6 * sum(ts) / len(ts)} for n, ts in largest]}


def read_ncu_csv(text: str) -> list[tuple[str, float]]:
    """(kernel name, seconds) per launch from ncu's CSV (its details page: one row per kernel and metric)."""
    start = text.find('"ID"')
    rows = []
    for r in csv.DictReader(io.StringIO(text[start:])):
        if r.get("Metric Name") != "gpu__time_duration.sum":
            continue
        scale = {"nsecond": 1e-9, "ns": 1e-9, "usecond": 1e-6, "us": 1e-6, "msecond": 1e-3, "ms": 1e-3}.get(
            r.get("Metric Unit", "nsecond"), 1e-9)
        rows.append((r.get("Kernel Name") or r.get("Function Name") or "?",
                     float(r["Metric Value"].replace(",", "")) * scale))
    return rows


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
    report = work / "ncu.csv"
    ncu = ["ncu", "--profile-from-start", "off", "--clock-control", "none", "--metrics", "gpu__time_duration.sum",
           "--csv", "--print-units", "base", "--log-file", str(report), *me]
    t0 = time.perf_counter()
    profiled = subprocess.run(ncu, capture_output=True, text=True, timeout=a.timeout, cwd=ROOT, env=env)
    rows = read_ncu_csv(report.read_text()) if report.exists() else []
    if not rows:
        sys.exit(f"ncu gave no kernels (exit {profiled.returncode}): {profiled.stderr[-2000:]}{profiled.stdout[-2000:]}")
    result = {"geometry": a.geometry, "pairs": a.pairs, "warm": a.warm, "steps": a.steps, "engine": timed["engine"],
              "ncu_s": time.perf_counter() - t0, **summarize(rows, sum(timed["profiled_wall_s"]), a.top)}
    if a.json:
        Path(a.json).write_text(json.dumps(result, indent=1))
        Path(a.json).with_suffix(".csv.gz").write_bytes(gzip.compress(report.read_bytes()))
    print(f"{a.geometry}, {a.steps} steps: wall {result['wall_s']:.3f} s (graphs off), kernels "
          f"{result['kernel_s']:.3f} s in {result['kernels']} launches (GPU busy {result['gpu_busy']:.0%})")
    for k, v in result["kinds"].items():
        print(f"  {k:36s} {v['s']:8.3f} s  {v['share']:6.1%}")
    for x in result["largest"]:
        print(f"  {x['s']:8.4f} s  {x['calls']:6d} x {x['mean_us']:9.1f} us  [{x['kind']}] {x['name'][:110]}")


if __name__ == "__main__":
    main()
