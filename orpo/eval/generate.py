"""The `generate` stage core: responses to the eval prompts, saved with their settings."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from orpo.config import section_defaults
from orpo.generation import generate_batched, load_generator
from orpo.io import InputError, read_jsonl, write_jsonl

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
    adapter: str | Path | None = None, label: str = "model", render: dict[str, Any] | None = None,
    limit: int = 0,
) -> dict[str, Any]:
    """Generate one response per prompt and write jsonl rows (IFEval's `prompt`, `response` plus provenance)."""
    s = {**DEFAULTS, **settings}
    prompts = read_prompts(prompts_path, limit)
    gen = load_generator(model, adapter, render)
    ids = [gen.prompt_ids([{"role": "user", "content": p["prompt"]}]) for p in prompts]
    texts, stats = generate_batched(gen, ids, s, label=f"generate[{label}]")
    provenance = {"model": str(model), "adapter": str(adapter) if adapter else None, "label": label}
    write_jsonl(out_path, ({"key": p.get("key"), "prompt": p["prompt"], "response": text, **provenance,
                            "settings": s} for p, text in zip(prompts, texts)))
    return stats
