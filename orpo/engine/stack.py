"""Our own forward through an mlx-lm model's parts, so we choose the attention mask and the RoPE positions.

embedding (gemma's sqrt(H) scale included) -> decoder layers, each called with an explicit mask -> final
norm. On a plain layout (ordinary causal rows) every layer gets the very mask object the model would build
itself, so the hidden states are bit-identical to `model.model(tokens)`. A packed layout (prefix sharing)
carries per-token logical positions and a block visibility; sliding windows are applied on the logical
positions, and RoPE sees them through a wrapper around each attention's own rope (below).
With attention="blockwise", the layers call orpo.engine.attention's blockwise attention (analytic backward)
instead of mlx-lm's sdpa while inside `positions`; gemma2 computes its softcapped attention itself and keeps it.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.base import create_attention_mask

from orpo.engine.attention import DEFAULT_BLOCK, SplitMask, causal_blockwise_in, split_masks_in

# mlx-lm module name -> family ("mistral" is served by mlx_lm.models.llama).
SUPPORTED = ("llama", "qwen2", "qwen3", "gemma", "gemma2", "gemma3_text")


class UnsupportedModel(ValueError):
    """The model's family has no stack description here."""


@dataclass
class Layout:
    """Input rows of one forward and, for packed rows, each token's logical position and what it may see.

    `positions`, `visible` and `shifted` are None for plain causal rows. Otherwise `positions[r, i]` is the
    RoPE position of token i, `visible[r, q, k]` says whether query q may attend to key k (causality
    included), and `shifted[r, i]` marks the tokens whose position is `i + shift[r]` (the rest have `i`).
    `split`, if set, says every row's tokens before it see exactly the causal keys before it (the
    prefix-sharing rows: [prompt; chosen; pad] then [rejected; pad]), so attention may run as two parts.
    """

    tokens: mx.array
    positions: mx.array | None = None
    visible: mx.array | None = None
    shifted: mx.array | None = None
    shift: mx.array | None = None
    split: int | None = None

    @property
    def plain(self) -> bool:
        return self.positions is None


class ShiftedRope(nn.Module):
    """A module's own RoPE applied at offset 0 and at a per-row offset, picking per token.

    mx.fast.rope takes one offset per batch row (an array), not one per token; a packed row needs two
    position runs (0.. for prompt+chosen, restarting at the prompt length for rejected), so both are
    computed and the token's run is selected. Each run is exactly the module's own rope, so any rope
    variant (plain, llama3, yarn scaling) keeps its frequencies.
    """

    def __init__(self, rope: nn.Module, shift: mx.array, shifted: mx.array):
        super().__init__()
        self.inner = rope
        self._shift = shift
        self._shifted = shifted[:, None, :, None]  # [B, heads, L, D] inputs

    def __call__(self, x: mx.array, offset: int = 0) -> mx.array:
        if not isinstance(offset, int) or offset != 0:
            raise ValueError("ShiftedRope is for cache-free forwards (offset 0)")
        return mx.where(self._shifted, self.inner(x, offset=self._shift), self.inner(x))


def family_of(model: nn.Module) -> str:
    """The supported family an mlx-lm model belongs to (by the module its class comes from)."""
    family = type(model).__module__.rsplit(".", 1)[-1]
    if family not in SUPPORTED or not hasattr(model, "model"):
        kind = getattr(getattr(model, "args", None), "model_type", type(model).__name__)
        raise UnsupportedModel(f"train.engine: model type {kind!r} has no stack description "
                               f"(supported: {', '.join(SUPPORTED)}, mistral); use the plain engine")
    return family


class Stack:
    """The parts of one mlx-lm model: embed, run layers a..b with chosen masks and positions, final norm."""

    def __init__(self, model: nn.Module, attention: str = "mlx", attention_block: int = DEFAULT_BLOCK):
        self.family = family_of(model)
        self.model = model
        # "blockwise": inside `positions`, attention runs orpo.engine.attention's (gemma2 keeps its own).
        self.attention = attention
        self.attention_block = attention_block
        self.inner = model.model
        self.layers = list(self.inner.layers)
        self.windows = self._windows()
        # gemma2 does its own attention math: an array mask, [B, kv, repeats, L, L] scores with GQA.
        self.array_masks = self.family == "gemma2"
        self.mask_5d = self.family == "gemma2" and self.layers[0].self_attn.repeats > 1

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
        """One attention mask per layer (the model's own on plain rows; block and logical window otherwise)."""
        built: dict[int | None, Any] = {}
        for w in set(self.windows):
            if layout.plain:
                built[w] = create_attention_mask(h, None, window_size=w, return_array=self.array_masks)
                continue
            mask = layout.visible
            if w is not None:
                pos = layout.positions
                mask = mask & ((pos[:, :, None] - pos[:, None, :]) < w)
            if self.attention == "mlx" and not self.array_masks:
                # Additive, in the activation dtype, one per row: MLX's CUDA attention takes it as cuDNN's
                # bias broadcast over heads, where a boolean mask is first expanded to [B, H, L, L].
                mask = mx.where(mask, mx.array(0.0, h.dtype), mx.array(-mx.inf, h.dtype))[:, None]
                built[w] = SplitMask(layout.split, mask[:, :, layout.split:]) if self._splits(layout, w) else mask
                continue
            built[w] = mask[:, None, None] if self.mask_5d else mask[:, None]
        return [built[w] for w in self.windows]

    def _splits(self, layout: Layout, window: int | None) -> bool:
        """Whether a layer with this window runs the layout's attention as two parts (SplitMask)."""
        return (layout.split is not None and window is None and self.attention == "mlx" and not self.array_masks
                and 0 < layout.split < layout.tokens.shape[1])

    @contextmanager
    def positions(self, layout: Layout) -> Iterator[None]:
        """While inside, ropes see the layout's logical positions and attention runs as `self.attention` says."""
        modules = [type(layer.self_attn).__module__ for layer in self.layers]
        if self.attention == "blockwise":
            with causal_blockwise_in(modules, self.attention_block), self._rope_positions(layout):
                yield
        elif any(self._splits(layout, w) for w in self.windows):
            with split_masks_in(modules), self._rope_positions(layout):
                yield
        else:
            with self._rope_positions(layout):
                yield

    @contextmanager
    def _rope_positions(self, layout: Layout) -> Iterator[None]:
        """While inside, every attention's rope sees the layout's logical positions (nothing to do if plain)."""
        if layout.plain:
            yield
            return
        attns = [layer.self_attn for layer in self.layers]
        ropes = [a.rope for a in attns]
        try:
            for a, rope in zip(attns, ropes):
                a.rope = ShiftedRope(rope, layout.shift, layout.shifted)
            yield
        finally:
            for a, rope in zip(attns, ropes):
                a.rope = rope

    def run(self, h: mx.array, masks: list[Any], start: int, stop: int) -> mx.array:
        """Layers start..stop-1 on hidden states h (call inside `positions`)."""
        for i in range(start, stop):
            h = self.layers[i](h, masks[i])
        return h

    def norm(self, h: mx.array) -> mx.array:
        """The final norm."""
        return self.inner.norm(h)

    def hidden(self, layout: Layout) -> mx.array:
        """Final (normed) hidden states of the layout's rows: what `model.model(tokens)` returns on plain rows."""
        h = self.embed(layout.tokens)
        masks = self.masks(layout, h)
        with self.positions(layout):
            h = self.run(h, masks, 0, len(self.layers))
        return self.norm(h)
