"""Which SFT rows get a generation: token limits, first of each prompt, and a seeded subset of `limit`."""

from __future__ import annotations

import hashlib

from orpo.curate import filters
from orpo.curate.schema import Pair
from orpo.spin.drops import Drops


def length_filter(
    rows: list[Pair], prompt_lens: list[int] | None, answer_lens: list[int] | None,
    max_prompt: int, max_answer: int, drops: Drops,
) -> list[Pair]:
    """Drop rows whose templated prompt or gold answer is over its token limit (0 or no counts = no limit)."""
    kept = []
    for i, row in enumerate(rows):
        if max_prompt and prompt_lens is not None and prompt_lens[i] > max_prompt:
            drops.add("prompt_too_long", row.id)
        elif max_answer and answer_lens is not None and answer_lens[i] > max_answer:
            drops.add("answer_too_long", row.id)
        else:
            kept.append(row)
    return kept


def dedup(rows: list[Pair], drops: Drops) -> list[Pair]:
    """Keep the first row of each exact prompt (roles and contents), in input order."""
    seen: set[str] = set()
    kept = []
    for row in rows:
        key = filters.prompt_key(row)
        if key in seen:
            drops.add("duplicate_prompt", row.id)
        else:
            seen.add(key)
            kept.append(row)
    return kept


def seeded_subset(rows: list[Pair], limit: int, seed: int, drops: Drops) -> list[Pair]:
    """The `limit` rows with the smallest sha256(f"{seed}:limit:{id}") (ties by position), in input order.

    Independent of the iteration, so every iteration asks the same prompts of a newer model.
    """
    if limit <= 0 or limit >= len(rows):
        return list(rows)

    def key(i: int) -> tuple[str, int]:
        return hashlib.sha256(f"{seed}:limit:{rows[i].id}".encode()).hexdigest(), i

    chosen = set(sorted(range(len(rows)), key=key)[:limit])
    for i, row in enumerate(rows):
        if i not in chosen:
            drops.add("over_limit", row.id)
    return [row for i, row in enumerate(rows) if i in chosen]
