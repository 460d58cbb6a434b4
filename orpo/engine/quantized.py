"""Frozen quantized weights in training: dequantized for each use, then one plain matmul.

MLX's quantized matmul is built for decoding (a few rows); over a training step's thousands of rows a layer's
weight dequantized to the activations' dtype and multiplied as usual is many times faster (bench/README.md, "LoRA
on a quantized base"), as bitsandbytes' 4-bit training path does. The backward dequantizes again instead of
keeping the float weight for it, so the graph holds no float copy of the model's weights.
"""

from __future__ import annotations

from functools import cache
from typing import Callable

import mlx.core as mx
import mlx.nn as nn


@cache
def _matmul(group_size: int, bits: int, mode: str) -> Callable:
    """x [.., K] @ dequantize(packed)^T for a packed (weight, scales[, biases]): the vjp w.r.t. x only (frozen)."""

    def weight(packed: tuple[mx.array, ...], dtype: mx.Dtype) -> mx.array:
        return mx.dequantize(*packed, group_size=group_size, bits=bits, mode=mode).astype(dtype)

    @mx.custom_function
    def matmul(x: mx.array, *packed: mx.array) -> mx.array:
        # each dequantize is tied to the value it multiplies: else the scheduler may run every layer's up front (or
        # compile merges the backward's with the forward's) and all float weights are alive at once
        return x @ weight(mx.depends(list(packed), [x]), x.dtype).T

    @matmul.vjp
    def matmul_vjp(primals, cotangent, output):
        x, *packed = primals
        late = mx.depends(list(packed), [cotangent])
        return (cotangent @ weight(late, x.dtype), *(mx.zeros_like(p) for p in packed))

    return matmul


def frozen_linear(layer: nn.Module, x: mx.array) -> mx.array:
    """layer(x) for a frozen nn.Linear or nn.QuantizedLinear, the quantized one through a dequantized matmul."""
    if not isinstance(layer, nn.QuantizedLinear):
        return layer(x)
    packed = (layer.weight, layer.scales) + ((layer.biases,) if layer.get("biases") is not None else ())
    y = _matmul(layer.group_size, layer.bits, layer.mode)(x, *packed)
    return y + layer.bias if "bias" in layer else y
