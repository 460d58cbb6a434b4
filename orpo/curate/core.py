"""The curate stage core: raw or binarized rows -> filtered preference pairs, split, with a manifest.

Each input row ends in exactly one place: train, validation, or one drop reason (drops.REASONS, in
the order they are checked). Rows are streamed; the filters that need the whole set (token lengths,
duplicates, decontamination) run after the per-row ones, in input order.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping
from typing import Any

import polars as pl

from orpo.curate import filters
from orpo.curate.decontam import Decontaminator
from orpo.curate.drops import Drops
from orpo.rows import Item, describe, iter_items
from orpo.curate.recipes import RECIPES
from orpo.curate.schema import FieldError, Pair, detect_form, parse_binarized, parse_raw
from orpo.curate.settings import CurateSettings, resolve_settings
from orpo.curate.tokens import TokenCounter
from orpo.curate.write import split, write_pairs
from orpo.io import InputError
from orpo.settings import as_dict


def _parse(item: Item, recipe: str) -> tuple[str, Any]:
    """(form, RawExample | Pair) for a readable row; FieldError when it fits no schema."""
    form = detect_form(item.row)
    if form == "raw":
        if recipe == "binarized":
            raise FieldError("completions", "recipe 'binarized' takes rows with chosen/rejected; this row is raw")
        return form, parse_raw(item.row, recipe)
    return form, parse_binarized(item.row, item.input_name)


def _length_filter(pairs: list[Pair], counter: TokenCounter, s: CurateSettings, drops: Drops) -> list[Pair]:
    """Drop pairs whose prompt, or prompt + the longer response, exceeds the token limits."""
    texts: list[str] = []
    for p in pairs:
        texts.extend(c for _, c in p.prompt)
        texts.extend((p.chosen, p.rejected))
    counts = iter(counter.count(texts))
    kept = []
    for p in pairs:
        prompt_tokens = sum(next(counts) for _ in p.prompt)
        chosen_tokens, rejected_tokens = next(counts), next(counts)
        if prompt_tokens > s.max_prompt_tokens:
            drops.add("prompt_too_long", p.id)
        elif prompt_tokens + max(chosen_tokens, rejected_tokens) > s.max_pair_tokens:
            drops.add("pair_too_long", p.id)
        else:
            kept.append(p)
    return kept


def _dedup(pairs: list[Pair], drops: Drops) -> list[Pair]:
    """Keep the first pair of each exact prompt (roles and contents), in input order."""
    first = pl.Series([filters.prompt_key(p) for p in pairs], dtype=pl.String).is_first_distinct().to_list()
    for p, keep in zip(pairs, first):
        if not keep:
            drops.add("duplicate_prompt", p.id)
    return [p for p, keep in zip(pairs, first) if keep]


def _drops_truthfulqa_source(s: CurateSettings) -> bool:
    """argilla's cleaned recipe always drops source == truthful_qa; h4 only when asked (its later revision)."""
    return s.drop_truthfulqa or s.recipe == "argilla_clean"


def _decontaminate(pairs: list[Pair], decon: Decontaminator, drops: Drops) -> list[Pair]:
    """Drop pairs whose prompt overlaps an eval prompt (see orpo.curate.decontam)."""
    kept = []
    for p in pairs:
        if decon.contaminated(filters.prompt_text(p)):
            drops.add("contaminated", p.id)
        else:
            kept.append(p)
    return kept


def _manifest(
    s: CurateSettings,
    input_rows: int,
    n_train: int,
    n_val: int,
    drops: Drops,
    sources: list[dict],
    forms: dict,
    questions: set[str] | None,
    counter: TokenCounter,
    decon: Decontaminator | None,
) -> dict:
    """The manifest: counts, drops and everything that produced them (no paths of out_dir, no times)."""
    if decon is not None:
        decontamination = {
            "applied": True,
            "eval_prompts": decon.path,
            "sha256": decon.sha256,
            "eval_prompt_count": decon.eval_count,
            "ngram": decon.n,
            "threshold": decon.threshold,
            "dropped": drops.counts["contaminated"],
        }
    else:
        decontamination = {
            "applied": False,
            "reason": "no eval_prompts given",
            "ngram": s.decontam_ngram,
            "threshold": s.decontam_threshold,
            "dropped": 0,
        }
    return {
        "stage": "curate",
        "input_rows": input_rows,
        "output_rows": {"train": n_train, "validation": n_val, "total": n_train + n_val},
        "dropped": drops.to_manifest(),
        "recipe": s.recipe,
        "seed": s.seed,
        "source": sources,
        "settings": as_dict(s),
        "forms": forms,
        "truthfulqa": {
            "drop_source": _drops_truthfulqa_source(s),
            "questions": s.truthfulqa_questions,
            "question_count": len(questions) if questions is not None else 0,
            "question_filter": "applied" if questions is not None else "skipped: no truthfulqa_questions file given",
        },
        "token_counter": counter.describe(),
        "decontamination": decontamination,
    }


def curate(
    inputs: list[str],
    out_dir: str,
    settings: CurateSettings | Mapping[str, Any] | None,
    tokenizer: str | None = None,
    eval_prompts: str | None = None,
) -> dict:
    """Binarize and filter the input rows into out_dir/{train,validation}.parquet + manifest.json; returns the manifest."""
    s = resolve_settings(settings)
    if not inputs:
        raise ValueError("curate: no inputs given")
    recipe, seed = s.recipe, s.seed
    drop_tqa_source = _drops_truthfulqa_source(s)
    questions = filters.load_questions(s.truthfulqa_questions) if s.truthfulqa_questions else None
    counter = TokenCounter(tokenizer)
    decon = (
        Decontaminator.from_file(eval_prompts, s.decontam_ngram, s.decontam_threshold) if eval_prompts else None
    )
    sources = [describe(spec) for spec in inputs]  # fails on a missing input before any work

    drops = Drops()
    forms = {"raw": 0, "binarized": 0}
    input_rows = 0
    pairs: list[Pair] = []
    for item in iter_items(list(inputs), s.on_error):
        input_rows += 1
        if item.error is not None:
            drops.add("malformed", item.origin)
            continue
        try:
            form, parsed = _parse(item, recipe)
        except FieldError as e:
            if s.on_error == "raise":
                raise item.located(e.field, e.message) from None
            drops.add("malformed", item.origin)
            continue
        forms[form] += 1
        if drop_tqa_source and parsed.source == filters.TRUTHFULQA_SOURCE:
            drops.add("truthfulqa_source", parsed.id)
            continue
        if form == "raw":
            if questions is not None and parsed.instruction.strip() in questions:
                drops.add("truthfulqa_question", parsed.id)
                continue
            result = RECIPES[recipe](parsed, seed)
            if isinstance(result, str):
                drops.add(result, parsed.id)
                continue
            pair = result
        else:
            pair = parsed
            if questions is not None and filters.matches_question(pair, questions):
                drops.add("truthfulqa_question", pair.id)
                continue
        if filters.is_blank(pair.chosen) or filters.is_blank(pair.rejected):
            drops.add("empty_response", pair.id)
        elif pair.chosen == pair.rejected:
            drops.add("identical", pair.id)
        else:
            pairs.append(pair)

    pairs = _length_filter(pairs, counter, s, drops)
    pairs = _dedup(pairs, drops)
    if decon is not None:
        pairs = _decontaminate(pairs, decon, drops)
    train, val = split(pairs, seed, s.validation_fraction)

    manifest = _manifest(s, input_rows, len(train), len(val), drops, sources, forms, questions, counter, decon)
    report_drops("curate", input_rows, drops)
    if not train:
        raise InputError(", ".join(inputs), None, None, f"no training pair left of {input_rows} rows"
                         + (f" (dropped: {_reasons(drops)})" if drops.total() else ""))
    write_pairs(out_dir, "curate", train, val, manifest, input_rows, drops.total())
    return manifest


def _reasons(drops: Drops) -> str:
    return ", ".join(f"{r} {n}" for r, n in drops.counts.items() if n)


def report_drops(stage: str, input_rows: int, drops: Drops) -> None:
    """One warning line on stderr (the stage's log under Snakemake) when rows were dropped."""
    if drops.total():
        print(f"orpo {stage}: warning: dropped {drops.total()} of {input_rows} rows: {_reasons(drops)}",
              file=sys.stderr)
