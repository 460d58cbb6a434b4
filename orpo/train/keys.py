"""PRNG keys derived from integers (seed, step, micro-batch, module index), never from the global RNG.

A recompute of the forward (mx.checkpoint, a segmented backward, a replay) rebuilds the same key from
the same integers, so it draws the same LoRA init and the same dropout mask.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx
import numpy as np

# Domains keep the init keys and the dropout keys of one seed apart.
INIT, DROPOUT = 1, 2


def derive_key(*parts: int) -> mx.array:
    """An mlx PRNG key (uint32[2]) that depends only on the integers `parts`."""
    state = np.random.SeedSequence([int(p) % 2**64 for p in parts]).generate_state(2, np.uint32)
    return mx.array(state, dtype=mx.uint32)


@dataclass
class DropoutKeys:
    """Where training is (step, piece of the global step): what every LoRA layer's dropout key is derived from.

    Each layer holds its key in the model's tree (`_dropout_key`), so a compiled step reads it as an input. Rank
    `rank` of `size` keys its micro-batch j as piece j * size + rank: with dropout > 0, N ranks draw other masks
    than one process with the N-times batch (equal in distribution, not in value).
    """

    seed: int
    step: int = 0
    micro: int = 0
    layers: list[Any] = field(default_factory=list, repr=False, compare=False)
    rank: int = 0
    size: int = 1

    def at(self, step: int, micro: int = 0) -> None:
        """Point the keys at optimizer step `step`, this rank's micro-batch `micro`."""
        self.step, self.micro = step, micro * self.size + self.rank
        for layer in self.layers:
            layer._dropout_key = self.key(layer.index)

    def register(self, layer: Any) -> None:
        """Keep `layer._dropout_key` at the key of `layer.index` for wherever the pointer is."""
        self.layers.append(layer)
        layer._dropout_key = self.key(layer.index)

    def key(self, index: int) -> mx.array:
        """The dropout key of LoRA module `index` at the current step and micro-batch."""
        return derive_key(DROPOUT, self.seed, self.step, self.micro, index)


def keyed_dropout(x: mx.array, p: float, key: mx.array) -> mx.array:
    """Inverted dropout of `x` with drop probability `p`, its mask drawn from `key`."""
    keep = mx.random.bernoulli(1.0 - p, x.shape, key=key)
    return mx.where(keep, x * (1.0 / (1.0 - p)), 0.0)
