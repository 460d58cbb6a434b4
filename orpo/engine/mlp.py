"""A decoder layer's MLP as the engine calls it: gated MLPs through an activation with a backward of its own.

Autodiff of mlx-lm's `down_proj(act(gate_proj(x)) * up_proj(x))` keeps, for the backward, act's inner values,
act(gate) and the product the down projection reads: three [tokens, intermediate] arrays a layer beyond gate and
up. Here the activation and the down projection are one custom function whose forward keeps only gate and up and
whose backward recomputes the product (one elementwise kernel) for the down projection's own vjp, then the
activation's gradients (an elementwise kernel each).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models import gemma, gemma2, gemma3_text, llama, qwen2, qwen3

from orpo.engine.params import trainables_of, trainables_replaced


@dataclass(frozen=True)
class Gated:
    """act(gate) * up (`forward`, mlx-lm's ops in its order: the same bits) and its gradients (`backward`)."""

    forward: Callable[[mx.array, mx.array], mx.array]
    backward: Callable[[mx.array, mx.array, mx.array], tuple[mx.array, mx.array]]


def gated(act: Callable[[mx.array], mx.array], act_grad: Callable[[mx.array], mx.array]) -> Gated:
    """The gated activation of `act`; its backward: d gate in float32 from `act_grad` (act's derivative), d up in
    the inputs' dtype as autodiff computes it."""

    @partial(mx.compile, shapeless=True)
    def backward(gate: mx.array, up: mx.array, cotangent: mx.array) -> tuple[mx.array, mx.array]:
        g = gate.astype(mx.float32)
        d_gate = (cotangent.astype(mx.float32) * up.astype(mx.float32) * act_grad(g)).astype(gate.dtype)
        # Two outputs sharing a float32 cast or act(g) are not one fused kernel: the shared values would be written
        # out in float32 (three [tokens, intermediate] arrays at bf16); sharing nothing, each output fuses alone.
        return d_gate, (cotangent * act(gate)).astype(up.dtype)

    return Gated(mx.compile(lambda gate, up: act(gate) * up, shapeless=True), backward)


def _silu_grad(g: mx.array) -> mx.array:
    s = mx.sigmoid(g)
    return s * (1 + g * (1 - s))


def _gelu_grad(g: mx.array) -> mx.array:
    return (1 + mx.erf(g / math.sqrt(2))) / 2 + g * mx.exp(-g * g / 2) / math.sqrt(2 * math.pi)


def _gelu_approx_grad(g: mx.array) -> mx.array:
    k = math.sqrt(2 / math.pi)
    t = mx.tanh(k * (g + 0.044715 * g**3))
    return 0.5 * (1 + t) + 0.5 * g * (1 - t * t) * k * (1 + 3 * 0.044715 * g * g)


SWIGLU = gated(nn.silu, _silu_grad)
GEGLU = gated(nn.gelu, _gelu_grad)
GEGLU_APPROX = gated(nn.gelu_approx, _gelu_approx_grad)
# mlx-lm MLPs computing down_proj(act(gate_proj(x)) * up_proj(x)), and their activation.
GATED_MLPS = {llama.MLP: SWIGLU, qwen2.MLP: SWIGLU, qwen3.MLP: SWIGLU, gemma.MLP: GEGLU, gemma2.MLP: GEGLU_APPROX,
              gemma3_text.MLP: GEGLU_APPROX}


def gated_down(activation: Gated, down: nn.Module) -> Callable[..., mx.array]:
    """(gate, up, *down's trainables) -> down(act(gate) * up), keeping gate and up alone for the backward."""

    def run_down(z: mx.array, params: tuple[mx.array, ...]) -> mx.array:
        with trainables_replaced([down], params):
            return down(z)

    @mx.custom_function
    def down_of_gated(gate: mx.array, up: mx.array, *params: mx.array) -> mx.array:
        return down(activation.forward(gate, up))  # params are down's own arrays: inputs only for the vjp

    @down_of_gated.vjp
    def down_of_gated_vjp(primals: list[mx.array], cotangent: mx.array, output: mx.array) -> tuple[mx.array, ...]:
        gate, up, *params = primals
        # Under mx.compile the recompute would be merged with the forward's identical ops, which then stay alive to
        # here; made to wait for the cotangent, it cannot be. The activation's backward waits for down's gradients,
        # or breadth-first eval leaves every layer's recompute and weight gradients alive to the end.
        g, u = mx.depends([gate, up], [cotangent])
        _, (dz, *dparams) = mx.vjp(lambda z, *ps: [run_down(z, ps)], [activation.forward(g, u), *params], [cotangent])
        g, u = mx.depends([gate, up], dparams or [dz])
        return (*activation.backward(g, u, dz), *dparams)

    return down_of_gated


def mlp_of(mlp: nn.Module) -> Callable[[mx.array], mx.array]:
    """The layer's MLP as the engine calls it: a gated MLP of mlx-lm's through `gated_down`, any other as it is."""
    activation = GATED_MLPS.get(type(mlp))
    if activation is None:
        return mlp
    down = gated_down(activation, mlp.down_proj)
    return lambda x: down(mlp.gate_proj(x), mlp.up_proj(x), *trainables_of([mlp.down_proj]))
