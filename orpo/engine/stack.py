"""Our forward through an mlx-lm model's parts (embedding, decoder layers, final norm), choosing masks and positions.

On a plain layout every layer gets the mask the model would build itself, so the hidden states are
bit-identical to `model.model(tokens)`; a packed layout (prefix sharing) carries per-token positions and what
rejected's tokens may not see (docs/architecture.md).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.base import create_attention_mask

from orpo.engine.attention import (CHOSEN, REJECTED, ExclusionMask, HiddenSpans, SplitRows, exclusion_mask,
                                   kernels_attend, packed_exclusion_mask, row_bounds)
from orpo.engine.forward import FAMILIES, check_mlx_lm, check_parts, family_of, run_layers
from orpo.engine.mlp import mlp_of


def head_dim_of(model: nn.Module) -> int:
    """The attention head dim of an mlx-lm model (its config's, or hidden size / heads)."""
    args = model.args
    return int(getattr(args, "head_dim", None) or args.hidden_size // args.num_attention_heads)


def activation_dtype(model: nn.Module) -> mx.Dtype:
    """The dtype an mlx-lm model's layers compute in: its embedding's (a quantized embedding's scales')."""
    embed = model.model.embed_tokens
    return getattr(embed, "scales", embed.weight).dtype


@dataclass
class Layout:
    """Input rows of one forward and, for packed rows, each token's logical position and what it may see.

    Packed rows: `positions[r, i]` the RoPE position of token i; `hidden_spans[r]` (first, end) the keys row r's
    queries from `end` on may not see (beyond that, causal: rejected blind to chosen); `split`, where the rows are
    laid out for it, lets attention run as SplitRows. Rows of several pairs carry `segments[r, i]`, the place of
    token i's pair in its row (a query sees its own pair's keys only), and `roles[r, i]` (PROMPT, CHOSEN or
    REJECTED: rejected's queries do not see chosen's keys) instead of hidden spans, and the same as each query's
    key bounds [r, i, 3] (`attention.packed_key_bounds`) for our kernels.
    """

    tokens: mx.array
    positions: mx.array | None = None
    hidden_spans: mx.array | None = None
    split: SplitRows | None = None
    segments: mx.array | None = None
    roles: mx.array | None = None
    key_bounds: mx.array | None = None

    @property
    def plain(self) -> bool:
        return self.positions is None

    def fused_mask(self, head_dim: int, dtype: mx.Dtype) -> SplitRows | HiddenSpans | ExclusionMask:
        """How full attention runs fused on these rows: SplitRows where they are laid out for it, else our kernels
        on each query's key bounds (`kernels_attend`), else the exclusion dims."""
        length = self.tokens.shape[1]
        if self.split is not None:
            return self.split
        if kernels_attend(head_dim, dtype):
            return HiddenSpans(self.key_bounds if self.segments is not None else row_bounds(self.hidden_spans, length))
        if self.segments is not None:
            return packed_exclusion_mask(self.segments, self.roles, dtype)
        return exclusion_mask(self.hidden_spans, length, dtype)

    def visible(self) -> mx.array:
        """[B, L, L] booleans: query q may attend to key k (causality included); built on the device."""
        n = self.tokens.shape[1]
        causal = mx.tril(mx.ones((n, n), mx.bool_))[None]
        if self.segments is not None:
            same = self.segments[:, :, None] == self.segments[:, None, :]
            blind = (self.roles[:, :, None] == REJECTED) & (self.roles[:, None, :] == CHOSEN)
            return causal & same & ~blind
        pos = mx.arange(n)[None]
        first, end = self.hidden_spans[:, :1], self.hidden_spans[:, 1:]
        restricted, hidden = pos >= end, (pos >= first) & (pos < end)
        return causal & ~(restricted[:, :, None] & hidden[:, None, :])


class Stack:
    """The parts of one mlx-lm model: embed, run layers a..b with chosen masks and positions, final norm;
    `ordered`: attention differentiated in a fixed order (orpo.engine.attention.ordered_attention); `gated`: gated
    MLPs keep gate and up alone for the backward (orpo.engine.mlp)."""

    def __init__(self, model: nn.Module, ordered: bool = False, gated: bool = False):
        check_mlx_lm()
        self.family = family_of(model)
        check_parts(model, self.family)
        self.layer_family = FAMILIES[self.family]
        self.model = model
        self.ordered = ordered
        self.gated = gated
        self.inner = model.model
        self.layers = list(self.inner.layers)
        self.windows = self._windows()
        # gemma2 does its own attention math: an array mask, [B, kv, repeats, L, L] scores with GQA.
        self.array_masks = self.family == "gemma2"

    def _windows(self) -> list[int | None]:
        n = len(self.layers)
        if self.family == "llama":
            return [self.inner.sliding_window if layer.use_sliding else None for layer in self.layers]
        if self.family == "gemma3_text":
            p = self.inner.sliding_window_pattern
            return [None if i % p == p - 1 else self.inner.window_size for i in range(n)]
        return [None] * n  # mlx-lm's gemma2 applies no sliding window: neither do we

    def embed(self, tokens: mx.array) -> mx.array:
        """Token embeddings as the model's own forward scales them."""
        h = self.inner.embed_tokens(tokens)
        hidden = self.inner.args.hidden_size
        if self.family in ("gemma", "gemma2"):
            return h * (hidden**0.5)
        if self.family == "gemma3_text":  # gemma3 rounds the scale to bfloat16 first
            return h * mx.array(hidden**0.5, mx.bfloat16).astype(h.dtype)
        return h

    def masks(self, layout: Layout, h: mx.array) -> list[Any]:
        """One attention mask per layer: the model's own on plain rows; on packed rows SplitRows (aligned rows),
        exclusion dims or hidden spans (tight rows), or for sliding windows and gemma2's own attention a block mask
        array."""
        built: dict[int | None, Any] = {}
        for w in set(self.windows):
            if layout.plain:
                built[w] = create_attention_mask(h, None, window_size=w, return_array=self.array_masks)
            elif w is None and not self.array_masks:
                built[w] = layout.fused_mask(head_dim_of(self.model), h.dtype)
            else:
                mask = layout.visible()
                if w is not None:
                    pos = layout.positions
                    mask = mask & ((pos[:, :, None] - pos[:, None, :]) < w)
                if self.array_masks:
                    built[w] = mask[:, None]
                else:
                    # Additive, in the activation dtype, one per row: MLX's CUDA attention takes it as cuDNN's
                    # bias broadcast over heads, where a boolean mask is first expanded to [B, H, L, L].
                    built[w] = mx.where(mask, mx.array(0.0, h.dtype), mx.array(-mx.inf, h.dtype))[:, None]
        return [built[w] for w in self.windows]

    def run(self, h: mx.array, masks: Sequence[Any], start: int, stop: int, positions: mx.array | None = None,
            mlps: Sequence[Callable[[mx.array], mx.array]] | None = None) -> mx.array:
        """Layers start..stop-1 on h: masks[i] for layer i, RoPE at `positions`, mlps[i - start] for its MLP."""
        if mlps is None and self.gated:
            mlps = [mlp_of(layer.mlp) for layer in self.layers[start:stop]]
        return run_layers(self.layer_family, self.layers[start:stop], h, masks[start:stop], positions, mlps,
                          self.ordered)

    def norm(self, h: mx.array) -> mx.array:
        return self.inner.norm(h)

    def hidden(self, layout: Layout) -> mx.array:
        """Final (normed) hidden states of the layout's rows: what `model.model(tokens)` returns on plain rows."""
        h = self.embed(layout.tokens)
        return self.norm(self.run(h, self.masks(layout, h), 0, len(self.layers), layout.positions))
