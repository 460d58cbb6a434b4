"""Data-parallel scaling: tokens/s of the trainer's step on 1 rank vs N ranks, and the scaling efficiency.

Weak scaling, as `train.distributed.processes` does it: every rank takes `shape.pairs` pairs per step, so
N ranks train on an N-times global batch. Each run is fresh processes started the way `orpo train` starts
them (orpo.train.launch: ring over 127.0.0.1 on CPU, NCCL with one GPU per rank on CUDA). Each rank
builds the same seeded random-init llama of bench/engine_shapes.py's shape, LoRA rank 16 on all seven
projections, and runs the real `Session.step` (value_and_grad, all_sum of gradients and metrics, global
clip, AdamW update) on random pairs, W untimed steps then K timed ones. Tokens are two-forward tokens,
2 * (prompt + response) per pair, summed over ranks.

    efficiency = tokens/s(N ranks) / (N * tokens/s(1 rank))

    .venv/bin/python bench/distributed.py --shape cpu-small              # 2 CPU processes (ring)
    python bench/distributed.py --shape h200 --ranks 2 --json $OUT/distributed.json   # nvidia-h200-x2 (NCCL)
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [p for p in (str(ROOT), str(Path(__file__).resolve().parent)) if p not in sys.path]

from engine_shapes import CPU_SMALL, LLAMA_1B, Shape, random_pair_tokens  # noqa: E402 (after the sys.path line)

SHAPES = {"h200": LLAMA_1B, "cpu-small": CPU_SMALL}
LORA = {"rank": 16, "alpha": 32, "dropout": 0.0,
        "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]}


def rank_main(job: dict[str, Any]) -> None:
    """One rank: build the model and batch, run the steps, rank 0 writes the timing to job['out']."""
    import mlx.core as mx
    from mlx_lm.models import llama

    from orpo.optim import lora_adamw
    from orpo.train.data import Pairs
    from orpo.train.distributed import join
    from orpo.train.lora import apply_lora
    from orpo.train.session import Session, resolve_run
    from orpo.train.settings import train_settings

    shape, world = Shape(**job["shape"]), job["world"]
    s = train_settings({"batch_size": shape.pairs, "lora": LORA, "grad_clip": 1.0, "seed": job["seed"],
                        "distributed": {"processes": world}})
    shard = join(s.distributed)
    mx.random.seed(job["seed"])  # the same base weights on every rank
    model = llama.Model(llama.ModelArgs(model_type="llama", **shape.llama_config()))
    model.set_dtype(getattr(mx, shape.dtype))
    keys = shard.dropout_keys(s.seed)
    adapter_config = apply_lora(model, s.lora, s.seed, keys)
    # The global batch: world * pairs distinct random pairs; Session.micro_batches hands each rank its own.
    prompts, chosen, rejected = random_pair_tokens(Shape(**{**job["shape"], "pairs": shape.pairs * world}), job["seed"])
    scored = [[1] * shape.response for _ in prompts]
    pairs = Pairs([str(i) for i in range(len(prompts))], prompts, chosen, rejected, scored, [list(m) for m in scored])
    total = job["warmup"] + job["steps"]
    opt = lora_adamw("constant", 1e-5, total, 0, 0.0)
    sess = Session(resolved=resolve_run(s, model), model=model, opt=opt, adapter_config=adapter_config, train=pairs,
                   schedule=[list(range(len(pairs)))] * total, keys=keys, shard=shard)
    for step in range(1, job["warmup"] + 1):
        sess.step(step)
    shard.barrier()
    mx.reset_peak_memory()
    t0 = time.perf_counter()
    for step in range(job["warmup"] + 1, total + 1):
        sess.step(step)  # ends in mx.eval of the updated weights: the step is done when it returns
    seconds = (time.perf_counter() - t0) / job["steps"]
    if shard.is_main:
        tokens = shape.two_forward_tokens() * world
        Path(job["out"]).write_text(json.dumps({
            "world": world, "seconds_per_step": seconds, "tokens_per_step": tokens, "tokens_per_s": tokens / seconds,
            "peak_gb_rank0": mx.get_peak_memory() / 1e9, "device": str(mx.default_device())}))


def run_world(shape: Shape, world: int, args: argparse.Namespace) -> dict[str, Any]:
    """Launch `world` fresh rank processes (as `orpo train` would) and return rank 0's timing."""
    from orpo.train.launch import rank_envs, resolve_backend, spawn, wait_all

    with tempfile.TemporaryDirectory(prefix="bench-dist-") as tmp:
        out = Path(tmp) / "result.json"
        job = {"shape": shape.__dict__, "world": world, "steps": args.steps, "warmup": args.warmup,
               "seed": args.seed, "out": str(out)}
        cmd = [sys.executable, str(Path(__file__).resolve()), "--child", json.dumps(job)]
        if world == 1:
            env = dict(os.environ)
            if resolve_backend("any") == "nccl":  # the same first GPU the 2-rank run's rank 0 gets
                env["CUDA_VISIBLE_DEVICES"] = os.environ.get("CUDA_VISIBLE_DEVICES", "0").split(",")[0]
            envs = [env]
        else:
            envs = rank_envs(world, resolve_backend("any"), Path(tmp))
        procs = [spawn(cmd, env) for env in envs]
        rc = wait_all(procs)
        if rc or not out.exists():
            raise SystemExit(f"bench/distributed.py: the {world}-rank run failed (exit {rc})")
        return json.loads(out.read_text())


def main() -> None:
    """Measure 1 rank and N ranks on one shape; print the table and the scaling efficiency."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", default="cpu-small", choices=sorted(SHAPES), help="bench/engine_shapes.py's shape (per rank)")
    ap.add_argument("--ranks", type=int, default=2, help="ranks of the data-parallel run (compared with 1)")
    ap.add_argument("--steps", type=int, help="timed steps (default: 10 on GPU, 3 on CPU)")
    ap.add_argument("--warmup", type=int, default=2, help="untimed steps first (graph building, allocator warm-up)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", help="write the results here")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        rank_main(json.loads(args.child))
        return
    shape = SHAPES[args.shape]
    args.steps = args.steps or (10 if args.shape == "h200" else 3)
    one = run_world(shape, 1, args)
    many = run_world(shape, args.ranks, args)
    efficiency = many["tokens_per_s"] / (args.ranks * one["tokens_per_s"])
    print(f"shape {args.shape}: {shape.pairs} pairs of {shape.prompt}+{shape.response} tokens per rank, "
          f"{shape.dtype}, {args.steps} timed steps after {args.warmup}, device {one['device']}")
    print("| ranks | s/step | tokens/step | tokens/s | peak GB (rank 0) |")
    print("|---|---|---|---|---|")
    for r in (one, many):
        print(f"| {r['world']} | {r['seconds_per_step']:.3f} | {r['tokens_per_step']} | {r['tokens_per_s']:.1f} | "
              f"{r['peak_gb_rank0']:.2f} |")
    print(f"scaling efficiency ({args.ranks} ranks): {efficiency:.3f}")
    if args.json:
        Path(args.json).write_text(json.dumps({"shape": args.shape, "ranks": args.ranks, "one": one, "many": many,
                                               "efficiency": efficiency}, indent=2) + "\n")


if __name__ == "__main__":
    main()
