"""Rendered preference pairs -> padded [chosen; rejected] token batches, in a seeded, replayable order."""

from __future__ import annotations

from dataclasses import dataclass, fields
from pathlib import Path

import mlx.core as mx
import polars as pl

from orpo.batching import pad_rows

COLUMNS = ["id", "prompt_ids", "chosen_ids", "rejected_ids", "chosen_mask", "rejected_mask"]


@dataclass
class Pairs:
    """Token ids of each pair, the prompt and both responses kept apart."""

    ids: list[str]
    prompt: list[list[int]]
    chosen: list[list[int]]
    rejected: list[list[int]]
    chosen_mask: list[list[int]]
    rejected_mask: list[list[int]]

    def __len__(self) -> int:
        return len(self.ids)

    def select(self, rows: list[int]) -> Pairs:
        """The pairs at `rows`, in that order."""
        return Pairs(*([getattr(self, f.name)[r] for r in rows] for f in fields(self)))


def load_pairs(path: str | Path) -> Pairs:
    """Read a rendered parquet file (the render stage's contract)."""
    df = pl.read_parquet(path, columns=COLUMNS)
    return Pairs(*(df[c].to_list() for c in COLUMNS))


def pair_lengths(pairs: Pairs) -> list[int]:
    """Per pair, the longer of prompt+chosen and prompt+rejected (what its batch must pad to)."""
    return [len(p) + max(len(c), len(r)) for p, c, r in zip(pairs.prompt, pairs.chosen, pairs.rejected)]


def pair_tokens(pairs: Pairs) -> list[int]:
    """Per pair, its tokens with the prompt once: the length of its prefix-shared row."""
    return [len(p) + len(c) + len(r) for p, c, r in zip(pairs.prompt, pairs.chosen, pairs.rejected)]


def pair_batch(pairs: Pairs, rows: list[int], input_multiple: int | None = None) -> tuple[mx.array, mx.array]:
    """Tokens and scoring mask [2B, T] (B chosen sequences, then B rejected): T a multiple of 16, or one more
    than a multiple of `input_multiple` (so the model's inputs, tokens[:, :-1], are a whole multiple long)."""
    seqs, masks = [], []
    for responses, resp_masks in ((pairs.chosen, pairs.chosen_mask), (pairs.rejected, pairs.rejected_mask)):
        for r in rows:
            seqs.append(pairs.prompt[r] + responses[r])
            masks.append([0] * len(pairs.prompt[r]) + resp_masks[r])
    width = (input_multiple, 1) if input_multiple else (16, 0)
    return mx.array(pad_rows(seqs, 0, *width)), mx.array(pad_rows(masks, 0, *width))


def scored_counts(pairs: Pairs) -> mx.array:
    """Scored tokens [2B] of the chosen sequences, then the rejected ones, as every head counts them (a
    sequence's first token has no predecessor and is never scored)."""
    counts = [sum(([0] * len(p) + m)[1:]) for masks in (pairs.chosen_mask, pairs.rejected_mask)
              for p, m in zip(pairs.prompt, masks)]
    return mx.array(counts, mx.float32)
