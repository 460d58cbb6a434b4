"""ORPO engine benchmark: naive vs each memory/speed technique alone vs all together, one process per variant.

Each variant (a case of bench/engine_shapes.py's suite `--shape NAME`) runs in a fresh subprocess so its
peak memory is its own: a random-init llama (mlx_lm's classes, seeded) with LoRA (rank 16, all seven
projections, orpo.train.lora.apply_lora), random token pairs of P prompt + R response tokens, W warm-up
steps, then K timed steps of value_and_grad + mx.eval (no optimizer update). Tokens are counted as the
two-forward tokens 2 * (P + R) per pair for every variant, so prefix sharing's saving shows as more
tokens/s. Peak is mx.get_peak_memory() over the timed steps; "extra" is peak minus the memory already
resident when they start (weights, adapters, inputs). Ratios are to the row's baseline measured in the
same run. `head` cases time the log-prob head alone: hidden [M, H] -> mean log-prob, gradient w.r.t. hidden.

    .venv/bin/python bench/engine.py --shape cpu-small [--json OUT.json]
    python bench/engine.py --shape h200 --json $OUT/engine.json          # on the GPU (see bench/gpu_wheels.md)
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import platform
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [p for p in (str(ROOT), str(Path(__file__).resolve().parent)) if p not in sys.path]

import mlx.core as mx
import mlx.nn as nn
from engine_shapes import (
    SUITES,
    Case,
    Shape,
    format_checks,
    format_table,
    random_pair_tokens,
    ratio_checks,
    warn_busy_device,
)

from orpo.blas import reexec_with_openblas
from orpo.config import section_defaults
from orpo.device import cuda_available, cuda_pool_memory
from orpo.train.data import Pairs

from orpo.engine.head import fused_logp, fused_logp_eager, lm_head_of
from orpo.settings import as_dict
from orpo.train.settings import EngineSettings, engine_settings, lora_settings
from orpo.train.step import PLAIN, pair_value_and_grad, resolve_engine

# Every case starts from the naive engine (not the schema's defaults, which switch techniques on), so
# "naive" is the plain path and each other case names exactly the techniques it turns on. Width multiple
# 1 = rows exactly as long as the longest sequence: MLX as a user runs it (on CUDA, the unfused attention
# backward unless the length happens to be a multiple of 128).
# compile false: a variant asks for mx.compile by name (the "-compiled" ones).
ENGINE_DEFAULTS: dict[str, Any] = {**section_defaults("train")["engine"], **PLAIN, "width_multiple": 1, "compile": False}
LORA = lora_settings({"rank": 16, "dropout": 0.0,
                      "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]})
BENCH_KEYS = ("eager", "bits")  # a case's keys of its own (not train.engine's); bits: a quantized base (QLoRA)
OVERLAY: dict[str, Any] = {}  # --engine: train.engine keys set for every case (a case's own keys win)


def engine_of(case: Case) -> EngineSettings:
    """A case's engine settings, resolved on this machine as a run resolves them."""
    e = {k: v for k, v in {**ENGINE_DEFAULTS, **OVERLAY, **case.engine}.items() if k not in BENCH_KEYS}
    return resolve_engine(engine_settings(e))
LAMBDA = 0.1
GB = 1e9


def build_model(shape: Shape, seed: int, layers: int | None = None) -> nn.Module:
    """A random-init mlx-lm llama of `shape` in its dtype (seeded), weights evaluated."""
    from mlx_lm.models import llama

    config = shape.llama_config()
    if layers is not None:
        config["num_hidden_layers"] = layers
    mx.random.seed(seed)
    model = llama.Model(llama.ModelArgs(model_type="llama", **config))
    model.set_dtype(getattr(mx, shape.dtype))
    mx.eval(model.parameters())
    return model


def random_pairs(shape: Shape, seed: int) -> Pairs:
    """`shape.pairs` random pairs (engine_shapes.random_pair_tokens); chosen and rejected share the prompt; all response tokens scored."""
    prompts, chosen, rejected = random_pair_tokens(shape, seed)
    scored = [[1] * shape.response for _ in prompts]
    return Pairs([str(i) for i in range(len(prompts))], prompts, chosen, rejected, scored, [list(m) for m in scored])


def _timed(step: Callable[[], Any], steps: int, warmup: int) -> tuple[dict[str, float], Any]:
    """(seconds per step and memory over `steps` evaluated steps after `warmup` untimed ones, the last output)."""
    for _ in range(warmup):
        mx.eval(step())
    mx.clear_cache()
    resident = mx.get_active_memory()
    mx.reset_peak_memory()
    t0 = time.perf_counter()
    for _ in range(steps):
        out = step()
        mx.eval(out)
    secs = (time.perf_counter() - t0) / steps
    peak = mx.get_peak_memory()
    return {"step_s": secs, "peak_gb": peak / GB, "extra_gb": (peak - resident) / GB, "resident_gb": resident / GB}, out


def step_inputs(case: Case, seed: int) -> tuple[nn.Module, Pairs]:
    """A step case's model (random init, quantized when the case says `bits` (QLoRA), LoRA, train mode) and its
    random pairs."""
    from orpo.train.lora import apply_lora

    model = build_model(case.shape, seed)
    if case.engine.get("bits"):  # as `mlx_lm.convert -q` does: every Linear and the embedding, groups of 64
        nn.quantize(model, group_size=64, bits=case.engine["bits"])
        mx.eval(model.parameters())
    apply_lora(model, LORA, seed)
    model.train()
    return model, random_pairs(case.shape, seed)


def run_step_case(case: Case, steps: int, warmup: int, seed: int) -> dict[str, Any]:
    """One full ORPO value_and_grad per step over the case's random pairs."""
    from orpo.engine.queue import memory_limit

    engine = engine_of(case)
    model, pairs = step_inputs(case, seed)
    with memory_limit(engine.memory_limit_gb):  # as orpo.train.session applies it
        out, ((loss, _), _) = _timed(lambda: pair_value_and_grad(model, pairs, LAMBDA, engine), steps, warmup)
    return {**out, "path": "train.step", "loss": loss.item(), "tokens_per_s": case.shape.two_forward_tokens() / out["step_s"]}


def run_head_case(case: Case, steps: int, warmup: int, seed: int) -> dict[str, Any]:
    """The head alone: M = pairs * response hidden states -> mean log-prob, gradient w.r.t. the hidden states."""
    from orpo.engine.head import mean_logps_from_logits

    engine = engine_of(case)
    shape = case.shape
    model = build_model(shape, seed, layers=1)  # only its output projection is used
    model.freeze()
    m = shape.pairs * shape.response
    key_h, key_t = mx.random.split(mx.random.key(seed))
    h = mx.random.normal((m, shape.hidden), key=key_h).astype(getattr(mx, shape.dtype))
    targets = mx.random.randint(0, shape.vocab, (m,), key=key_t)
    mx.eval(h, targets)
    if engine.head == "fused" and case.engine.get("eager"):
        # The segmented backward's head (fused_logp_eager): chunks evaluated one at a time, outside autodiff.
        head, path = lm_head_of(model), f"engine.head eager c{engine.head_chunk}"

        def eager_step() -> tuple[mx.array, mx.array]:
            logp, grad_fn = fused_logp_eager(head, h, targets, engine.head_chunk, engine.overlap)
            return logp.mean(), grad_fn(mx.full(logp.shape, 1.0 / m)).hidden

        out, (loss, _) = _timed(eager_step, steps, warmup)
        return {**out, "path": path, "loss": loss.item(), "tokens_per_s": m / out["step_s"]}
    if engine.head == "fused":
        head, path = lm_head_of(model), f"engine.head c{engine.head_chunk}"
        loss = lambda x: fused_logp(head, x, targets, engine.head_chunk).mean()
    else:
        project = model.model.embed_tokens.as_linear if shape.tied else model.lm_head
        path = "engine.head (logits)"
        loss = lambda x: mean_logps_from_logits(project(x)[None], targets[None], mx.ones((1, m)))[0]
    value_and_grad = mx.value_and_grad(loss)
    out, (loss, _) = _timed(lambda: value_and_grad(h), steps, warmup)
    return {**out, "path": path, "loss": loss.item(), "tokens_per_s": m / out["step_s"]}


def matmul_tflops(dtype: str, n: int, repeats: int = 20) -> float:
    """This device's dense matmul rate, TFLOP/s: an [n, n] x [n, n] product in `dtype`, after two warm-ups."""
    a, b = (mx.random.normal((n, n)).astype(getattr(mx, dtype)) for _ in range(2))
    for _ in range(2):
        mx.eval(a @ b)
    t0 = time.perf_counter()
    for _ in range(repeats):
        mx.eval(a @ b)
    return 2 * n**3 * repeats / (time.perf_counter() - t0) / 1e12


def probe(dtype: str, timeout: int) -> float | None:
    """matmul_tflops in a fresh subprocess (the parent holds no device memory); None where it fails."""
    n = 8192 if cuda_available() else 1024
    cmd = [sys.executable, str(Path(__file__).resolve()), "--probe", f"{dtype}:{n}"]
    try:
        proc = subprocess.run(cmd, check=False, capture_output=True, text=True, timeout=timeout, cwd=ROOT)
        return float(proc.stdout.strip().splitlines()[-1])
    except (subprocess.TimeoutExpired, ValueError, IndexError):
        return None


def write_model(shape: Shape, out: Path, seed: int, config: dict[str, Any]) -> None:
    """build_model's random-init model of `shape` as an HF-style folder (`config` is its config.json), written by a
    fresh process: MLX keeps the buffers it frees cached, so a parent that built the model would hold its device
    memory (the float32 init too) beside every run it starts."""
    spec = {"shape": shape.__dict__, "out": str(out), "seed": seed, "config": config}
    subprocess.run([sys.executable, str(Path(__file__).resolve()), "--write-model", json.dumps(spec)], check=True,
                   cwd=ROOT)


def write_model_here(spec: dict[str, Any]) -> None:
    """write_model's work, in this process."""
    from mlx_lm.utils import save_config, save_model

    out = Path(spec["out"])
    save_model(out, build_model(Shape(**spec["shape"]), spec["seed"]))
    save_config(spec["config"], out / "config.json")


def mfu(shape: dict[str, Any], prefix_sharing: bool, step_s: float | None, tflops: float | None,
        method: str = "lora") -> float | None:
    """Model FLOPs utilisation of a step over `shape`'s batch: Shape.step_flops / its time / the probed rate."""
    if not (step_s and tflops):
        return None
    return Shape(**shape).step_flops(method, prefix_sharing) / step_s / (tflops * 1e12)


def child_main(case_json: str, steps: int, warmup: int, seed: int) -> None:
    """Run one case in this process and print its result as the last line of JSON."""
    case = Case.from_json(json.loads(case_json))
    runner = run_head_case if case.kind == "head" else run_step_case
    print(json.dumps(runner(case, steps, warmup, seed)), flush=True)


def run_case(case: Case, steps: int, warmup: int, seed: int, timeout: int) -> dict[str, Any]:
    """A case's result from a fresh subprocess; a crash or timeout becomes a 'failed' note, not an exception."""
    cmd = [sys.executable, str(Path(__file__).resolve()), "--child", json.dumps(case.to_json()),
           "--steps", str(steps), "--warmup", str(warmup), "--seed", str(seed), "--engine", json.dumps(OVERLAY)]
    try:
        proc = subprocess.run(cmd, check=False, capture_output=True, text=True, timeout=timeout, cwd=ROOT)
    except subprocess.TimeoutExpired:
        return {"failed": f"timed out after {timeout} s"}
    lines = proc.stdout.strip().splitlines()
    if proc.returncode != 0 or not lines:
        tail = (proc.stderr.strip().splitlines() or ["(no output)"])[-1]
        return {"failed": f"exit {proc.returncode}: {tail[:160]}"}
    return json.loads(lines[-1])


def peer_rows(path: str, suite: str, cases: list[Case]) -> list[dict[str, Any]]:
    """Rows 'peer:NAME' from a bench/peer_liger.py --json, each against the MLX naive case of the same shape."""
    data = json.loads(Path(path).read_text())
    if data.get("suite") != suite:
        sys.exit(f"--peer {path}: measured suite {data.get('suite')!r}, this run is {suite!r}")
    if not data["environment"].get("cuda_available"):
        print(f"note: --peer {path} is a CPU smoke run (memory = max RSS, not an allocator peak): "
              "its ratios and targets compare unlike things")
    naive_of = {json.dumps(c.to_json()["shape"], sort_keys=True): c.name for c in cases
                if c.kind == "step" and not c.engine}
    rows = []
    for rec in data["cases"]:
        result = rec["result"]
        row = {"name": f"peer:{rec['name']}", "baseline": naive_of.get(json.dumps(rec["shape"], sort_keys=True)),
               "note": f"failed: {result['failed']}" if "failed" in result else None, **result}
        row["path"] = f"torch {result.get('path', '')}"[:23]
        rows.append(row)
    return rows


def environment() -> dict[str, Any]:
    """Device, versions and BLAS: what the numbers were measured on."""
    versions = {}
    for dist in ("mlx", "mlx-cuda-13", "mlx-cpu", "mlx-metal", "mlx-lm"):
        try:
            versions[dist] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            pass
    env = {"device": str(mx.default_device()), "python": platform.python_version(), "machine": platform.machine(),
           "versions": versions, "cpu_count": os.cpu_count(), "ld_preload": os.environ.get("LD_PRELOAD", "")}
    env["cuda_available"] = cuda_available()
    if env["device"].startswith("Device(gpu") and hasattr(mx, "device_info"):
        info = mx.device_info()
        env["gpu"] = info.get("device_name") or info.get("architecture")
    if env["cuda_available"]:
        mx.eval(mx.zeros(1))  # this process's context: what the device holds beyond it is another's
        used = (cuda_pool_memory() or {}).get("device_used")
        env["device_used_gb_at_start"] = None if used is None else round(used / 1e9, 3)
        warn_busy_device(env["device_used_gb_at_start"])
    return env


def _row(name: str, baseline: str | None, result: dict[str, Any]) -> dict[str, Any]:
    """A table row from a case's result: a note instead of numbers where it failed."""
    note = f"failed: {result['failed']}" if "failed" in result else None
    return {"name": name, "baseline": baseline, "note": note, **result}


def select_cases(suite_name: str, variants: str | None, dtype: str | None) -> list[Case]:
    """The suite's cases, filtered by --variants and with --dtype applied (a clear error for unknown names)."""
    from dataclasses import replace

    cases = SUITES[suite_name].cases
    if dtype:
        cases = [replace(c, shape=replace(c.shape, dtype=dtype)) for c in cases]
    if variants:
        wanted = [v.strip() for v in variants.split(",") if v.strip()]
        unknown = sorted(set(wanted) - {c.name for c in cases})
        if unknown:
            sys.exit(f"--variants: {unknown} not in suite {suite_name!r} (its variants: {', '.join(c.name for c in cases)})")
        cases = [c for c in cases if c.name in wanted]
    return cases


def measure(cases: list[Case], steps: int, warmup: int, seed: int, timeout: int,
            save: Callable[[list[dict[str, Any]]], None]) -> list[dict[str, Any]]:
    """Each case's record (its JSON form plus 'result'), one subprocess per case; progress printed and saved as it goes."""
    records = []
    for case in cases:
        result = run_case(case, steps, warmup, seed, timeout)
        row = _row(case.name, case.baseline, result)
        print(f"  {case.name}: " + (row["note"] or f"{result['tokens_per_s']:.0f} tokens/s, peak {result['peak_gb']:.3f} GB"),
              flush=True)
        records.append({**case.to_json(), "engine_resolved": {**as_dict(engine_of(case)), **case.engine},
                        "result": result})
        save(records)  # a run cut short (device time limit) still leaves the variants it finished
    return records


def report(suite_name: str, records: list[dict[str, Any]], peer: str | None, seconds: float,
           tflops: float | None = None) -> list[dict[str, Any]]:
    """Print the table (with the peer's rows and MFU when given) and the suite's targets; return the checks."""
    rows = [_row(r["name"], r["baseline"], r["result"]) for r in records]
    for row, r in zip(rows, records):
        if r["kind"] == "step":
            row["mfu"] = mfu(r["shape"], r["engine_resolved"]["prefix_sharing"] is True, row.get("step_s"), tflops)
    if peer:
        shapes = {f"peer:{c['name']}": c["shape"] for c in json.loads(Path(peer).read_text())["cases"]}
        rows += [{**row, "mfu": mfu(shapes[row["name"]], False, row.get("step_s"), tflops)}
                 for row in peer_rows(peer, suite_name, [Case.from_json(r) for r in records])]
    checks = ratio_checks(SUITES[suite_name].checks, {r["name"]: r for r in rows if not r.get("note")})
    print()
    rate = f"; MFU against {tflops:.3g} TFLOP/s measured by a matmul probe in this run" if tflops else ""
    print(format_table(rows, f"ORPO engine, suite {suite_name} ({seconds:.0f} s), ratios to each row's baseline "
                             f"(naive at the same shape){rate}"))
    if checks:
        print("targets:")
        print(format_checks(checks))
    return checks


def main() -> None:
    """Run the suite (or re-read a saved run), print the table and the target checks, optionally write --json."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", default="cpu-small", choices=sorted(SUITES), help="named suite of bench/engine_shapes.py")
    ap.add_argument("--variants", help="comma-separated case names to run (default: all of the suite)")
    ap.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], help="override the shape's dtype")
    ap.add_argument("--steps", type=int, help="timed steps per variant (default: the suite's, 3 on CPU, 10 on GPU)")
    ap.add_argument("--warmup", type=int, help="untimed steps first: graph building, allocator warm-up (default: the suite's)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--timeout", type=int, default=300, help="seconds per variant before it is reported as failed")
    ap.add_argument("--json", help="write the machine-readable results here")
    ap.add_argument("--peer", help="bench/peer_liger.py's --json of the same suite: its rows join the table and targets")
    ap.add_argument("--report", metavar="ENGINE_JSON", help="measure nothing: print the table of a saved --json run "
                                                            "(with --peer: joined with the peer's)")
    ap.add_argument("--engine", default="{}", help="train.engine keys for every case as JSON, e.g. "
                                                   "'{\"attention_backward\": \"fused\"}' (a case's own keys win)")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--probe", help=argparse.SUPPRESS)
    ap.add_argument("--write-model", help=argparse.SUPPRESS)
    a = ap.parse_args()
    OVERLAY.update(json.loads(a.engine))
    if a.write_model:
        write_model_here(json.loads(a.write_model))
        return
    if a.probe:
        dtype, n = a.probe.split(":")
        print(matmul_tflops(dtype, int(n)), flush=True)
        return
    if a.child:
        child_main(a.child, a.steps, a.warmup, a.seed)
        return
    if a.report:
        saved = json.loads(Path(a.report).read_text())
        env = saved["environment"]
        print(f"saved run {a.report}: MLX {env['versions'].get('mlx')}, device {env['device']}"
              + (f" ({env['gpu']})" if env.get("gpu") else ""))
        report(saved["suite"], saved["cases"], a.peer, saved["seconds"], env.get("matmul_tflops"))
        return
    reexec_with_openblas([], sys.argv)

    suite = SUITES[a.shape]
    a.steps = a.steps or suite.steps
    a.warmup = suite.warmup if a.warmup is None else a.warmup
    cases = select_cases(a.shape, a.variants, a.dtype)
    env = environment()
    env["matmul_tflops"] = probe(cases[0].shape.dtype, a.timeout) if cases else None
    print(f"MLX {env['versions'].get('mlx')} (mlx-lm {env['versions'].get('mlx-lm')}), device {env['device']}"
          + (f", mx.cuda.is_available() = {env['cuda_available']}" if "cuda_available" in env else "")
          + (f", {env['gpu']}" if env.get("gpu") else "") + f", Python {env['python']}, {env['cpu_count']} CPUs"
          + (", OpenBLAS preloaded" if "openblas" in env["ld_preload"].lower() else "")
          + (f", {cases[0].shape.dtype} matmul {env['matmul_tflops']:.1f} TFLOP/s" if env["matmul_tflops"] else ""),
          flush=True)
    print(f"suite {a.shape}: {len(cases)} variant(s), {a.warmup} warm-up + {a.steps} timed steps each, one process each",
          flush=True)
    t0 = time.time()

    def save(records: list[dict[str, Any]], checks: list[dict[str, Any]] | None = None) -> None:
        if a.json:
            from orpo.io import write_json

            write_json(a.json, {"bench": "engine", "suite": a.shape, "steps": a.steps, "warmup": a.warmup,
                                "seed": a.seed, "lambda": LAMBDA, "lora": as_dict(LORA), "engine": OVERLAY,
                                "environment": env, "cases": records,
                                "checks": checks, "complete": checks is not None, "seconds": time.time() - t0})

    records = measure(cases, a.steps, a.warmup, a.seed, a.timeout, save)
    checks = report(a.shape, records, a.peer, time.time() - t0, env["matmul_tflops"])
    save(records, checks)
    if a.json:
        print(f"wrote {a.json}")


if __name__ == "__main__":
    main()
