"""The spin stage core: SFT rows -> (gold, the generator's own answer) preference pairs, split, with a manifest.

Each input row ends in exactly one place: train, validation, or one drop reason (drops.REASONS, in
the order they are checked). Rows are read and checked first, then the generator is loaded and only
the rows that survive the token limits, duplicates and `limit` are generated for.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping
from dataclasses import replace
from pathlib import Path
from typing import Any

from orpo.curate import filters
from orpo.rows import describe, iter_items
from orpo.curate.schema import FieldError, Pair
from orpo.curate.tokens import TokenCounter
from orpo.curate.write import split, write_pairs
from orpo.generation import Generator, generate_batched, load_generator
from orpo.io import sha256_file
from orpo.render.settings import PromptSettings, RenderSettings, prompt_settings
from orpo.render.template import resolve_model_dir
from orpo.spin.drops import Drops
from orpo.spin.schema import FORMS, parse_sft
from orpo.spin.selection import dedup, length_filter, seeded_subset
from orpo.settings import as_dict
from orpo.spin.settings import GENERATION_KEYS, SpinSettings, resolve_settings


def read_sft(inputs: list[str], on_error: str, drops: Drops) -> tuple[int, list[Pair], dict[str, int]]:
    """(input rows, readable examples with a non-blank gold, rows per form); malformed rows raise or are counted."""
    forms = {f: 0 for f in FORMS}
    rows: list[Pair] = []
    n = 0
    for item in iter_items(list(inputs), on_error):
        n += 1
        if item.error is not None:
            drops.add("malformed", item.origin)
            continue
        try:
            form, example = parse_sft(item.row, item.input_name)
        except FieldError as e:
            if on_error == "raise":
                raise item.located(e.field, e.message) from None
            drops.add("malformed", item.origin)
            continue
        forms[form] += 1
        if filters.is_blank(example.chosen):
            drops.add("empty_gold", example.id)
        else:
            rows.append(example)
    return n, rows, forms


def prompt_ids(gen: Generator, row: Pair) -> list[int]:
    """The row's generation prompt as token ids, rendered with the training chat template."""
    return gen.prompt_ids([{"role": role, "content": content} for role, content in row.prompt])


def _pairs(rows: list[Pair], texts: list[str], drops: Drops) -> list[Pair]:
    """Rows with their generation as `rejected`, minus empty generations and those equal to the gold."""
    pairs = []
    for row, text in zip(rows, texts):
        if filters.is_blank(text):
            drops.add("empty_generation", row.id)
        elif text.strip() == row.chosen.strip():
            drops.add("generation_equals_gold", row.id)
        else:
            pairs.append(replace(row, rejected=text))
    return pairs


def _generator_record(gen: Generator, model: str, adapter: str | None) -> dict:
    """What generated the rejected answers (no times, so equal runs give equal manifests)."""
    adapter_file = Path(adapter) / "adapters.safetensors" if adapter else None
    return {
        "model": str(model),
        "adapter": str(adapter) if adapter else None,
        "adapter_sha256": sha256_file(adapter_file) if adapter_file and adapter_file.exists() else None,
        "template": {"source": gen.chat.source, "sha256": gen.chat.sha256, "kwargs": gen.template_kwargs},
        "precision": gen.precision.record(),
    }


def spin_pairs(
    sft_inputs: list[str],
    model: str | Path,
    adapter: str | Path | None,
    out_dir: str | Path,
    settings: SpinSettings | Mapping[str, Any] | None,
    iteration: int,
    render: PromptSettings | RenderSettings | Mapping[str, Any] | None = None,
    dtype: str = "auto",
) -> dict:
    """Write SPIN pairs (chosen = gold, rejected = the generator's answer) to out_dir/{train,validation}.parquet
    + manifest.json; returns the manifest. Iteration k > 1 needs the adapter trained in iteration k - 1.

    `render` is the render stage's settings (template override, template_kwargs): prompts are rendered for
    generation exactly as render will render them for training. The generator computes in `dtype` (model.dtype).
    """
    s, render = resolve_settings(settings), prompt_settings(render)
    if isinstance(iteration, bool) or not isinstance(iteration, int) or iteration < 1:
        raise ValueError(f"spin: iteration must be an integer >= 1, got {iteration!r}")
    if iteration > 1 and not adapter:
        # Without it iteration k would repeat iteration 1's generations.
        raise ValueError(f"spin: iteration {iteration} needs the adapter trained in iteration {iteration - 1}")
    if not sft_inputs:
        raise ValueError("spin: no SFT inputs given")
    adapter = str(adapter) if adapter else None
    sources = [describe(spec) for spec in sft_inputs]  # fails on a missing input before any work

    drops = Drops()
    input_rows, rows, forms = read_sft(sft_inputs, s.on_error, drops)
    gen = load_generator(model, adapter, render, dtype)
    # Token counts only where a limit asks for them; ids are rebuilt for the rows kept (a large SFT set's ids
    # would not fit in memory as Python lists).
    prompt_lens = [len(prompt_ids(gen, r)) for r in rows] if s.max_prompt_tokens else None
    counter = TokenCounter(str(resolve_model_dir(model) / "tokenizer.json")) if s.max_answer_tokens else None
    answer_lens = counter.count([r.chosen for r in rows]) if counter else None
    rows = length_filter(rows, prompt_lens, answer_lens, s.max_prompt_tokens, s.max_answer_tokens, drops)
    rows = seeded_subset(dedup(rows, drops), s.limit, s.seed, drops)

    gen_settings = {k: getattr(s, k) for k in GENERATION_KEYS}
    texts, stats = generate_batched(
        gen, [prompt_ids(gen, r) for r in rows], gen_settings, label=f"spin[iteration {iteration}]")
    print(f"spin[iteration {iteration}]: {stats}", file=sys.stderr, flush=True)
    train, val = split(_pairs(rows, texts, drops), s.seed, s.validation_fraction)

    manifest = {
        "stage": "spin",
        "iteration": iteration,
        "input_rows": input_rows,
        "output_rows": {"train": len(train), "validation": len(val), "total": len(train) + len(val)},
        "dropped": drops.to_manifest(),
        "forms": forms,
        "source": sources,
        "generator": _generator_record(gen, str(model), adapter),
        "generation": {**gen_settings, "prompts": stats["prompts"], "generated_tokens": stats["generated_tokens"]},
        "token_counts": {
            "prompt": "generation prompt ids (chat template)" if prompt_lens is not None else "not counted (no limit)",
            "answer": counter.describe() if counter else "not counted (no limit)",
        },
        "settings": as_dict(s),
    }
    if not train:
        # Fail here, naming why, rather than in train ("0 rows"); e.g. a collapsed generator gives only blanks.
        counts = {r: d["count"] for r, d in manifest["dropped"].items() if d["count"]}
        raise ValueError(f"spin: iteration {iteration} left no pairs from {input_rows} input rows; dropped: {counts}")

    write_pairs(out_dir, "spin", train, val, manifest, input_rows, drops.total())
    return manifest
