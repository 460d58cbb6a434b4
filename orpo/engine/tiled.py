"""Token-tiled MLP backward: a layer's MLP differentiated in token chunks, its activations never held whole.

The MLP acts per token, so its vjp is its chunks' vjps, summed (parameters) and concatenated (inputs). A dropout
drawn over the input's shape would differ per chunk: the caller refuses it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import mlx.core as mx
import mlx.nn as nn

from orpo.engine.mlp import mlp_of
from orpo.engine.params import trainables_of, trainables_replaced
from orpo.engine.queue import after


def tiled_mlp(mlp: nn.Module, chunks: int, gated: bool = False) -> Callable[[mx.array], mx.array]:
    """x -> mlp(x), differentiated in `chunks` token chunks, each after the previous: the layer's MLP's stand-in;
    `gated`: through mlp.mlp_of."""

    call = mlp_of(mlp) if gated else mlp

    def run(x: mx.array, params: tuple[mx.array, ...]) -> mx.array:
        with trainables_replaced([mlp], params):
            return call(x)

    @mx.custom_function
    def tiled(x: mx.array, *params: mx.array) -> mx.array:
        return call(x)  # params are the MLP's own arrays: inputs only for the vjp

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

    return lambda x: tiled(x, *trainables_of([mlp]))


def tiled_mlps(layers: Sequence[nn.Module], chunks: int,
               gated: bool = False) -> list[Callable[[mx.array], mx.array]] | None:
    """Each layer's MLP as `tiled_mlp` for the engine's forward to call (chunks <= 1: None, the stack's own)."""
    return None if chunks <= 1 else [tiled_mlp(layer.mlp, chunks, gated) for layer in layers]
