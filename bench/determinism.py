"""Run-to-run determinism of full-parameter gradients: the same step repeated, its gradients compared bit for bit.

Two parts, on whatever device MLX runs on:
- the embedding's weight gradient alone at the Mistral-7B shape (V 32000, H 4096, 4 x 2048 looked-up tokens of
  Zipf-distributed ids, BOS on every row): autodiff of `weight[ids]` (a scatter-add) against
  orpo.engine.embedding.lookup (a one-hot matmul), each repeated, distinct results counted and timed;
- the product's full-parameter step (orpo.train.step.pair_value_and_grad, the engine as a run resolves it here)
  on a few layers of the Mistral-7B geometry, in variants of what trains (every weight with the model's own
  nn.Embedding, every weight with the SummedEmbedding that train.method full installs, or bench/engine.py's LoRA)
  x train.engine.attention_backward (fused, ordered): the names of the gradients that differ between repeats,
  and the step's seconds after the first.

    python3 bench/determinism.py --parts embedding --json $OUT/determinism.json             # on the GPU: 27 s
    python3 bench/determinism.py --parts step --layers 2 --repeats 3 --json $OUT/step.json
    .venv/bin/python bench/determinism.py --layers 2 --hidden 256 --vocab 4096 --repeats 2   # CPU check
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
import time
from dataclasses import replace
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [p for p in (str(ROOT), str(Path(__file__).resolve().parent)) if p not in sys.path]

import mlx.core as mx
import numpy as np
from engine import LORA, build_model
from engine_shapes import MISTRAL_7B
from mlx.utils import tree_flatten

import orpo.engine.attention as attention_module
from orpo.engine.embedding import lookup, with_summed_embeddings
from orpo.train.data import Pairs
from orpo.train.lora import apply_lora
from orpo.train.settings import engine_settings
from orpo.train.step import pair_value_and_grad, resolve_engine


def digest(a: mx.array) -> str:
    return hashlib.sha256(np.array(a.astype(mx.float32) if a.dtype == mx.bfloat16 else a).tobytes()).hexdigest()[:16]


def zipf_ids(rng: np.random.Generator, vocab: int, n: int) -> list[int]:
    """Ids of a text-like distribution: a few very common tokens, a long tail; BOS (1) first."""
    return [1] + [int(x) for x in np.minimum(rng.zipf(1.2, n - 1), vocab - 3) + 2]


def embedding_part(vocab: int, hidden: int, tokens: int, repeats: int) -> dict:
    rng = np.random.default_rng(0)
    ids = mx.array(np.array([zipf_ids(rng, vocab, tokens // 4) for _ in range(4)]))
    weight = mx.array(rng.standard_normal((vocab, hidden)) * 0.02, mx.bfloat16)
    cot = mx.array(rng.standard_normal((*ids.shape, hidden)) * 1e-3, mx.bfloat16)
    out = {"vocab": vocab, "hidden": hidden, "tokens": int(ids.size), "distinct_ids": int(np.unique(np.array(ids)).size)}
    for name, fn in (("autodiff_scatter_add", lambda w: w[ids]), ("one_hot_matmul", lambda w: lookup(w, ids))):
        grad = mx.compile(lambda w, c, fn=fn: mx.vjp(fn, [w], [c])[1][0])
        mx.eval(grad(weight, cot))
        hashes, seconds = [], []
        for _ in range(repeats):
            t0 = time.perf_counter()
            g = grad(weight, cot)
            mx.eval(g)
            seconds.append(time.perf_counter() - t0)
            hashes.append(digest(g))
        out[name] = {"distinct_results": len(set(hashes)), "repeats": repeats, "ms_median": 1e3 * float(np.median(seconds))}
    return out


STEP_VARIANTS = ("model-fused", "summed-fused", "summed-ordered", "lora-fused", "lora-ordered")
DEFAULT_BLOCK_SCORES = attention_module.ORDERED_BLOCK_SCORES


def step_part(layers: int, hidden: int, vocab: int, repeats: int, segment_layers: int, variants: list[str]) -> dict:
    shape = replace(MISTRAL_7B, layers=layers, vocab=vocab,
                    **({} if hidden == MISTRAL_7B.hidden else {"hidden": hidden, "intermediate": 3 * hidden, "heads": 4,
                                                              "kv_heads": 2, "head_dim": hidden // 4}))
    if mx.default_device() == mx.cpu:
        shape = replace(shape, dtype="float32")
    rng = np.random.default_rng(1)
    n, prompt, response = 4, 512, 512
    prompts = [zipf_ids(rng, vocab, prompt) for _ in range(n)]
    chosen = [zipf_ids(rng, vocab, response)[1:] + [2] for _ in range(n)]
    rejected = [zipf_ids(rng, vocab, response)[1:] + [2] for _ in range(n)]
    scored = [[1] * response for _ in range(n)]
    pairs = Pairs([str(i) for i in range(n)], prompts, chosen, rejected, scored, [list(s) for s in scored])
    engine = resolve_engine(engine_settings({"segment_layers": segment_layers} if segment_layers else {}))
    out = {"layers": layers, "hidden": shape.hidden, "vocab": vocab, "dtype": shape.dtype, "pairs": n,
           "prompt": prompt, "response": response, "segment_layers": engine.segment_layers, "compile": engine.compile}
    for name in variants:
        trains, attention = name.split("-")
        # "ordered@24": the ordered backward's blocks of at most 2^24 scores (attention.ORDERED_BLOCK_SCORES)
        attention, _, log2 = attention.partition("@")
        attention_module.ORDERED_BLOCK_SCORES = 2 ** int(log2) if log2 else DEFAULT_BLOCK_SCORES
        model = build_model(shape, 0)
        if trains == "lora":
            apply_lora(model, LORA, 0)
        else:
            model.unfreeze()
        if trains == "summed":
            with_summed_embeddings(model)
        model.train()
        runs, seconds, losses = [], [], set()
        for _ in range(repeats):
            t0 = time.perf_counter()
            (loss, _), grads = pair_value_and_grad(model, pairs, 0.1, replace(engine, attention_backward=attention))
            mx.eval(loss, grads)
            seconds.append(time.perf_counter() - t0)
            print(f"{name}: repeat {len(seconds)} in {seconds[-1]:.2f} s", file=sys.stderr, flush=True)
            losses.add(loss.item())
            runs.append({k: digest(g) for k, g in tree_flatten(grads)})
        differ = sorted(k for k in runs[0] if len({r[k] for r in runs}) > 1)
        out[name] = {"repeats": repeats, "gradients": len(runs[0]), "differing": differ, "losses": sorted(losses),
                     "step_s_after_first": [round(x, 4) for x in seconds[1:]]}
        print(json.dumps({name: out[name]}), flush=True)
        del model, grads
        mx.clear_cache()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--layers", type=int, default=4, help="decoder layers of the step part")
    ap.add_argument("--hidden", type=int, default=MISTRAL_7B.hidden)
    ap.add_argument("--vocab", type=int, default=MISTRAL_7B.vocab)
    ap.add_argument("--segment-layers", type=int, default=0, help="train.engine.segment_layers (0: as resolved)")
    ap.add_argument("--parts", default="embedding,step", help="which parts to run, comma-separated")
    ap.add_argument("--variants", default=",".join(STEP_VARIANTS),
                    help="the step part's variants, comma-separated: {model,summed,lora}-{fused,ordered}, "
                         "ordered@N for blocks of at most 2^N scores")
    ap.add_argument("--json", type=Path)
    a = ap.parse_args()
    result = {"device": str(mx.default_device()), "mlx": mx.__version__}
    parts = {"embedding": lambda: embedding_part(a.vocab, a.hidden, 8192, max(a.repeats, 8)),
             "step": lambda: step_part(a.layers, a.hidden, a.vocab, a.repeats, a.segment_layers, a.variants.split(","))}
    for name, part in [(k, parts[k]) for k in a.parts.split(",")]:  # saved after each part: a stopped run keeps what it measured
        t0 = time.perf_counter()
        result[name] = {**part(), "seconds": round(time.perf_counter() - t0, 1)}
        print(json.dumps({name: result[name]}, indent=1), flush=True)
        if a.json:
            a.json.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
