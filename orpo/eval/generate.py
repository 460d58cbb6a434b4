"""The `generate` stage core: responses to the eval prompts, saved with their settings."""

from __future__ import annotations

import sys
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from orpo.generation import generate_counted, load_generator
from orpo.io import InputError, read_jsonl, write_jsonl
from orpo.render.settings import PromptSettings, RenderSettings, prompt_settings
from orpo.settings import as_dict, typed


@dataclass(frozen=True)
class GenerateSettings:
    """The `generate` section (the schema describes each key)."""

    adapter: str | int
    max_tokens: int
    batch_size: int
    temperature: float
    top_p: float
    seed: int
    stop: tuple[str, ...]


MAX_EXAMPLES = 5  # prompts named per warning line and per count in the stats


def read_prompt_lines(path: str | Path, limit: int = 0) -> list[tuple[int, dict[str, Any]]]:
    """(line, row) of each eval prompt, in file order; the whole file is checked, then `limit` applies.

    A missing, non-string or blank `prompt`, or a `key` that is not an integer or string or repeats an
    earlier one, is refused naming the file, line and field, before anything is generated.
    """
    rows, first = [], {}
    for lineno, row in read_jsonl(path):
        prompt = row.get("prompt")
        if not isinstance(prompt, str):
            raise InputError(path, lineno, "prompt", "missing or not a string")
        # Refused, not dropped: a blank prompt is a defect of the file whatever the model (too-long ones depend on it).
        if not prompt.strip():
            raise InputError(path, lineno, "prompt", "empty or whitespace only")
        key = row.get("key")
        if key is not None:
            if isinstance(key, bool) or not isinstance(key, (int, str)):
                raise InputError(path, lineno, "key", f"expected an integer or a string, got {type(key).__name__}")
            if key in first:
                raise InputError(path, lineno, "key", f"duplicate key {key!r} (first on line {first[key]})")
            first[key] = lineno
        rows.append((lineno, row))
    if not rows:
        raise InputError(path, None, None, "no prompts")
    return rows[:limit] if limit > 0 else rows


def _named(key: Any, lineno: int, tokens: int, budget: int | None = None) -> str:
    """One prompt as warnings and stats name it: key, line, prompt tokens (and the budget it was cut to)."""
    cut = f" -> {budget}" if budget is not None else ""
    return f"key {key!r} (line {lineno}, {tokens} tokens{cut})"


def generate(
    model: str | Path, prompts_path: str | Path, out_path: str | Path, settings: GenerateSettings | Mapping[str, Any],
    adapter: str | Path | None = None, label: str = "model",
    render: PromptSettings | RenderSettings | Mapping[str, Any] | None = None,
    limit: int = 0, dtype: str = "auto",
) -> dict[str, Any]:
    """Generate one response per prompt and write jsonl rows (IFEval's `prompt`, `response` plus provenance),
    the model computing in `dtype` (model.dtype).

    The model's context (config.json) bounds prompt + response: a prompt that fills it is not generated and
    keeps its row with an empty response and a `dropped` reason, so scoring counts it as not followed; a
    prompt that leaves less room than `max_tokens` generates what fits. Both are counted in the returned
    stats and named in a warning on stderr; when no prompt fits, nothing is written and the stage fails.
    """
    s, render = typed(GenerateSettings, "generate", settings), prompt_settings(render)
    name = f"generate[{label}]"
    located = read_prompt_lines(prompts_path, limit)
    gen = load_generator(model, adapter, render, dtype)
    ids = [gen.prompt_ids([{"role": "user", "content": p["prompt"]}]) for _, p in located]
    budgets = [gen.budget(len(x), s.max_tokens) for x in ids]
    too_long = [i for i, x in enumerate(ids) if gen.context is not None and len(x) >= gen.context]
    skipped = set(too_long)
    cut = [i for i, b in enumerate(budgets) if i not in skipped and b < s.max_tokens]
    where = f"{gen.context} positions, {gen.context_source}"

    def named(idx: list[int], show_budget: bool = False) -> list[str]:
        """The first prompts of `idx` as warnings and stats name them."""
        return [_named(located[i][1].get("key"), located[i][0], len(ids[i]), budgets[i] if show_budget else None)
                for i in idx[:MAX_EXAMPLES]]

    def listed(idx: list[int], show_budget: bool = False) -> str:
        return ", ".join(named(idx, show_budget)) + (", ..." if len(idx) > MAX_EXAMPLES else "")

    if too_long and len(too_long) == len(ids):
        shortest = min(len(x) for x in ids)
        raise InputError(prompts_path, None, "prompt", f"none of the {len(ids)} prompts fits the model's context "
                         f"({where}): the shortest renders to {shortest} tokens")
    if too_long:
        print(f"{name}: warning: {len(too_long)} of {len(ids)} prompts fill the model's context ({where}) and are "
              f"not generated (empty response, scored as not followed): {listed(too_long)}", file=sys.stderr, flush=True)

    kept = [i for i in range(len(ids)) if i not in skipped]
    texts, counts, stats = generate_counted(gen, [ids[i] for i in kept], as_dict(s), label=name,
                                            budgets=[budgets[i] for i in kept])
    responses = dict(zip(kept, zip(texts, counts)))
    reached = [i for i in cut if responses[i][1] >= budgets[i]]
    if cut:
        print(f"{name}: warning: {len(cut)} of {len(ids)} prompts leave less than max_tokens {s.max_tokens} in "
              f"the model's context ({where}): generated up to what fits, {len(reached)} responses stopped there: "
              f"{listed(reached or cut, True)}", file=sys.stderr, flush=True)

    provenance = {"model": str(model), "adapter": str(adapter) if adapter else None, "label": label,
                  "dtype": gen.precision.dtype}

    def row(i: int) -> dict[str, Any]:
        lineno, p = located[i]
        text, count = responses.get(i, ("", 0))
        dropped = (f"prompt_too_long: {len(ids[i])} prompt tokens, the model's context is {where}"
                   if i in skipped else None)
        return {"key": p.get("key"), "prompt": p["prompt"], "response": text, **provenance, "settings": as_dict(s),
                "prompt_tokens": len(ids[i]), "max_tokens": 0 if dropped else budgets[i], "generated_tokens": count,
                "dropped": dropped}

    write_jsonl(out_path, (row(i) for i in range(len(ids))))

    return {**stats, "prompts": len(ids), "generated_prompts": len(kept),
            "context": {"positions": gen.context, "source": gen.context_source},
            "precision": gen.precision.record(),
            "dropped": {"prompt_too_long": {"count": len(too_long), "examples": named(too_long)}},
            "budget_cut": {"count": len(cut), "examples": named(cut, True), "reached": len(reached)}}
