"""Token-tiled MLP backward: a layer's MLP differentiated in token chunks, its activations never held whole.

The MLP acts on each token alone, so its vjp over T tokens is the sum (parameters) and the concatenation
(inputs) of its vjps over token chunks. Inside the segmented backward's recompute, each layer's `mlp` is
swapped for `TiledMLP`: a custom function of (x, the MLP's trainable arrays) whose forward keeps nothing
and whose vjp recomputes one chunk at a time, each chunk made to wait for the previous one's results.
The MLP's [tokens, intermediate] activations, most of a layer's working set, then exist for one chunk at
a time (as far as MLX's run-ahead allows; `train.engine.memory_limit_gb` bounds that too). The MLP must
compute the same per token whatever the chunk: a dropout drawn over the input's shape would not (the
caller refuses it).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

from orpo.engine.queue import after
from orpo.engine.stack import trainables_replaced


def tiled_vjp(mlp: nn.Module, chunks: int) -> Callable[..., mx.array]:
    """The custom function (x [..., T, H], *trainable arrays of mlp) -> mlp(x), with its token-chunked vjp."""

    def run(x: mx.array, params: tuple[mx.array, ...]) -> mx.array:
        with trainables_replaced([mlp], params):
            return mlp(x)

    @mx.custom_function
    def tiled(x: mx.array, *params: mx.array) -> mx.array:
        return mlp(x)  # params are the MLP's own arrays (TiledMLP passes them): inputs only for the vjp

    @tiled.vjp
    def tiled_backward(primals, cotangent, output):
        x, *params = primals
        shape = x.shape
        flat_x, flat_c = x.reshape(-1, shape[-1]), cotangent.reshape(-1, cotangent.shape[-1])
        rows = flat_x.shape[0]
        step = -(-rows // chunks)
        dx, dparams = [], [mx.zeros_like(p) for p in params]
        for s in range(0, rows, step):
            xc = after(flat_x[s : s + step], dx[-1:])
            _, grads = mx.vjp(lambda xc, *ps: [run(xc, ps)], [xc, *params], [flat_c[s : s + step]])
            dx.append(grads[0])
            dparams = [a + g for a, g in zip(dparams, grads[1:])]
        return (mx.concatenate(dx).reshape(shape), *dparams)

    return tiled


class TiledMLP(nn.Module):
    """An MLP that runs as itself forward and differentiates in `chunks` token chunks (see the module doc)."""

    def __init__(self, mlp: nn.Module, chunks: int):
        super().__init__()
        self.inner = mlp
        self._fn = tiled_vjp(mlp, chunks)

    def __call__(self, x: mx.array) -> mx.array:
        return self._fn(x, *(v for _, v in tree_flatten(self.inner.trainable_parameters())))


@contextmanager
def tiled_mlps(layers: list[nn.Module], chunks: int) -> Iterator[None]:
    """While inside, each layer's `mlp` is a TiledMLP of itself (chunks <= 1: nothing changes); always restored."""
    if chunks <= 1:
        yield
        return
    originals = [layer.mlp for layer in layers]
    try:
        for layer, mlp in zip(layers, originals):
            layer.mlp = TiledMLP(mlp, chunks)
        yield
    finally:
        for layer, mlp in zip(layers, originals):
            layer.mlp = mlp
