"""Pairs -> forward rows plus where each scored token's predicting hidden state sits.

Two layouts. `plain_rows`: the trainer's [chosen; rejected] causal rows (2B rows). `shared_rows`: prefix
sharing, one row per pair holding [prompt; chosen; pad | rejected; pad] with a block mask (rejected cannot
see chosen) and RoPE positions restarted at the prompt length for rejected, so the prompt is computed once.
A pair's prompt is everything before its first scored token; a pair whose chosen and rejected prompts
differ (a pair given as two full sequences with `prompt=[]`) falls back to two independent blocks in its
row (nothing shared, rejected's positions restart at 0) and is counted.
With LoRA dropout, a shared row draws its masks over the row's own shape, and the prompt's mask serves
both responses: the same distribution per token as two forwards, but not the same draws (deterministic
all the same: the keys are (seed, step, micro-batch, module)).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import mlx.core as mx
import numpy as np

from orpo.batching import pad_rows
from orpo.engine.attention import SplitRows
from orpo.engine.stack import Layout
from orpo.train.data import Pairs, pair_batch


@dataclass
class PackedPairs:
    """A layout and, per scored token, the flat [row * width + position] index of the hidden state predicting it.

    `weights[k, m]` is 1/(scored tokens of sequence k) when target m belongs to sequence k: rows 0..B-1 are
    the chosen sequences, B..2B-1 the rejected ones, so `weights @ logp` is the per-sequence mean.
    """

    layout: Layout
    index: mx.array
    targets: mx.array
    weights: mx.array
    fallbacks: int


def _sequences(pairs: Pairs, i: int) -> tuple[list[int], list[int], list[int], list[int]]:
    """Pair i as two full sequences and their scoring masks."""
    p = pairs.prompt[i]
    zeros = [0] * len(p)
    return p + pairs.chosen[i], zeros + pairs.chosen_mask[i], p + pairs.rejected[i], zeros + pairs.rejected_mask[i]


def _scored(mask: list[int]) -> list[int]:
    # Token 0 has no predecessor: the naive head never scores it either.
    return [t for t in range(1, len(mask)) if mask[t]]


def _weights(groups: list[list[int]], total: int) -> mx.array:
    w = np.zeros((len(groups), total), np.float32)
    start = 0
    for k, n in enumerate(len(g) for g in groups):
        w[k, start:start + n] = 1.0 / n if n else 0.0
        start += n
    return mx.array(w)


def shared_prompt_length(a: list[int], mask_a: list[int], b: list[int], mask_b: list[int]) -> int | None:
    """Length of the prompt both sequences share (tokens before the first scored one), or None if they differ."""
    # Each side keeps at least its last input token of its own: share at most len - 1 tokens.
    p = min(next(iter(_scored(mask_a)), len(a)), len(a) - 1)
    if p < 1 or p != min(next(iter(_scored(mask_b)), len(b)), len(b) - 1) or a[:p] != b[:p]:
        return None
    return p


def plain_rows(pairs: Pairs, input_multiple: int | None = None) -> PackedPairs:
    """The trainer's layout, exactly: `pair_batch`'s B chosen then B rejected rows, inputs = tokens[:, :-1]."""
    tokens, mask = (np.array(a) for a in pair_batch(pairs, list(range(len(pairs))), input_multiple))
    scored = mask[:, 1:] > 0
    rows, cols = np.nonzero(scored)  # row-major: sequence by sequence, as `weights` expects
    width = tokens.shape[1] - 1
    groups = [list(np.nonzero(r)[0]) for r in scored]
    return PackedPairs(Layout(mx.array(tokens[:, :-1])), mx.array(rows * width + cols, mx.int32),
                       mx.array(tokens[rows, cols + 1], mx.int32), _weights(groups, len(rows)), 0)


def shared_rows(pairs: Pairs, input_multiple: int | None = None) -> PackedPairs:
    """Prefix sharing: one row [prompt; chosen[:-1]; pad | rejected own; pad] per pair, rejected blind to chosen.

    Every row's rejected block starts at one column, a multiple of `input_multiple` (16 if None), and the
    row ends at another, so both attentions of SplitRows get widths of that multiple (128 on CUDA: cuDNN's
    backward). The pad between chosen and rejected is hidden from rejected like chosen's own tokens; pads
    are never scored. The layout holds per-token vectors only (positions, which tokens are rejected's, which
    keys rejected may not see) and the SplitRows structure; an [L, L] visibility is built on the device only
    where a layer needs it (Layout.visible).
    """
    multiple = input_multiple or 16
    heads, tails, shared = [], [], []
    scored, targets = ([], []), ([], [])  # (chosen, rejected), per pair
    fallbacks = 0
    for i in range(len(pairs)):
        full_c, mc, full_r, mr = _sequences(pairs, i)
        p = shared_prompt_length(full_c, mc, full_r, mr)
        if p is None:
            fallbacks, p = fallbacks + 1, 0
        heads.append(full_c[:-1])
        tails.append(full_r[p:-1])
        shared.append(p)
        sc, sr = _scored(mc), _scored(mr)
        scored[0].append(sc)
        scored[1].append(sr)
        targets[0].extend(full_c[t] for t in sc)
        targets[1].extend(full_r[t] for t in sr)
    head_block = pad_rows(heads, 0, multiple)
    start = head_block.shape[1]  # where every row's rejected block begins
    tokens = np.concatenate([head_block, pad_rows(tails, 0, multiple)], axis=1)
    width = tokens.shape[1]
    # Token t is predicted from position t-1: for rejected, in the shared prompt or in its own block.
    where = ([[t - 1 for t in sc] for sc in scored[0]],
             [[t - 1 if t <= p else start + t - 1 - p for t in sr] for sr, p in zip(scored[1], shared)])
    index = [i * width + j for side in where for i, idx in enumerate(side) for j in idx]
    # Alignment of rejected's attention only where widths are asked for (CUDA's 128: SplitRows explains why).
    align = input_multiple or 1
    return PackedPairs(_block_layout(tokens, np.array(shared), start, align), mx.array(index, mx.int32),
                       mx.array(targets[0] + targets[1], mx.int32), _weights(scored[0] + scored[1], len(index)),
                       fallbacks)


def _block_layout(tokens: np.ndarray, shared: np.ndarray, start: int, align: int) -> Layout:
    """Positions, rejected's tokens, the keys rejected may not see, and the SplitRows of rows
    [prompt; chosen own; pad | rejected own; pad] (prompt lengths, rejected's start column)."""
    pos = np.arange(tokens.shape[1])[None, :]
    in_rejected = np.broadcast_to(pos >= start, tokens.shape)  # padding after it too: it sees what rejected sees
    hidden = (pos >= shared[:, None]) & (pos < start)  # chosen's own keys and the pad after them
    positions = np.where(in_rejected, pos - start + shared[:, None], pos)
    groups, first = [], 0  # runs of consecutive rows with one prompt length: one rejected attention each
    for p, run in itertools.groupby(shared.tolist()):
        size = len(list(run))
        groups.append((first, first + size, p))
        first += size
    return Layout(mx.array(tokens), mx.array(positions, mx.int32), mx.array(in_rejected), mx.array(hidden),
                  SplitRows(start, tuple(groups), align))
