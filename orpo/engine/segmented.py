"""Segmented backward: the layer stack in segments, only segment boundaries kept, each segment recomputed in reverse.

Forward: embed, then each segment of `segment_layers` layers, keeping only its output (evaluated, so its
activations are freed). The head and loss give the cotangent of the last boundary. Backward: for the last
segment down to the lowest one holding trainable parameters, recompute the segment under `mx.vjp` with
respect to (its input boundary, its trainable parameters) and the incoming cotangent, evaluate, and pass
the input cotangent down. Peak memory: one segment's activations plus the boundaries. The recompute sees
the same LoRA dropout masks because they are keyed by (seed, step, micro-batch, module), not drawn from a
global RNG, and the DropoutKeys pointer does not move inside a micro-batch.
"""

from __future__ import annotations

from collections.abc import Callable
from itertools import pairwise
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten, tree_map_with_path, tree_unflatten

from orpo.engine.stack import Layout, Stack

HeadLoss = Callable[[mx.array], tuple[mx.array, dict[str, mx.array]]]
# h -> ((loss, metrics), d loss / d h): a head that differentiates itself (evaluating as it goes).
HeadValueAndGrad = Callable[[mx.array], tuple[tuple[mx.array, dict[str, mx.array]], mx.array]]


def _layer_params(stack: Stack, model: nn.Module) -> list[tuple[str, list[tuple[str, mx.array]]]]:
    """Per layer: its path in the model and its trainable parameters (layer-relative path, array)."""
    names = {id(m): name for name, m in model.named_modules()}
    per_layer = [(names[id(layer)], tree_flatten(layer.trainable_parameters())) for layer in stack.layers]
    inside = {f"{prefix}.{k}" for prefix, items in per_layer for k, _ in items}
    outside = [k for k, _ in tree_flatten(model.trainable_parameters()) if k not in inside]
    if outside:
        raise ValueError(f"train.engine.segment_layers: trainable parameters outside the decoder layers "
                         f"({outside[:3]}); the segmented backward only differentiates the layers")
    return per_layer


def segmented_value_and_grad(model: nn.Module, stack: Stack, layout: Layout, head_loss: HeadLoss,
                             segment_layers: int, head_value_and_grad: HeadValueAndGrad | None = None
                             ) -> tuple[tuple[mx.array, dict[str, mx.array]], Any]:
    """((loss, metrics), grads) of head_loss(last layer's output) over the layout, grads shaped like trainable_parameters()."""
    if segment_layers < 1:
        raise ValueError(f"train.engine.segment_layers: {segment_layers} must be >= 1 here")
    n = len(stack.layers)
    bounds = list(range(0, n, segment_layers)) + [n]
    segments = list(pairwise(bounds))
    per_layer = _layer_params(stack, model)
    # Layers below the lowest trainable one need no backward: the embedding is frozen.
    lowest = next((i for i, (_, items) in enumerate(per_layer) if items), n)

    h = mx.stop_gradient(stack.embed(layout.tokens))
    masks = stack.masks(layout, h)
    grads: dict[str, mx.array] = {}
    with stack.positions(layout):
        boundary = [h]
        mx.eval(h)
        for a, b in segments:
            h = stack.run(boundary[-1], masks, a, b)
            mx.eval(h)
            boundary.append(h)

        (loss, metrics), cot = (head_value_and_grad or mx.value_and_grad(head_loss))(boundary.pop())
        mx.eval(loss, metrics, cot)

        for a, b in reversed(segments):
            h_in = boundary.pop()
            if b <= lowest:
                break
            layers = per_layer[a:b]
            arrays = [v for _, items in layers for _, v in items]

            def segment(h0: mx.array, *params: mx.array, a: int = a, b: int = b, layers=layers) -> list[mx.array]:
                it = iter(params)
                for layer, (_, items) in zip(stack.layers[a:b], layers):
                    if items:  # run the layer on the traced parameters, so vjp reaches them
                        layer.update(tree_unflatten([(k, next(it)) for k, _ in items]))
                return [stack.run(h0, masks, a, b)]

            try:
                _, vjps = mx.vjp(segment, [h_in, *arrays], [cot])
            finally:  # leave the model holding its own parameter arrays, not the traced copies
                for layer, (_, items) in zip(stack.layers[a:b], layers):
                    if items:
                        layer.update(tree_unflatten(items))
            cot = vjps[0]
            it = iter(vjps[1:])
            for prefix, items in layers:
                for k, _ in items:
                    grads[f"{prefix}.{k}"] = next(it)
            mx.eval(cot, [grads[f"{p}.{k}"] for p, items in layers for k, _ in items])
    return (loss, metrics), tree_map_with_path(lambda path, _: grads[path], model.trainable_parameters())
