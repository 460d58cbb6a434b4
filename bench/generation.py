"""Generated tokens/s of orpo.generation's batched generation at batch sizes 1, 8 and 32, in one run.

The same prompts (the first --n eval prompts, rendered through the model's chat template, as the
generate stage does), greedy, --max-tokens each, at each batch size; batch 1 is one prompt at a time.
Tokens/s is generated tokens over wall time, prefill included. A reference row times mlx_lm's own
one-prompt-at-a-time stream_generate, so batch 1 is not a straw man. Runs unchanged on Linux CPU
(mlx[cpu], OpenBLAS preloaded when found) and on NVIDIA GPUs (mlx[cuda]).
Target, on the GPU: batch 32 >= 5x the tokens/s of batch 1.

`--geometry NAME` instead times one batch of random-token prompts through a random-init model of a real
geometry (bench/engine_shapes.py): the engine's decode that `orpo generate` runs against mlx-lm's batch
generation (its BatchGenerator, left-padded caches under an array mask), each at two lengths of the answer, so
a decode step's time is their difference over the extra steps.

    .venv/bin/python bench/generation.py [--model results/base/model] [--prompts data/eval/ifeval_prompts.jsonl]
    python3 bench/generation.py --geometry mistral-7b --batch 272 --json $OUT/generation-7b.json   # H200
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from orpo.blas import reexec_with_openblas

ROOT = Path(__file__).resolve().parents[1]


def _timed_batched(gen, ids: list[list[int]], batch_size: int, max_tokens: int) -> tuple[int, float]:
    """(generated tokens, seconds) for all prompts at one batch size, after a short warm-up at that size."""
    from orpo.generation import generate_batched

    settings = {"temperature": 0.0, "top_p": 1.0, "seed": 0, "batch_size": batch_size, "max_tokens": max_tokens}
    generate_batched(gen, ids[:batch_size], {**settings, "max_tokens": 4})
    t0 = time.perf_counter()
    _, stats = generate_batched(gen, ids, settings)
    return stats["generated_tokens"], time.perf_counter() - t0


def _timed_stream(gen, ids: list[list[int]], max_tokens: int) -> tuple[int, float]:
    """(generated tokens, seconds) with mlx_lm's stream_generate, one prompt at a time, greedy."""
    from mlx_lm.generate import stream_generate
    from mlx_lm.sample_utils import make_sampler

    sampler = make_sampler(temp=0.0)
    for _ in stream_generate(gen.model, gen.wrapper, ids[0], max_tokens=4, sampler=sampler):
        pass
    t0, tokens = time.perf_counter(), 0
    for prompt in ids:
        last = None
        for last in stream_generate(gen.model, gen.wrapper, prompt, max_tokens=max_tokens, sampler=sampler):
            pass
        # Its count includes the end-of-turn token, which batch_generate's token ids leave out.
        tokens += (last.generation_tokens - (last.finish_reason == "stop")) if last else 0
    return tokens, time.perf_counter() - t0


def _geometry_rows(a: argparse.Namespace) -> list[dict]:
    """The engine's decode and mlx-lm's batch generation on one batch at a random-init geometry."""
    import json

    import mlx.core as mx
    import numpy as np
    from engine import build_model
    from engine_shapes import CPU_SMALL, MISTRAL_7B, LLAMA_1B
    from mlx_lm.generate import batch_generate
    from mlx_lm.sample_utils import make_sampler

    from orpo.engine.head import lm_head_of
    from orpo.engine.stack import Stack
    from orpo.generation import PREFILL_BATCH, decode

    shape = {"mistral-7b": MISTRAL_7B, "llama-1b": LLAMA_1B, "cpu-small": CPU_SMALL}[a.geometry]
    model = build_model(shape, seed=0)
    rng = np.random.default_rng(0)
    low, high = a.prompt_tokens
    prompts = [[int(x) for x in rng.integers(3, shape.vocab, int(n))] for n in rng.integers(low, high + 1, a.batch)]
    greedy = make_sampler(temp=0.0)

    class NoStops:  # a random model's answers run to their budget either way
        eos_token_ids: list[int] = []

        def decode(self, ids: list[int]) -> str:
            return ""

    runs = {
        "engine decode": lambda t: decode(Stack(model), lm_head_of(model), prompts, [t] * a.batch, greedy, set()),
        "mlx-lm batch_generate": lambda t: batch_generate(
            model, NoStops(), prompts, max_tokens=t, sampler=greedy, return_token_ids=True,
            completion_batch_size=a.batch, prefill_batch_size=min(a.batch, PREFILL_BATCH)).token_ids,
    }
    short, long = a.max_tokens // 8, a.max_tokens
    rows, answers = [], {}
    for name, run in runs.items():
        run(2)  # untimed: the first calls build the kernels (on CUDA, per process)
        times = {}
        for t in (short, long):
            mx.clear_cache()
            mx.reset_peak_memory()
            t0 = time.perf_counter()
            answers[name] = run(t)
            times[t] = time.perf_counter() - t0
        step = (times[long] - times[short]) / (long - short)
        rows.append({"variant": name, "batch": a.batch, "new_tokens": long, "seconds": round(times[long], 3),
                     "tokens_per_s": round(a.batch * long / times[long], 1), "decode_step_ms": round(1000 * step, 2),
                     "decode_tokens_per_s": round(a.batch / step, 1), "peak_gb": round(mx.get_peak_memory() / 1e9, 2)})
        print(json.dumps(rows[-1]), flush=True)
    same = sum(x == y for x, y in zip(*answers.values()))
    print(f"{same} of {a.batch} greedy answers identical between the two ({shape.dtype}; the rest differ by rounding)")
    if a.json:
        Path(a.json).write_text(json.dumps({"geometry": a.geometry, "device": str(mx.default_device()),
                                            "mlx": mx.__version__, "prompt_tokens": a.prompt_tokens, "rows": rows,
                                            "identical_answers": same}, indent=1))
    return rows


def main() -> None:
    """Measure and print the table."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=str(ROOT / "results" / "base" / "model"), help="model folder or hub id")
    ap.add_argument("--adapter", help="LoRA adapter folder")
    ap.add_argument("--prompts", default=str(ROOT / "data" / "eval" / "ifeval_prompts.jsonl"))
    ap.add_argument("--n", type=int, default=32, help="prompts (the first N)")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--no-reference", action="store_true", help="skip the mlx_lm stream_generate row")
    ap.add_argument("--geometry", choices=["mistral-7b", "llama-1b", "cpu-small"],
                    help="random-init model of this geometry: the engine's decode against mlx-lm's batch generation")
    ap.add_argument("--batch", type=int, default=272, help="with --geometry: prompts decoded together")
    ap.add_argument("--prompt-tokens", type=int, nargs=2, default=[20, 400], metavar=("LOW", "HIGH"),
                    help="with --geometry: prompt lengths drawn uniformly from this range")
    ap.add_argument("--json", help="with --geometry: write the rows here")
    a = ap.parse_args()
    if a.geometry:
        sys.path.insert(0, str(Path(__file__).resolve().parent))
        reexec_with_openblas([], sys.argv)
        _geometry_rows(a)
        return
    if a.model == ap.get_default("model") and not Path(a.model).is_dir():
        sys.exit(f"no model at {a.model}: build the embedded base model first "
                 "(.venv/bin/snakemake results/base/model --profile workflow/profiles/default) or pass --model PATH")
    reexec_with_openblas([], sys.argv)

    import mlx.core as mx

    from orpo.generation import load_generator
    from orpo.io import read_jsonl

    gen = load_generator(a.model, a.adapter)
    prompts = [row["prompt"] for _, row in read_jsonl(a.prompts)][: a.n]
    ids = [gen.prompt_ids([{"role": "user", "content": p}]) for p in prompts]
    print(f"device {mx.default_device()}, mlx {mx.__version__}; model {a.model}; {len(ids)} prompts "
          f"({sum(map(len, ids)) / len(ids):.0f} tokens on average), greedy, max {a.max_tokens} new tokens")

    rows = [(f"batch {b}", *_timed_batched(gen, ids, b, a.max_tokens)) for b in a.batch_sizes]
    if not a.no_reference:
        rows.append(("mlx_lm stream_generate", *_timed_stream(gen, ids, a.max_tokens)))
    base = rows[0][1] / rows[0][2]
    print(f"{'variant':<24}{'tokens':>8}{'seconds':>10}{'tokens/s':>11}{f'vs {rows[0][0]}':>12}")
    for name, tokens, secs in rows:
        print(f"{name:<24}{tokens:>8}{secs:>10.2f}{tokens / secs:>11.1f}{tokens / secs / base:>11.2f}x")


if __name__ == "__main__":
    main()
