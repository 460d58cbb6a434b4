"""SPIN's drop reasons, tallied with curate's Drops (counts and a few example ids per reason)."""

from __future__ import annotations

from orpo.curate.drops import MAX_EXAMPLES
from orpo.curate.drops import Drops as _CurateDrops

REASONS = (
    "malformed",  # unreadable line or schema error, with on_error: skip (examples: file:line)
    "empty_gold",  # the gold answer is empty or whitespace only
    "prompt_too_long",  # templated generation prompt tokens > max_prompt_tokens
    "answer_too_long",  # gold answer tokens > max_answer_tokens
    "duplicate_prompt",  # same prompt turns as an earlier kept row
    "over_limit",  # not in the seeded subset of `limit` prompts
    "empty_generation",  # the model's answer is empty or whitespace only
    "generation_equals_gold",  # the model already gives the gold answer (stripped): nothing to learn
)

__all__ = ["MAX_EXAMPLES", "REASONS", "Drops"]


class Drops(_CurateDrops):
    """curate's tally over SPIN's reasons."""

    def __init__(self) -> None:
        super().__init__(REASONS)
