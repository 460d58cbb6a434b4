"""The paper's DAG at the Mistral-7B geometry, end to end on one machine, timed stage by stage.

Builds, in a working folder: a random-init HF folder of Mistral-7B-v0.1's geometry (bf16) with a 32k BPE
tokenizer trained here with Mistral's special tokens and BOS post-processor and the paper's chat template;
two sets of binarized rows with UltraFeedback-like lengths (alpha, beta); then runs

    snakemake results/paper/orpo-ifeval/table.md --configfile config/paper/orpo-ifeval.yaml <overlay>

with the overlay pointing the paper config at those local inputs and at IFEval's prompts. It prints and
saves per-stage wall time and peak RSS (benchmarks/*.tsv), the trainer's tokens/s from its own metrics,
generation tokens/s from the generations, and the extrapolation to the paper's 61k pairs x 5 epochs.

    python3 bench/paper_gpu.py --prompts IFEVAL_INPUT.jsonl --json $OUT/paper-gpu.json            # H200
    python3 bench/paper_gpu.py --geometry cpu-tiny --rows 48 --prompts P.jsonl --limit 4 --max-tokens 16   # CPU check
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [p for p in (str(ROOT), str(Path(__file__).resolve().parent)) if p not in sys.path]

from engine_shapes import MISTRAL_7B, Shape  # noqa: E402

from orpo.report.sources import benchmark  # noqa: E402

GEOMETRIES = {
    "mistral-7b": MISTRAL_7B,
    "cpu-tiny": Shape(hidden=64, layers=2, heads=4, kv_heads=2, intermediate=128, vocab=4096, head_dim=16,
                      tied=False, dtype="float32"),
}
PAPER_PAIRS, PAPER_EPOCHS = 61_135, 5  # HuggingFaceH4/ultrafeedback_binarized train_prefs; the authors' epochs
TARGET = "results/paper/orpo-ifeval/table.md"
# (median, low, high) tokens of prompt, chosen and rejected, log-normal with sigma 0.8 (as bench/trainer.py).
LENGTHS = ((150, 40, 700), (300, 60, 800), (300, 60, 800))


def words(n: int, seed: int) -> list[str]:
    """A seeded lexicon of n pronounceable pseudo-words (enough distinct pieces for a 32k BPE)."""
    rng = np.random.default_rng(seed)
    onsets, vowels, codas = list("bcdfghjklmnprstvwz") + ["br", "st", "th", "ch"], list("aeiou") + ["ai", "ou"], \
        ["", "n", "r", "s", "t", "l", "m", "ng"]
    out = set()
    while len(out) < n:
        k = int(rng.integers(1, 4))
        out.add("".join(rng.choice(onsets) + rng.choice(vowels) + rng.choice(codas) for _ in range(k)))
    return sorted(out)


def text(rng: np.random.Generator, lexicon: list[str], n_words: int) -> str:
    """Sentences of Zipf-ish random words, n_words long."""
    ranks = np.minimum(rng.zipf(1.2, n_words), len(lexicon)) - 1
    toks = [lexicon[i] for i in ranks]
    for i in range(0, n_words, 12):
        toks[i] = toks[i].capitalize()
    return " ".join(t + ("." if (i + 1) % 12 == 0 else "") for i, t in enumerate(toks)).strip() + "."


def write_rows(path: Path, n: int, seed: int, lexicon: list[str], words_per_token: float) -> None:
    """n binarized rows (H4's layout: prompt, chosen and rejected message lists, scores) of UltraFeedback-like lengths."""
    rng = np.random.default_rng(seed)
    lens = [np.clip(np.round(np.exp(np.log(m) + 0.8 * rng.standard_normal(n))), lo, hi).astype(int)
            for m, lo, hi in LENGTHS]
    with path.open("w") as f:
        for i in range(n):
            p, c, r = (text(rng, lexicon, max(4, int(x[i] * words_per_token))) for x in lens)
            f.write(json.dumps({"prompt_id": f"{seed}-{i}", "prompt": p,
                                "chosen": [{"role": "user", "content": p}, {"role": "assistant", "content": c}],
                                "rejected": [{"role": "user", "content": p}, {"role": "assistant", "content": r}],
                                "score_chosen": 8.0, "score_rejected": 4.0}) + "\n")


def write_tokenizer(out: Path, corpus: list[str], vocab: int) -> None:
    """A byte-level BPE with Mistral's <unk>/<s>/</s> as ids 0-2, BOS added by the post-processor, the paper's template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(corpus, trainers.BpeTrainer(vocab_size=vocab, special_tokens=["<unk>", "<s>", "</s>"],
                                                        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", 1)])
    tok.save(str(out / "tokenizer.json"))
    template = (ROOT / "config/paper/mistral-orpo.jinja").read_text()
    (out / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>",
        "add_bos_token": True, "add_eos_token": False, "model_max_length": 32768, "chat_template": template}))
    (out / "special_tokens_map.json").write_text(json.dumps({"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"}))


def write_model(shape: Shape, out: Path, seed: int) -> None:
    """A random-init model of the geometry as an HF-style folder (model_type mistral, as Mistral-7B-v0.1's), written
    by a fresh process (engine.write_model: this one then holds no device memory while the DAG runs)."""
    import engine

    config = {"model_type": "mistral", **shape.llama_config(), "max_position_embeddings": 32768, "bos_token_id": 1,
              "eos_token_id": 2, "torch_dtype": shape.dtype}
    engine.write_model(shape, out, seed, config)


def overlay(work: Path, a: argparse.Namespace) -> dict[str, Any]:
    """The paper config pointed at this folder's model, rows and prompts; epochs and lengths as asked."""
    return {
        "model": {"path": str(work / "model"), "hub_id": None},
        "eval": {"prompts": str(work / "ifeval_prompts.jsonl"), "limit": a.limit},
        "render": {"template": str(ROOT / "config/paper/mistral-orpo.jinja")},
        "generate": {"max_tokens": a.max_tokens, "batch_size": a.gen_batch},
        # The paper's 32 pairs a step as --batch x --grad-accum micro-batches (the same mean gradient); 7B full
        # training holds 101 GB of weights, masters, moments and gradients beside one micro-batch's activations.
        # No checkpoint but the final one: a 7B full run's mid-run checkpoint (weights and optimizer state) is
        # 87 GB, more than the GPU machine's disk, so replay retrains from step 0.
        "train": {"epochs": a.epochs, "checkpoint_every": 0, "engine": json.loads(a.engine),
                  **({"batch_size": a.batch, "grad_accum": a.grad_accum} if a.batch else {})},
        "experiments": {name: {"data": {"raw": str(work / f"{name}.jsonl")}} for name in ("alpha", "beta")},
    }


def metrics(path: Path) -> list[dict[str, Any]]:
    return [json.loads(ln) for ln in path.read_text().splitlines() if ln.strip()] if path.exists() else []


def summarise(work: Path, wall: float) -> dict[str, Any]:
    """Per-rule wall and RSS, trainer tokens/s (its own step log), generation tokens/s, the paper-scale extrapolation."""
    rules = {str(t.relative_to(work / "benchmarks").with_suffix("")): benchmark(t)
             for t in sorted((work / "benchmarks").rglob("*.tsv"))}
    out: dict[str, Any] = {"wall_s": wall, "rules": rules, "train": {}, "generate": {}}
    for exp in ("alpha", "beta"):
        run = work / "results" / exp / "train" / "run"
        steps = [m for m in metrics(run / "metrics.jsonl") if m.get("split") == "train" and "tokens_per_s" in m]
        recorded = json.loads((run / "settings.json").read_text()) if (run / "settings.json").exists() else {}
        per_step = recorded.get("settings", {}).get("batch_size", 0) * recorded.get("settings", {}).get("grad_accum", 0)
        pairs = len(steps) * per_step or None  # pairs trained (the last step may hold fewer: an estimate)
        # The trainer's rates are since its loop began; after the first quarter (the compiles) from the step times.
        q = steps[len(steps) // 4] if len(steps) > 4 else None
        later = ((steps[-1]["tokens_per_s"] * steps[-1]["elapsed_s"] - q["tokens_per_s"] * q["elapsed_s"])
                 / (steps[-1]["elapsed_s"] - q["elapsed_s"])) if q else None
        train_s = rules.get(f"{exp}/train", {}).get("s")
        out["train"][exp] = {"steps": len(steps), "pairs": pairs, "tokens_per_s": steps[-1]["tokens_per_s"] if steps else None,
                             "tokens_per_s_after_first_quarter": later,
                             "stage_s": train_s,
                             "peak_gb": max((m["peak_memory_mb"] for m in steps), default=0) / 1024}
        if train_s and pairs:
            out["train"][exp]["paper_scale_h_one_gpu_estimate"] = train_s / pairs * PAPER_PAIRS * PAPER_EPOCHS / 3600
        if later and pairs:  # the same, from the steady rate: tokens of the paper's run / tokens per second
            tokens_per_pair = sum(m["tokens"] for m in steps) / pairs
            out["train"][exp]["paper_scale_h_one_gpu_steady_estimate"] = (
                tokens_per_pair * PAPER_PAIRS * PAPER_EPOCHS / later / 3600)
    for gen in sorted((work / "results").rglob("generations/ifeval/*.jsonl")):
        rows = metrics(gen)
        rel = gen.relative_to(work / "results")
        rule = f"{rel.parent.parent.parent}/generate_{gen.stem}_ifeval".lstrip("./")
        tokens = sum(int(r.get("generated_tokens") or 0) for r in rows)
        seconds = rules.get(rule, {}).get("s")
        out["generate"][str(rel)] = {"prompts": len(rows), "new_tokens": tokens, "stage_s": seconds,
                                     "tokens_per_s": tokens / seconds if seconds else None}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--geometry", default="mistral-7b", choices=sorted(GEOMETRIES))
    ap.add_argument("--prompts", type=Path, required=True, help="IFEval's input_data.jsonl (541 prompts)")
    ap.add_argument("--rows", type=int, default=3000, help="binarized rows per experiment")
    ap.add_argument("--epochs", type=int, default=1)
    ap.add_argument("--limit", type=int, default=0, help="eval prompts (0 = all)")
    ap.add_argument("--max-tokens", type=int, default=1280)
    ap.add_argument("--gen-batch", type=int, default=128)
    ap.add_argument("--cores", type=int, default=os.cpu_count())
    ap.add_argument("--workdir", type=Path, default=Path("/tmp/paper-gpu"))
    ap.add_argument("--engine", default='{"segment_layers": 2}', help="train.engine overlay, JSON")
    ap.add_argument("--batch", type=int, default=0, help="train.batch_size overlay (0: the paper config's 8)")
    ap.add_argument("--grad-accum", type=int, default=4, help="train.grad_accum overlay, with --batch")
    ap.add_argument("--budget-s", type=float, default=0,
                    help="stop Snakemake after this many seconds and report what finished (a rerun continues)")
    ap.add_argument("--targets", nargs="+", help="Snakemake targets short of the table (e.g. "
                    "results/alpha/train/replay.json), to split the DAG at stage ends across calls")
    ap.add_argument("--json", type=Path)
    a = ap.parse_args()
    shape, work = GEOMETRIES[a.geometry], a.workdir
    work.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    lexicon = words(60_000, 0)
    if not (work / "model" / "config.json").exists():
        (work / "model").mkdir(exist_ok=True)
        rng = np.random.default_rng(1)
        write_tokenizer(work / "model", [text(rng, lexicon, 400) for _ in range(4000)], shape.vocab)
        write_model(shape, work / "model", seed=0)
    from tokenizers import Tokenizer

    probe = text(np.random.default_rng(2), lexicon, 2000)
    words_per_token = 2000 / len(Tokenizer.from_file(str(work / "model" / "tokenizer.json")).encode(probe).ids)
    # Inputs are written once: a rerun (the same command) continues the DAG, and a new mtime would redo it.
    for seed, name in enumerate(("alpha", "beta")):
        if not (work / f"{name}.jsonl").exists():
            write_rows(work / f"{name}.jsonl", a.rows, seed + 10, lexicon, words_per_token)
    if not (work / "ifeval_prompts.jsonl").exists():
        shutil.copyfile(a.prompts, work / "ifeval_prompts.jsonl")
    config = json.dumps(overlay(work, a))
    if not (work / "overlay.yaml").exists() or (work / "overlay.yaml").read_text() != config:
        (work / "overlay.yaml").write_text(config)
    built = time.perf_counter() - t0
    cmd = [sys.executable, "-m", "snakemake", *(a.targets or [TARGET]), "--snakefile", str(ROOT / "Snakefile"), "--directory", str(work),
           "--configfile", str(ROOT / "config/paper/orpo-ifeval.yaml"), str(work / "overlay.yaml"),
           "--cores", str(a.cores), "--profile", str(ROOT / "workflow/profiles/default")]
    t1 = time.perf_counter()
    env = dict(os.environ)
    if shutil.which("orpo") is None:  # wheels installed with --target carry no console script: the rules need one
        (work / "bin").mkdir(exist_ok=True)
        (work / "bin" / "orpo").write_text(f'#!/bin/sh\nexec "{sys.executable}" -m orpo.cli "$@"\n')
        (work / "bin" / "orpo").chmod(0o755)
        env["PATH"] = f"{work / 'bin'}:{env['PATH']}"
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        stdout, stderr = proc.communicate(timeout=a.budget_s or None)
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGINT)  # Snakemake stops its jobs and removes their incomplete outputs
        stdout, stderr = proc.communicate()
        stderr += f"\nstopped after --budget-s {a.budget_s:.0f} s"
    run = subprocess.CompletedProcess(cmd, proc.returncode, stdout, stderr)
    wall = time.perf_counter() - t1
    result = {"geometry": a.geometry, "rows": a.rows, "build_s": built, "words_per_token": words_per_token,
              "returncode": run.returncode, **summarise(work, wall)}
    if run.returncode != 0:
        result["stderr_tail"] = run.stderr[-4000:]
    if (work / TARGET).exists():
        result["table"] = (work / TARGET).read_text()
    print(json.dumps(result, indent=1, default=str))
    if a.json:
        a.json.write_text(json.dumps(result, indent=1, default=str))
    sys.exit(run.returncode)


if __name__ == "__main__":
    main()
