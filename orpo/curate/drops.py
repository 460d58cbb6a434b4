"""Tally of dropped rows: a count and a few examples per reason, in the order reasons are checked."""

from __future__ import annotations

REASONS = (
    "malformed",  # unreadable line or schema error, with on_error: skip (examples: file:line)
    "truthfulqa_source",  # source == "truthful_qa"
    "truthfulqa_question",  # a user turn equals a TruthfulQA question
    "too_few_completions",  # fewer than 2 completions (argilla_clean: fewer than 2 with a score)
    "tie",  # argilla_clean: no completion rated strictly below the best
    "empty_response",  # chosen or rejected empty / whitespace only
    "identical",  # chosen == rejected
    "prompt_too_long",  # prompt tokens > max_prompt_tokens
    "pair_too_long",  # prompt + longer response tokens > max_pair_tokens
    "duplicate_prompt",  # same prompt turns as an earlier kept row
    "contaminated",  # n-gram overlap with an eval prompt >= decontam_threshold
)
MAX_EXAMPLES = 5


class Drops:
    """Counts and first examples of every drop reason."""

    def __init__(self, reasons: tuple[str, ...] = REASONS) -> None:
        self.reasons = reasons
        self.counts = {r: 0 for r in reasons}
        self.examples: dict[str, list[str]] = {r: [] for r in reasons}

    def add(self, reason: str, example: str) -> None:
        """Count one dropped row."""
        self.counts[reason] += 1  # KeyError on an unknown reason: every reason is declared above
        if len(self.examples[reason]) < MAX_EXAMPLES:
            self.examples[reason].append(example)

    def total(self) -> int:
        """All dropped rows."""
        return sum(self.counts.values())

    def to_manifest(self) -> dict:
        """{reason: {count, examples}} for every reason checked, zero counts included."""
        return {r: {"count": self.counts[r], "examples": list(self.examples[r])} for r in self.reasons}
