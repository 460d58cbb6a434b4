"""Pairs -> the engine's forward rows (a Layout) plus where each scored token's predicting hidden state sits.

`plain_rows`: the trainer's [chosen; rejected] causal rows; `shared_rows`: prefix sharing (docs/architecture.md).
With LoRA dropout, a shared row's prompt mask serves both responses: the same distribution per token as two
forwards, not the same draws.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import mlx.core as mx
import numpy as np

from orpo.batching import ladder, pad_rows
from orpo.engine.attention import CHOSEN, MAX_PAIRS_PER_ROW, PROMPT, REJECTED, SplitRows, packed_key_bounds
from orpo.engine.stack import Layout
from orpo.train.data import Pairs, pair_batch


@dataclass
class PackedPairs:
    """A layout and, per scored token, the flat [row * width + position] index of the hidden state predicting it.

    `weights[k, m]` is 1/(scored tokens of sequence k) when target m belongs to sequence k (chosen sequences, then
    rejected): `weights @ logp` is the per-sequence mean. The targets are padded to a rung of `ladder` with weight-0
    entries. `nll_weights` [B, M], for the NLL span prompt_and_response only, averages each chosen sequence's
    prompt and response tokens. `row_tokens` counts the pairs' tokens as the rows hold them (a shared prompt
    once), `two_forward_tokens` as two sequences per pair would; padding is in neither.
    """

    layout: Layout
    index: mx.array
    targets: mx.array
    weights: mx.array
    fallbacks: int
    row_tokens: int = 0
    two_forward_tokens: int = 0
    nll_weights: mx.array | None = None
    share: mx.array | None = None  # packed steps: this micro-batch's pairs / the step's, scaling its loss

    def signature(self) -> tuple:
        """What a compiled step is traced for: the rows' shape, the targets' count and the split structure."""
        return (tuple(self.layout.tokens.shape), int(self.targets.shape[0]), self.layout.split)


def _scored(mask: list[int]) -> list[int]:
    # Token 0 has no predecessor: the naive head never scores it either.
    return [t for t in range(1, len(mask)) if mask[t]]


# Target counts per octave: the head's padding costs at most a quarter of its work, and few shapes occur.
TARGETS_PER_OCTAVE = 4


def _targets(layout: Layout, index: list[int], targets: list[int], groups: list[int], multiple: int,
             row_tokens: int, two_forward_tokens: int, fallbacks: int,
             prompt: tuple[list[int], list[int], list[int]] | None = None) -> PackedPairs:
    """PackedPairs with the targets padded to a ladder rung; groups[k] = scored tokens of sequence k, in order;
    `prompt` (index, targets, count per pair) adds the chosen prompts' tokens as targets for the NLL only."""
    b = len(groups) // 2
    p_index, p_targets, p_groups = prompt or ([], [], [0] * b)
    m = len(index) + len(p_index)
    total = ladder(max(m, 1), multiple, TARGETS_PER_OCTAVE)
    w = np.zeros((len(groups), total), np.float32)
    starts = np.cumsum([0] + groups)
    for k, n in enumerate(groups):
        w[k, starts[k]:starts[k + 1]] = 1.0 / n if n else 0.0
    nll = None
    if prompt is not None:
        nll = np.zeros((b, total), np.float32)
        p_starts = len(index) + np.cumsum([0] + p_groups)
        for k in range(b):
            n = groups[k] + p_groups[k]
            nll[k, starts[k]:starts[k + 1]] = nll[k, p_starts[k]:p_starts[k + 1]] = 1.0 / n if n else 0.0
        nll = mx.array(nll)
    pad = [0] * (total - m)  # weight 0: the head scores them, the loss never sees them
    return PackedPairs(layout, mx.array(index + p_index + pad, mx.int32),
                       mx.array(targets + p_targets + pad, mx.int32), mx.array(w), fallbacks, row_tokens,
                       two_forward_tokens, nll)


def _prompt_targets(pairs: Pairs, bases: list[int], nll_span: str) -> tuple[list[int], list[int], list[int]] | None:
    """Each chosen prompt's tokens as targets (flat index, token, count per pair); None for the response span.
    Every layout holds pair i's chosen sequence from flat index bases[i] on: prompt token t >= 1 is predicted at
    bases[i] + t - 1."""
    if nll_span == "response":
        return None
    index, targets, counts = [], [], []
    for i, p in enumerate(pairs.prompt):
        index += [bases[i] + t - 1 for t in range(1, len(p))]
        targets += p[1:]
        counts.append(max(0, len(p) - 1))
    return index, targets, counts


def shared_prompt_length(a: list[int], mask_a: list[int], b: list[int], mask_b: list[int]) -> int | None:
    """Length of the prompt both sequences share (tokens before the first scored one), or None if they differ."""
    # Each side keeps at least its last input token of its own: share at most len - 1 tokens.
    p = min(next(iter(_scored(mask_a)), len(a)), len(a) - 1)
    if p < 1 or p != min(next(iter(_scored(mask_b)), len(b)), len(b) - 1) or a[:p] != b[:p]:
        return None
    return p


def plain_rows(pairs: Pairs, input_multiple: int | None = None, nll_span: str = "response") -> PackedPairs:
    """The trainer's layout, exactly: `pair_batch`'s B chosen then B rejected rows, inputs = tokens[:, :-1]."""
    tokens, mask = (np.array(a) for a in pair_batch(pairs, list(range(len(pairs))), input_multiple))
    scored = mask[:, 1:] > 0
    rows, cols = np.nonzero(scored)  # row-major: sequence by sequence, as the weights expect
    width = tokens.shape[1] - 1
    real = sum(2 * len(p) + len(c) + len(r) for p, c, r in zip(pairs.prompt, pairs.chosen, pairs.rejected))
    return _targets(Layout(mx.array(tokens[:, :-1])), (rows * width + cols).tolist(), tokens[rows, cols + 1].tolist(),
                    scored.sum(axis=1).tolist(), input_multiple or 16, real, real, 0,
                    _prompt_targets(pairs, [i * width for i in range(len(pairs))], nll_span))


@dataclass
class _Blocks:
    """Each pair's shared-prefix block: `heads[i]` [prompt; chosen[:-1]], `tails[i]` rejected's own tokens,
    `shared[i]` the prompt length they share (0 where the prompts differ: `fallbacks` counts those), the
    scored token positions of each side and their tokens (chosen sequences, then rejected)."""

    heads: list[list[int]]
    tails: list[list[int]]
    shared: list[int]
    scored: tuple[list[list[int]], list[list[int]]]
    targets: list[int]
    fallbacks: int

    def lengths(self) -> list[int]:
        return [len(h) + len(t) for h, t in zip(self.heads, self.tails)]

    def where(self, starts: list[int]) -> tuple[list[list[int]], list[list[int]]]:
        """Per pair, the offsets from its block's start of the hidden states predicting its scored tokens (chosen,
        rejected), rejected's block at offset `starts[i]`: token t is predicted from position t-1, for rejected in
        the shared prompt or in its own block."""
        return ([[t - 1 for t in sc] for sc in self.scored[0]],
                [[t - 1 if t <= p else start + t - 1 - p for t in sr]
                 for sr, p, start in zip(self.scored[1], self.shared, starts)])

    def two_forward_tokens(self) -> int:
        return sum(len(h) + len(t) + p + 2 for h, t, p in zip(self.heads, self.tails, self.shared))

    def counts(self) -> list[int]:
        """Scored tokens per sequence: every chosen one, then every rejected one."""
        return [len(g) for g in self.scored[0] + self.scored[1]]


def _sequences(pairs: Pairs, i: int) -> tuple[list[int], list[int], list[int], list[int], int | None]:
    """Pair i's two whole sequences and scoring masks, and the prompt length they share (None where they differ)."""
    prompt = pairs.prompt[i]
    full_c, full_r = prompt + pairs.chosen[i], prompt + pairs.rejected[i]
    mc, mr = [0] * len(prompt) + pairs.chosen_mask[i], [0] * len(prompt) + pairs.rejected_mask[i]
    return full_c, mc, full_r, mr, shared_prompt_length(full_c, mc, full_r, mr)


def _blocks(pairs: Pairs) -> _Blocks:
    heads, tails, shared = [], [], []
    scored, targets = ([], []), ([], [])  # (chosen, rejected), per pair
    fallbacks = 0
    for i in range(len(pairs)):
        full_c, mc, full_r, mr, p = _sequences(pairs, i)
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
    return _Blocks(heads, tails, shared, scored, targets[0] + targets[1], fallbacks)


def block_lengths(pairs: Pairs) -> list[int]:
    """Per pair, the positions of its shared-prefix block (a tight row's, or its part of a packed row): its head
    [prompt; chosen[:-1]] and rejected's own tokens, without building them."""
    out = []
    for i in range(len(pairs)):
        full_c, _, full_r, _, p = _sequences(pairs, i)
        out.append(len(full_c) - 1 + len(full_r) - 1 - (p or 0))
    return out


def shared_rows(pairs: Pairs, input_multiple: int | None = None, attention: str = "auto",
                tight: bool = True, nll_span: str = "response") -> PackedPairs:
    """Prefix sharing: one row per pair holding its prompt once, chosen, then rejected blind to chosen.

    `attention` "split" takes aligned rows ([prompt; chosen[:-1]; pad | rejected own; pad]), "exclusion" tight
    ones ([prompt; chosen[:-1]; rejected own; pad]), "auto" chooses (docs/architecture.md), taking the plain rows
    where tight ones would be chosen but not `tight`. A pair whose prompts differ gets two blocks, and is counted.
    """
    multiple = input_multiple or 16
    blocks = _blocks(pairs)
    heads, tails, shared = blocks.heads, blocks.tails, blocks.shared
    tight_width = ladder(max(blocks.lengths()), multiple)
    aligned_width = ladder(max(map(len, heads)), multiple) + ladder(max(map(len, tails)), multiple)
    aligned = attention == "split" or (attention == "auto" and len(set(shared)) == 1 and aligned_width <= tight_width)
    if not aligned and attention == "auto" and not tight:
        return plain_rows(pairs, input_multiple, nll_span)
    if aligned:
        head_block = pad_rows(heads, 0, multiple)
        tokens = np.concatenate([head_block, pad_rows(tails, 0, multiple)], axis=1)
        starts = [head_block.shape[1]] * len(pairs)
    else:
        tokens = pad_rows([h + t for h, t in zip(heads, tails)], 0, multiple)
        starts = [len(h) for h in heads]
    # Alignment of rejected's attention only where widths are asked for (CUDA's 128: SplitRows explains why).
    split = _split_rows(shared, starts[0], input_multiple or 1) if aligned else None
    layout = _block_layout(tokens, np.array(shared), np.array(starts), split)
    bases = [i * tokens.shape[1] for i in range(len(pairs))]
    return _laid_out(pairs, blocks, layout, bases, starts, multiple, nll_span)


def packed_rows(pairs: Pairs, per_row: list[int], width: int, multiple: int = 16,
                nll_span: str = "response") -> PackedPairs:
    """Several pairs per row: row r holds the next per_row[r] pairs' blocks ([prompt; chosen[:-1]; rejected own])
    one after another, then padding to `width`; each pair's tokens attend only within its block, rejected blind
    to chosen (Layout.segments and roles), RoPE positions restarted per block."""
    if sum(per_row) != len(pairs) or max(per_row) > MAX_PAIRS_PER_ROW:
        raise ValueError(f"rows of {per_row} pairs for {len(pairs)} pairs (at most {MAX_PAIRS_PER_ROW} a row)")
    blocks = _blocks(pairs)
    tokens = np.zeros((len(per_row), width), np.int32)
    positions = np.zeros_like(tokens)
    roles = np.full_like(tokens, PROMPT)
    segments = np.repeat(np.minimum(per_row, MAX_PAIRS_PER_ROW - 1), width).reshape(tokens.shape)  # padding: its own
    bases = []
    i = 0
    for r, count in enumerate(per_row):
        at = 0
        for place in range(count):
            head, tail, p = blocks.heads[i], blocks.tails[i], blocks.shared[i]
            end = at + len(head) + len(tail)
            if end > width:
                raise ValueError(f"row {r}: its pairs' blocks take {end} positions, more than the width {width}")
            tokens[r, at:end] = head + tail
            positions[r, at:end] = [*range(len(head)), *range(p, p + len(tail))]
            roles[r, at + p:at + len(head)] = CHOSEN
            roles[r, at + len(head):end] = REJECTED
            segments[r, at:end] = place
            bases.append(r * width + at)
            at, i = end, i + 1
    layout = Layout(mx.array(tokens), mx.array(positions), segments=mx.array(segments, mx.int32),
                    roles=mx.array(roles), key_bounds=mx.array(packed_key_bounds(segments, roles)))
    return _laid_out(pairs, blocks, layout, bases, [len(h) for h in blocks.heads], multiple, nll_span)


def _laid_out(pairs: Pairs, blocks: _Blocks, layout: Layout, bases: list[int], starts: list[int], multiple: int,
              nll_span: str) -> PackedPairs:
    """PackedPairs of `blocks` in `layout`: pair i's block from flat index bases[i] on, rejected's own tokens from
    offset starts[i] in it."""
    index = [bases[i] + j for side in blocks.where(starts) for i, idx in enumerate(side) for j in idx]
    two_forward = blocks.two_forward_tokens()
    return _targets(layout, index, blocks.targets, blocks.counts(), multiple, two_forward - sum(blocks.shared),
                    two_forward, blocks.fallbacks, _prompt_targets(pairs, bases, nll_span))


def _split_rows(shared: list[int], start: int, align: int) -> SplitRows:
    """SplitRows of aligned rows: runs of consecutive rows with one prompt length get one rejected attention."""
    groups, first = [], 0
    for p, run in itertools.groupby(shared):
        size = len(list(run))
        groups.append((first, first + size, p))
        first += size
    return SplitRows(start, tuple(groups), align)


def _block_layout(tokens: np.ndarray, shared: np.ndarray, starts: np.ndarray, split: SplitRows | None) -> Layout:
    """Positions and hidden spans of rows [prompt; chosen own; (pad); rejected own; pad] whose rejected blocks start
    at `starts` (one column for all rows when aligned): from there on (padding after it too) nothing sees chosen's
    own keys and the pad after them, shared .. start - 1."""
    pos = np.arange(tokens.shape[1])[None, :]
    in_rejected = pos >= starts[:, None]
    positions = np.where(in_rejected, pos - starts[:, None] + shared[:, None], pos)
    spans = np.stack([shared, starts], axis=1).astype(np.int32)
    return Layout(mx.array(tokens), mx.array(positions, mx.int32), mx.array(spans), split)
