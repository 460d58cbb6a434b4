"""The product's training speed and memory: the real `orpo train` on fixed and on real-length data.

Each case writes a random-init HF model folder of a real geometry (mlx-lm's llama classes, seeded) and
rendered pairs in the render stage's parquet schema (random token ids), then runs `orpo train` as a user
does (`python -m orpo.cli train --settings @file`: its loader, length-cut micro-batches, compiled step and
update, validation, checkpoints) and reads its metrics.jsonl and index.json. The steady step is the median
of the per-step times after the first `--skip` steps (compilation, allocator warm-up); tokens/s are over
those steps, counted three ways: scored response tokens, the tokens the rows hold (a shared prompt once)
and two-forward tokens (2 x prompt + chosen + rejected per pair, as bench/engine.py counts them).

Cases (the lengths of `--lengths`):
  fixed          every pair P + R + R tokens (the engine bench's shape), batch 4
  fixed-2048     every pair 1024 + 1024 + 1024 tokens (prompt + response = 2048, the ORPO paper's longest pair),
                 batch `--long-batch` (default 4)
  ultrafeedback  prompt, chosen and rejected lengths drawn independently from log-normals with medians 150,
                 300, 300 tokens (sigma 0.8), clipped to 40-700 and 60-800: one epoch of `--pairs` pairs,
                 batch 4 x grad_accum 8 (32 pairs per optimizer step, as the ORPO paper's recipe)
  mean           every pair at the ultrafeedback draw's mean lengths, batch 4 x grad_accum 8: the fixed-shape
                 speed "at the same mean token count" that ultrafeedback is compared with
Beside fixed and mean, `bench/engine.py`'s step (value_and_grad + eval, no update) with the engine's
defaults on this machine, at the same shape, in its own process. `--profile` times the phases of the
trainer's step one at a time (each followed by mx.eval) on the fixed shape.

`--method full` trains every weight (train.method full: bf16 compute, float32 master weights and moments)
instead of LoRA rank 16 on the seven projections, at lr 5e-6; the engine bench and the profile are LoRA's and
are skipped, and each run's model folder is deleted once its numbers are read (at 7B: 14.5 GB each, on a
machine of 64 GB of disk). Each case also reports the trainer's predicted peak beside its measured one.
`--dtype` overrides the geometry's dtype (bfloat16 on the CPU exercises the float32 masters). At the Mistral-7B
geometry the weights, gradients, masters and moments alone are 115.9 GB (16 bytes a parameter), so the
whole-graph backward's activations do not fit beside them on one H200: the trainer's memory plan segments the
backward (and chunks the MLP) and prints its prediction; it warns when that passes the device.

    .venv/bin/python bench/trainer.py --geometry cpu-small --json /tmp/trainer.json
    python bench/trainer.py --geometry h200 --json $OUT/trainer-h200.json         # on the GPU (bench/gpu_wheels.md)
    python bench/trainer.py --geometry mistral-7b --lengths fixed --json $OUT/trainer-7b.json
    python bench/trainer.py --geometry mistral-7b --method full --lengths fixed,fixed-2048 --steps 20 \
        --engine '{"segment_layers": 1, "mlp_chunks": 4}' --json $OUT/full-7b.json
    .venv/bin/python bench/trainer.py --geometry cpu-small --method full --dtype bfloat16 --lengths fixed --steps 5
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [p for p in (str(ROOT), str(Path(__file__).resolve().parent)) if p not in sys.path]

from engine_shapes import (  # noqa: E402
    CPU_SMALL, LLAMA_1B, MISTRAL_7B, SIGMA, ULTRAFEEDBACK, Case, Shape, real_length_mfu, ultrafeedback_lengths)

GEOMETRIES = {"h200": LLAMA_1B, "mistral-7b": MISTRAL_7B, "cpu-small": CPU_SMALL}
LORA = {"rank": 16, "alpha": 32, "dropout": 0.0,
        "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]}
GB = 1e9


def write_rendered(out: Path, lengths: list[tuple[int, int, int]], vocab: int, seed: int, validation: int = 8) -> None:
    """train.parquet and validation.parquet in the render stage's schema: random ids, every response token scored."""
    import numpy as np
    import polars as pl

    rng = np.random.default_rng(seed)
    out.mkdir(parents=True, exist_ok=True)

    def frame(rows: list[tuple[int, int, int]], prefix: str) -> pl.DataFrame:
        ids = lambda k: rng.integers(3, vocab, k).tolist()  # noqa: E731
        p, c, r = ([ids(x[i]) for x in rows] for i in range(3))
        return pl.DataFrame({"id": [f"{prefix}{i}" for i in range(len(rows))], "prompt_ids": p, "chosen_ids": c,
                             "rejected_ids": r, "chosen_mask": [[1] * len(x) for x in c],
                             "rejected_mask": [[1] * len(x) for x in r], "prompt_len": [len(x) for x in p],
                             "chosen_len": [len(x) for x in c], "rejected_len": [len(x) for x in r]})

    frame(lengths, "t").write_parquet(out / "train.parquet")
    frame(lengths[:validation], "v").write_parquet(out / "validation.parquet")


def write_model(shape: Shape, out: Path, seed: int) -> None:
    """bench/engine.py's random-init llama of the geometry, as an HF-style folder mlx-lm loads (no tokenizer needed),
    written by a fresh process (engine.write_model)."""
    import engine

    config = {"model_type": "llama", **shape.llama_config(), "max_position_embeddings": 8192}
    engine.write_model(shape, out, seed, config)


def settings_for(batch: int, accum: int, steps: int, engine: dict[str, Any], method: str = "lora",
                 epochs: int = 1) -> dict[str, Any]:
    """The train settings of a case: LoRA rank 16 on the seven projections (or every weight, `method` full, at the
    ORPO paper's lr 5e-6), one checkpoint at the end, every step flushed to metrics.jsonl (so a run cut short still
    reports its steps)."""
    trains = {"lora": LORA} if method == "lora" else {"method": "full", "lr": 5e-6}
    return {"lr": 1e-5, "batch_size": batch, "grad_accum": accum, "epochs": epochs, "max_steps": steps,
            "checkpoint_every": 0, "log_every": 1, "warmup": 0, **trains, "engine": engine}


def steady(lines: list[dict[str, Any]], skip: int) -> dict[str, Any]:
    """Step time and rates over the train lines after the first `skip` steps."""
    train = [x for x in lines if x.get("split") == "train"]
    times = [b["elapsed_s"] - a["elapsed_s"] for a, b in zip(train, train[1:])][skip:]
    kept = train[skip + 1:]
    if not times:
        return {"failed": f"only {len(train)} steps: nothing after the first {skip}"}
    seconds = sum(times)
    sums = {k: sum(x[k] for x in kept) for k in ("tokens", "row_tokens", "two_forward_tokens", "positions")}
    return {"steps": len(train), "timed_steps": len(times), "step_s": statistics.median(times),
            "mean_step_s": seconds / len(times),
            "tokens_per_s": sums["tokens"] / seconds, "row_tokens_per_s": sums["row_tokens"] / seconds,
            "two_forward_tokens_per_s": sums["two_forward_tokens"] / seconds,
            "padding": 1 - sums["row_tokens"] / max(sums["positions"], 1),
            "peak_gb": max(x["peak_memory_mb"] for x in train) * 2**20 / GB,
            "cache_gb": max(x["cache_memory_mb"] for x in train) * 2**20 / GB,
            "active_plus_cache_gb": max(x["active_memory_mb"] + x["cache_memory_mb"] for x in train) * 2**20 / GB,
            # CUDA: what the pool MLX allocates from holds (beyond MLX's active and cached buffers, freed memory kept)
            "pool_reserved_gb": max((x.get("pool_reserved_mb") or 0) for x in train) * 2**20 / GB or None,
            "device_used_gb": max((x.get("device_used_mb") or 0) for x in train) * 2**20 / GB or None,
            "segmented_micro_batches": sum(x.get("segmented", 0) for x in train),
            "loss_first": train[0]["loss"], "loss_last": train[-1]["loss"]}


def run_train(model: Path, rendered: Path, out: Path, settings: dict[str, Any], timeout: int,
              skip: int, env: dict[str, str] | None = None) -> dict[str, Any]:
    """`orpo train` in a fresh process, as the workflow runs it (with `env` added to its environment); its
    steady-state numbers from its own files.

    A run that fails or times out still reports the steps it logged (from its `.partial` folder).
    """
    settings_file = out.parent / f"{out.name}.settings.json"
    settings_file.write_text(json.dumps(settings))
    cmd = [sys.executable, "-m", "orpo.cli", "train", "--model", str(model), "--rendered", str(rendered),
           "--out", str(out), "--settings", f"@{settings_file}"]
    t0 = time.perf_counter()
    failed, stderr = None, ""
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=ROOT,
                              env={**os.environ, **(env or {})})
        stderr = proc.stderr
        if proc.returncode != 0:
            failed = f"exit {proc.returncode}: {(proc.stderr.strip().splitlines() or ['(no output)'])[-1][:200]}"
    except subprocess.TimeoutExpired as e:
        failed, stderr = f"timed out after {timeout} s", (e.stderr or b"").decode(errors="replace")
    wall = time.perf_counter() - t0
    folder = out if failed is None else out.with_name(out.name + ".partial")
    metrics = folder / "metrics.jsonl"
    lines = [json.loads(x) for x in metrics.read_text().splitlines() if x.strip()] if metrics.exists() else []
    train = [x for x in lines if x.get("split") == "train"]
    series = {k: [x[k] for x in train] for k in ("elapsed_s", "new_shapes", "segmented", "positions", "row_tokens",
                                                 "active_memory_mb", "cache_memory_mb", "peak_memory_mb",
                                                 "pool_reserved_mb", "pool_used_mb", "device_used_mb")
              if train and k in train[0]}
    result: dict[str, Any] = {"wall_s": wall, "series": series}
    if failed:
        result["failed"], result["stderr_tail"] = failed, stderr[-3000:]
    if len(train) > skip + 1:
        result.update(steady(lines, skip))
        result["shapes"] = train[-1].get("shapes")
        result.update(shape_costs(train, skip))
    epochs = settings.get("epochs", 1)
    if epochs > 1 and len(train) >= 2 * epochs:  # the last epoch alone: the shapes met before are traced
        before = len(train) - len(train) // epochs - 1
        result["last_epoch"] = {**steady(lines, before), **shape_costs(train, before)}
    warnings = [x for x in stderr.splitlines() if "thrash" in x.lower() or "warning" in x.lower()]
    if warnings:
        result["warnings"] = warnings[:20]
    if failed is None:
        run = json.loads((out / "index.json").read_text()).get("run", {})
        result.update({"traces": run.get("traces"), "memory": run.get("memory"),
                       "memory_predicted": run.get("memory_predicted"),
                       "engine_resolved": json.loads((out / "settings.json").read_text())["resolved"]["settings"]["engine"]})
    if settings.get("method") == "full":  # its weights are the model's size: gone once read
        for folder in (out, out.with_name(out.name + ".partial")):
            shutil.rmtree(folder, ignore_errors=True)
    return result


def shape_costs(train: list[dict[str, Any]], skip: int) -> dict[str, Any]:
    """Median time of steps that met a new padded shape (a new compiled trace) and of those that did not."""
    if "new_shapes" not in train[0]:
        return {}
    new, old = [], []
    for a, b in zip(train[skip:], train[skip + 1:]):
        (new if b["new_shapes"] else old).append(b["elapsed_s"] - a["elapsed_s"])
    return {"steps_with_new_shapes": len(new), "new_shape_step_s": statistics.median(new) if new else None,
            "known_shape_step_s": statistics.median(old) if old else None,
            "seconds_in_new_shape_steps": sum(new)}


def engine_bench(shape: Shape, timeout: int) -> dict[str, Any]:
    """bench/engine.py's step at `shape` with the engine's defaults as this machine resolves them."""
    from engine import run_case

    from orpo.config import section_defaults

    case = Case("trainer-default", shape, engine=dict(section_defaults("train")["engine"]))
    suite_steps, warmup = (10, 3) if shape.dtype == "bfloat16" else (3, 1)
    return run_case(case, suite_steps, warmup, 0, timeout)


def profile(model: Path, rendered: Path, settings: dict[str, Any], steps: int) -> dict[str, float]:
    """Milliseconds per phase of the trainer's step (median over steps), each phase followed by mx.eval."""
    import mlx.core as mx
    import mlx.optimizers as optim

    from orpo.train.session import build_session
    from orpo.train.settings import train_settings
    from orpo.train.step import batch_value_and_grad, pair_value_and_grad

    sess = build_session(model, rendered, train_settings(settings))
    params = lambda: sess.model.trainable_parameters()  # noqa: E731
    clip = mx.compile(lambda g: optim.clip_grad_norm(g, 1.0)[1])
    times: dict[str, list[float]] = {}

    def timed(name: str, fn: Any, device: bool = True) -> Any:
        """fn()'s result; its time (with mx.eval of the result when it is device work) recorded under name."""
        t0 = time.perf_counter()
        out = fn()
        if device:
            mx.eval(out)
        times.setdefault(name, []).append(1000 * (time.perf_counter() - t0))
        return out

    per_matrix = optim.AdamW(1e-5)  # mlx's AdamW, one update per weight matrix, on a copy of the weights
    per_matrix.init(params())
    per_matrix_compiled = mx.compile(lambda g, w: per_matrix.apply_gradients(optim.clip_grad_norm(g, 1.0)[0], w),
                                     inputs=[per_matrix.state], outputs=[per_matrix.state])

    def eager_update(grads: Any) -> Any:  # per matrix and uncompiled: clip, read the norm, update
        grads, norm = optim.clip_grad_norm(grads, 1.0)
        mx.eval(norm)
        norm.item()
        return per_matrix.apply_gradients(grads, params()), per_matrix.state

    for step in range(1, steps + 1):
        batches = timed("host: rows of the step (prepare)", lambda: sess.prepare(step), device=False)
        timed("host: dropout keys", lambda: sess.keys.at(step, 0), device=False)
        (_, metrics), grads = timed("forward + backward", lambda: batch_value_and_grad(
            sess.model, batches[0], sess.s.lambda_, sess.engine))
        timed("clip alone (compiled)", lambda: clip(grads))
        timed("clip + update, flat and compiled (the trainer's)", lambda: [sess.update_fn()(grads), sess.opt.state])
        timed("clip + update, per matrix, compiled", lambda: [per_matrix_compiled(grads, params()), per_matrix.state])
        timed("clip + read + update, per matrix, uncompiled", lambda: eager_update(grads))
        timed("metrics read", lambda: [v.item() for v in metrics.values()], device=False)
        timed("log line", lambda: json.dumps({k: round(v.item(), 6) for k, v in metrics.items()}), device=False)
        timed("engine bench's step (pack + value_and_grad)", lambda: pair_value_and_grad(
            sess.model, sess.train.select(sess.micro_batches(step)[0]), sess.s.lambda_, sess.engine))
        timed("whole step, serial (prepare, run, read)", lambda: sess.run(step, sess.prepare(step)).read(), device=False)

        def overlapped() -> dict[str, float]:
            started = sess.run(step, batches)
            sess.prepare(step + 1)  # what the loop does while the device runs the step
            return started.read()

        timed("whole step, next rows prepared while it runs (the trainer's loop)", overlapped, device=False)
    skip = min(2, steps - 1)
    return {name: statistics.median(v[skip:]) for name, v in times.items()}


def new_shape_costs(model: Path, rendered: Path, settings: dict[str, Any], count: int) -> list[dict[str, Any]]:
    """What meeting a new padded shape costs: for the first `count` distinct micro-batch shapes of the epoch, the
    step's first and second evaluation, cuDNN-style attention alone (forward and backward) at that width, first
    and second, and how many device kernels were compiled meanwhile (files added to MLX's PTX cache)."""
    import glob

    import mlx.core as mx

    from orpo.train.session import build_session
    from orpo.train.settings import train_settings
    from orpo.train.step import batch_value_and_grad

    sess = build_session(model, rendered, train_settings(settings))
    ptx = lambda: sum(len(os.listdir(d)) for d in glob.glob(os.path.join(tempfile.gettempdir(), "mlx", "*", "ptx")))  # noqa: E731
    args = sess.model.args
    heads, dim = args.num_attention_heads, args.hidden_size // args.num_attention_heads

    def timed(fn: Any) -> float:
        t0 = time.perf_counter()
        mx.eval(fn())
        return time.perf_counter() - t0

    out: list[dict[str, Any]] = []
    seen: set = set()
    widths: set = set()
    for step in range(1, sess.total_steps + 1):
        for j, b in enumerate(sess.prepare(step)):
            sig = b.signature()
            if sig in seen:
                continue
            seen.add(sig)
            files = ptx()
            sess.keys.at(step, j)
            step_fn = lambda: batch_value_and_grad(sess.model, b, sess.s.lambda_, sess.engine)  # noqa: E731
            row = {"signature": repr(sig), "first_s": timed(step_fn), "again_s": timed(step_fn)}
            rows, width = b.packed.layout.tokens.shape if b.packed is not None else b.plain[0].shape
            if width not in widths:
                widths.add(width)
                q = mx.random.normal((rows, heads, width, dim)).astype(mx.bfloat16)
                attn = mx.grad(lambda x: mx.fast.scaled_dot_product_attention(x, x, x, scale=dim**-0.5,
                                                                            mask="causal").astype(mx.float32).sum())
                row["attention_first_s"], row["attention_again_s"] = timed(lambda: attn(q)), timed(lambda: attn(q))
            row["ptx_files_added"] = ptx() - files
            print(json.dumps(row), file=sys.stderr, flush=True)
            out.append(row)
            if len(out) >= count:
                return out
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--geometry", default="cpu-small", choices=sorted(GEOMETRIES))
    ap.add_argument("--method", default="lora", choices=["lora", "full"],
                    help="train.method: LoRA rank 16 on the seven projections, or every weight (full)")
    ap.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], help="override the geometry's dtype")
    ap.add_argument("--long-batch", type=int, default=4, help="pairs per micro-batch of the fixed-2048 case")
    ap.add_argument("--lengths", default="fixed,ultrafeedback,mean", help="cases to run, comma-separated")
    ap.add_argument("--steps", type=int, help="optimizer steps of the fixed cases (default 60 on GPU, 8 on CPU)")
    ap.add_argument("--pairs", type=int, help="pairs of the ultrafeedback epoch (default 4096 on GPU, 128 on CPU)")
    ap.add_argument("--epochs", type=int, default=1, help="passes over the ultrafeedback pairs (the last one is "
                    "also reported alone: its shapes were met before, as in a long run)")
    ap.add_argument("--warm", choices=["auto", "yes", "no"], default="auto",
                    help="a 2-step run of each case first, so the measured run finds the device kernels compiled "
                         "(auto: on a GPU, where a first run on a fresh H200 took 173-187 s against 27 s once cached)")
    ap.add_argument("--skip", type=int, default=3, help="first steps left out of the steady numbers")
    ap.add_argument("--engine", default="{}", help="train.engine overrides as JSON (default: the product's defaults)")
    ap.add_argument("--paired-engine", help="train.engine overrides (JSON, over --engine) of a second run of each case, "
                    "right after the first, on the same model folder and data")
    ap.add_argument("--paired-env", default="", help="KEY=VALUE,... environment of that second run (e.g. "
                    "MLX_USE_CUDA_GRAPHS=0); with it alone the second run takes --engine")
    ap.add_argument("--paired-train", default="", help="train settings (JSON) of that second run beside the "
                    "engine's, e.g. '{\"group_by_length\": true}'")
    ap.add_argument("--no-engine-bench", action="store_true", help="skip bench/engine.py's step beside the cases")
    ap.add_argument("--profile", type=int, default=0, metavar="STEPS", help="also time the step's phases over STEPS steps")
    ap.add_argument("--timeout", type=int, default=600, help="seconds per orpo train run")
    ap.add_argument("--work", help="folder for models, data and runs (default: a temporary one)")
    ap.add_argument("--json", help="write the results here")
    ap.add_argument("--new-shapes", type=int, default=0, metavar="N",
                    help="also time what the ultrafeedback epoch's first N new shapes cost (first vs second step)")
    ap.add_argument("--quantize", type=int, choices=[2, 3, 4, 5, 6, 8],
                    help="train LoRA on the model folder quantized by `orpo quantize` (QLoRA; groups of 64)")
    ap.add_argument("--profile-child", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.profile_child:
        job = json.loads(a.profile_child)
        if "new_shapes" in job:
            print(json.dumps(new_shape_costs(Path(job["model"]), Path(job["rendered"]), job["settings"],
                                             job["new_shapes"])))
        else:
            print(json.dumps(profile(Path(job["model"]), Path(job["rendered"]), job["settings"], job["steps"])))
        return
    from orpo.blas import reexec_with_openblas

    reexec_with_openblas([], sys.argv)
    try:
        paired_env = dict(kv.split("=", 1) for kv in a.paired_env.split(",") if kv.strip())
    except ValueError:
        sys.exit(f"--paired-env {a.paired_env!r}: KEY=VALUE pairs, comma-separated")
    shape = GEOMETRIES[a.geometry] if not a.dtype else replace(GEOMETRIES[a.geometry], dtype=a.dtype)
    gpu = GEOMETRIES[a.geometry].dtype == "bfloat16"
    if a.quantize and a.method == "full":
        sys.exit("--quantize trains LoRA on the quantized base; --method full refuses a quantized model")
    if a.quantize:
        a.no_engine_bench = True  # bench/engine.py's cases say `bits` themselves (its h200-7b suite)
    if a.method == "full":
        if a.profile or a.new_shapes:
            sys.exit("--profile and --new-shapes time LoRA's step; run them with --method lora")
        a.no_engine_bench = True  # bench/engine.py's step is LoRA's
    steps = a.steps or (60 if gpu else 8)
    n_pairs = a.pairs or (4096 if gpu else 128)
    warm = gpu if a.warm == "auto" else a.warm == "yes"
    engine = json.loads(a.engine)
    from engine import environment, mfu, probe

    env = environment()
    env["matmul_tflops"] = probe(shape.dtype, a.timeout)
    print(f"{a.geometry}: {env['device']} {env.get('gpu', '')}, MLX {env['versions'].get('mlx')}", flush=True)
    work = Path(a.work or tempfile.mkdtemp(prefix="orpo-trainer-bench-"))
    model = work / "model"
    if not (model / "config.json").exists():
        t0 = time.perf_counter()
        write_model(shape, model, 0)
        print(f"model folder written in {time.perf_counter() - t0:.0f} s", flush=True)
    if a.quantize:
        source, model = model, work / f"model-q{a.quantize}"
        if not (model / "complete.json").exists():
            subprocess.run([sys.executable, "-m", "orpo.cli", "quantize", "--model", str(source), "--out", str(model),
                            "--settings", json.dumps({"bits": a.quantize, "group_size": 64})], check=True, cwd=ROOT)
    draw = ultrafeedback_lengths(n_pairs, 1)
    mean = tuple(round(sum(x[i] for x in draw) / len(draw)) for i in range(3))
    mean_steps = min(len(draw) // 32, max(8, steps // 4))
    cases = {
        "fixed": ([(shape.prompt, shape.response, shape.response)] * (4 * steps + 8), 4, 1, steps),
        "fixed-2048": ([(1024, 1024, 1024)] * (a.long_batch * steps + 8), a.long_batch, 1, steps),
        "ultrafeedback": (draw, 4, 8, 0),
        "mean": ([mean] * (32 * mean_steps + 8), 4, 8, mean_steps),
    }
    results: dict[str, Any] = {"bench": "trainer", "geometry": a.geometry, "method": a.method, "quantize": a.quantize,
                               "shape": shape.__dict__,
                               "environment": env,
                               "ultrafeedback": {"spec": ULTRAFEEDBACK, "sigma": SIGMA, "pairs": n_pairs, "mean": mean},
                               "engine_overrides": engine, "cases": {}}

    def save() -> None:
        if a.json:
            from orpo.io import write_json

            write_json(a.json, results)

    for name in [c.strip() for c in a.lengths.split(",") if c.strip()]:
        lengths, batch, accum, max_steps = cases[name]
        rendered = work / f"rendered-{name}"
        write_rendered(rendered, lengths, shape.vocab, 2)
        skip = a.skip if accum == 1 else max(1, a.skip // 2)
        epochs = a.epochs if name == "ultrafeedback" else 1
        warmup = run_train(model, rendered, work / f"warm-{name}", settings_for(batch, accum, 2, engine, a.method),
                           a.timeout, 0) if warm else None
        res = run_train(model, rendered, work / f"run-{name}",
                        settings_for(batch, accum, max_steps, engine, a.method, epochs), a.timeout, skip)
        if warmup is not None:
            res["warmup_wall_s"] = warmup["wall_s"]
        results["cases"][name] = res
        save()  # a device call cut off in the paired run still returns the first
        if a.paired_engine or paired_env or a.paired_train:
            paired = {**engine, **json.loads(a.paired_engine or "{}")}
            train = json.loads(a.paired_train or "{}")
            res["paired"] = {"engine_overrides": paired, "env": paired_env, "train": train, **run_train(
                model, rendered, work / f"run-{name}-paired",
                {**settings_for(batch, accum, max_steps, paired, a.method, epochs), **train}, a.timeout, skip,
                paired_env)}
        p, c, r = (sum(x[i] for x in lengths) / len(lengths) for i in range(3))
        res["mean_lengths"] = [round(p, 1), round(c, 1), round(r, 1)]
        res["batch"], res["grad_accum"] = batch, accum
        at = replace(shape, prompt=round(p), response=round((c + r) / 2), pairs=batch)
        if name != "ultrafeedback" and "step_s" in res and "engine_resolved" in res:  # one shape: its FLOPs
            res["mfu"] = mfu(at.__dict__, res["engine_resolved"]["prefix_sharing"] is True, res["step_s"] / accum,
                             env["matmul_tflops"], a.method)
        if name == "ultrafeedback":  # pairs of their own lengths: each pair's FLOPs
            for run in (res, res.get("paired") or {}):
                sharing = (run.get("engine_resolved") or {}).get("prefix_sharing") is True
                for r in (run, run.get("last_epoch") or {}):
                    if "two_forward_tokens_per_s" in r and "engine_resolved" in run:
                        r["mfu"] = real_length_mfu(shape, lengths, r["two_forward_tokens_per_s"],
                                                   env["matmul_tflops"], a.method, sharing)
        if name in ("fixed", "mean") and not a.no_engine_bench:
            res["engine_bench"] = engine_bench(at, a.timeout)
        predicted = (res.get("memory_predicted") or {}).get("peak")
        print(f"  {name}: " + (f"{res['step_s']:.3f} s/step, {res['two_forward_tokens_per_s']:.0f} two-forward tok/s, "
                               f"peak {res['peak_gb']:.2f} GB" if "step_s" in res else "")
              + (f" (predicted {predicted:.2f} GB)" if predicted else "")
              + (f" ({res['failed']})" if "failed" in res else ""), flush=True)
        for label, r in (("", res), (" paired", res.get("paired", {}))):
            if "step_s" in r.get("last_epoch", {}):
                e = r["last_epoch"]
                print(f"  {name}{label} last epoch: {e['step_s']:.3f} s/step, {e['two_forward_tokens_per_s']:.0f} "
                      f"two-forward tok/s, {e['steps_with_new_shapes']} steps met new shapes"
                      + (f", MFU {e['mfu']:.1%}" if e.get("mfu") is not None else ""), flush=True)
        if "step_s" in res.get("paired", {}):
            q = res["paired"]
            what = " ".join(str(x) for x in (json.dumps(q["engine_overrides"]), q["env"], q["train"]) if x)
            print(f"  {name} paired {what}: {q['step_s']:.3f} s/step, peak {q['peak_gb']:.2f} GB "
                  f"(this/paired tokens/s {res.get('tokens_per_s', 0) / q['tokens_per_s']:.3f})", flush=True)
        save()
    if a.profile:
        rendered = work / "rendered-fixed"
        if not rendered.exists():
            write_rendered(rendered, cases["fixed"][0], shape.vocab, 2)
        job = {"model": str(model), "rendered": str(rendered), "steps": a.profile,
               "settings": settings_for(4, 1, a.profile + 1, engine)}
        proc = subprocess.run([sys.executable, str(Path(__file__).resolve()), "--profile-child", json.dumps(job)],
                              capture_output=True, text=True, timeout=a.timeout, cwd=ROOT)
        lines = proc.stdout.strip().splitlines()
        results["profile"] = json.loads(lines[-1]) if proc.returncode == 0 and lines else \
            {"failed": (proc.stderr.strip().splitlines() or ["?"])[-1][:200]}
        save()
    if a.new_shapes:
        rendered = work / "rendered-ultrafeedback"
        if not rendered.exists():
            write_rendered(rendered, draw, shape.vocab, 2)
        job = {"model": str(model), "rendered": str(rendered), "new_shapes": a.new_shapes,
               "settings": settings_for(4, 8, 0, engine)}
        try:
            proc = subprocess.run([sys.executable, str(Path(__file__).resolve()), "--profile-child", json.dumps(job)],
                                  capture_output=True, text=True, timeout=a.timeout, cwd=ROOT)
            lines = proc.stdout.strip().splitlines()
            results["new_shapes"] = json.loads(lines[-1]) if proc.returncode == 0 and lines else \
                {"failed": (proc.stderr.strip().splitlines() or ["?"])[-1][:200]}
        except subprocess.TimeoutExpired as e:
            results["new_shapes"] = {"failed": f"timed out after {a.timeout} s",
                                     "rows": [json.loads(x) for x in (e.stderr or b"").decode().splitlines()
                                              if x.startswith("{")]}
        save()
    print()
    print(format_report(results))


def format_report(results: dict[str, Any]) -> str:
    """The cases as one table, the engine bench beside the fixed shapes, then the profile."""
    head = (f"{'case':<14}{'P/C/R mean':>17}{'s/step':>9}{'row tok/s':>11}{'2-fwd tok/s':>12}{'padding':>9}"
            f"{'shapes':>7}{'traces':>7}{'peak GB':>9}{'cache GB':>9}{'engine s/step':>14}{'x engine':>9}{'MFU':>7}")
    trains = "every weight (full)" if results.get("method") == "full" else "LoRA rank 16 x 7 projections"
    rate = results["environment"].get("matmul_tflops")
    lines = [f"orpo train, {results['geometry']} ({results['environment']['device']}), {trains}"
             + (f"; MFU: model FLOPs (bench/engine_shapes.py Shape.step_flops, pair_flops) against {rate:.3g} TFLOP/s probed" if rate else ""),
             head, "-" * len(head)]
    for name, r in results["cases"].items():
        if "step_s" not in r:
            lines.append(f"{name:<14}failed: {r.get('failed')}")
            continue
        eng = r.get("engine_bench") or {}
        # Per micro-batch for the ratio: the engine bench times one micro-batch's value_and_grad.
        per_micro = r["step_s"] / r["grad_accum"]
        x = f"{eng['step_s'] / per_micro:>9.2f}" if eng.get("step_s") else f"{'-':>9}"
        e = f"{eng['step_s']:>14.3f}" if eng.get("step_s") else f"{eng.get('failed', '-')[:13]:>14}"
        mean = "/".join(f"{v:.0f}" for v in r["mean_lengths"])
        lines.append(f"{name:<14}{mean:>17}{r['step_s']:>9.3f}{r['row_tokens_per_s']:>11.0f}"
                     f"{r['two_forward_tokens_per_s']:>12.0f}{r['padding']:>9.3f}{r.get('shapes') or 0:>7}"
                     f"{r.get('traces') or 0:>7}{r['peak_gb']:>9.2f}{r['cache_gb']:>9.2f}{e}{x}"
                     + (f"{r['mfu']:>7.1%}" if r.get("mfu") is not None else f"{'-':>7}"))
    cases = results["cases"]
    for name, r in cases.items():
        predicted = r.get("memory_predicted")
        if predicted and "peak_gb" in r:
            lines.append(f"{name}: predicted peak {predicted['peak']:.2f} GB (weights {predicted['weights']:.2f}, "
                         f"gradients {predicted['gradients']:.2f}, masters {predicted['master_weights']:.2f}, moments "
                         f"{predicted['moments']:.2f}, activations ~{predicted['activations']:.2f}), measured {r['peak_gb']:.2f}")
        if "failed" in r and "step_s" in r:
            lines.append(f"{name}: {r['failed']}; the numbers above are of its {r['steps']} logged steps")
        if r.get("steps_with_new_shapes"):
            lines.append(f"{name}: {r['steps_with_new_shapes']} steps met a new shape (median {r['new_shape_step_s']:.3f} s, "
                         f"{r['seconds_in_new_shape_steps']:.1f} s in all); steps of known shapes "
                         + (f"{r['known_shape_step_s']:.3f} s" if r["known_shape_step_s"] is not None else "none"))
    if all(k in cases and "failed" not in cases[k] for k in ("ultrafeedback", "mean")):
        ratio = cases["ultrafeedback"]["row_tokens_per_s"] / cases["mean"]["row_tokens_per_s"]
        lines.append(f"ultrafeedback / mean (row tokens/s, same mean token count): {ratio:.2f}x (target >= 0.8)")
    if "profile" in results:
        lines.append("")
        lines.append("step phases (ms, median; each followed by mx.eval):")
        for name, ms in results["profile"].items():
            lines.append(f"  {name:<66}{ms:>9.2f}" if isinstance(ms, float) else f"  {name}: {ms}")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
