"""An embedding lookup whose weight gradient sums each token's rows in a fixed order, on every device.

Autodiff of `weight[ids]` is a scatter-add, which MLX's CUDA and Metal backends run with atomic adds: rows of
a repeated token (BOS, the template's tokens, common words) are summed in whatever order the threads land,
so a full-parameter run's embedding, and all that follows from it, differs between two runs of the same
steps. Here the gradient is a one-hot matmul over vocabulary chunks instead (fixed order, float32
accumulation, no host synchronisation, so it traces under mx.compile): 2·V·H·M FLOPs for M looked-up
tokens beside the step's ~6·P·M (P parameters), V·H/(3·P) more: 0.6% at Mistral-7B's shape. The CPU's
scatter-add runs in order at O(M·H), so the swap is needed on GPUs only (orpo.device.on_gpu).
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_unflatten

# Vocabulary rows per one-hot block: a block is [VOCAB_CHUNK, tokens] in the cotangent's dtype.
VOCAB_CHUNK = 8192


def summed_rows(cotangent: mx.array, ids: mx.array, vocab: int) -> mx.array:
    """[vocab, H]: row v is the sum of the cotangent's rows at the positions whose id is v."""
    flat = ids.reshape(-1)
    rows = cotangent.reshape(flat.size, cotangent.shape[-1])
    blocks = []
    for start in range(0, vocab, VOCAB_CHUNK):
        one_hot = mx.arange(start, min(start + VOCAB_CHUNK, vocab))[:, None] == flat[None, :]
        blocks.append(one_hot.astype(rows.dtype) @ rows)
    return mx.concatenate(blocks) if len(blocks) > 1 else blocks[0]


@mx.custom_function
def lookup(weight: mx.array, ids: mx.array) -> mx.array:
    """`weight[ids]`, differentiated by `summed_rows`."""
    return weight[ids]


@lookup.vjp
def _lookup_vjp(primals: list[mx.array], cotangent: mx.array, output: mx.array) -> tuple[mx.array, mx.array]:
    weight, ids = primals
    return summed_rows(cotangent, ids, weight.shape[0]), mx.zeros_like(ids)


class SummedEmbedding(nn.Embedding):
    """nn.Embedding with `lookup`'s gradient; the same weight, the same forward and tied head."""

    def __call__(self, x: mx.array) -> mx.array:
        return lookup(self.weight, x)


def with_summed_embeddings(model: nn.Module) -> list[str]:
    """Replace each trainable nn.Embedding of `model` by a SummedEmbedding holding its weight; returns their paths."""
    swapped = []
    for path, module in model.named_modules():
        if type(module) is nn.Embedding and "weight" in module.trainable_parameters():
            summed = SummedEmbedding(*module.weight.shape)
            summed.weight = module.weight
            swapped.append((path, summed))
    if swapped:
        model.update_modules(tree_unflatten(swapped))
    return [path for path, _ in swapped]
