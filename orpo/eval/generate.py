"""The `generate` stage core: batched generation on the eval prompts through the training chat template."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import mlx.core as mx
from mlx_lm import load
from mlx_lm.generate import batch_generate
from mlx_lm.sample_utils import make_sampler

from orpo.config import section_defaults
from orpo.io import InputError, read_jsonl, write_jsonl
from orpo.render.template import encode_generation_prompt, load_template, load_tokenizer

DEFAULTS: dict[str, Any] = section_defaults("generate")


def read_prompts(path: str | Path, limit: int = 0) -> list[dict[str, Any]]:
    """Eval prompts (IFEval input format: at least `key` and `prompt`), in file order."""
    rows = []
    for lineno, row in read_jsonl(path):
        if not isinstance(row.get("prompt"), str):
            raise InputError(path, lineno, "prompt", "missing or not a string")
        rows.append(row)
    return rows[:limit] if limit > 0 else rows


def generate(
    model: str | Path, prompts_path: str | Path, out_path: str | Path, settings: dict[str, Any],
    adapter: str | Path | None = None, label: str = "model", template: str | Path | None = None,
    limit: int = 0,
) -> dict[str, Any]:
    """Generate one response per prompt and write jsonl rows (IFEval's `prompt`, `response` plus provenance)."""
    s = {**DEFAULTS, **settings}
    prompts = read_prompts(prompts_path, limit)
    net, wrapper = load(str(model), adapter_path=str(adapter) if adapter else None)
    chat = load_template(model, template)
    tok = load_tokenizer(model)
    ids = [encode_generation_prompt(chat, tok, [{"role": "user", "content": p["prompt"]}]) for p in prompts]

    mx.random.seed(s["seed"])
    sampler = make_sampler(temp=s["temperature"], top_p=s["top_p"])
    # Similar lengths decode together (less padding); the output keeps the prompt order.
    order = sorted(range(len(ids)), key=lambda i: (len(ids[i]), i))
    texts: dict[int, str] = {}
    t0, gen_tokens = time.time(), 0
    for start in range(0, len(order), s["batch_size"]):
        chunk = order[start : start + s["batch_size"]]
        out = batch_generate(net, wrapper, [ids[i] for i in chunk], max_tokens=s["max_tokens"],
                             sampler=sampler, return_token_ids=True)
        for i, text, toks in zip(chunk, out.texts, out.token_ids):
            texts[i] = text
            gen_tokens += len(toks)
        print(f"generate[{label}]: {min(start + len(chunk), len(order))}/{len(order)} prompts", flush=True)
    seconds = time.time() - t0
    provenance = {"model": str(model), "adapter": str(adapter) if adapter else None, "label": label}
    write_jsonl(out_path, ({"key": p.get("key"), "prompt": p["prompt"], "response": texts[i], **provenance,
                            "settings": s} for i, p in enumerate(prompts)))
    return {"prompts": len(prompts), "generated_tokens": gen_tokens, "seconds": round(seconds, 1),
            "tokens_per_s": round(gen_tokens / max(seconds, 1e-9), 1)}
