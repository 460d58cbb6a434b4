"""Segmented backward: the layer stack in segments, only the boundaries kept, each segment recomputed in reverse
(docs/architecture.md). Given running sums (`into`), each segment's gradients are added in as evaluated: one
copy of the gradients.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from itertools import pairwise
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten, tree_map_with_path, tree_unflatten

from orpo.engine.compiled import kept, layout_arrays, mask_arrays, masks_from
from orpo.engine.queue import EvalQueue
from orpo.engine.params import trainables_of, trainables_replaced
from orpo.engine.stack import Layout, Stack
from orpo.engine.tiled import tiled_mlps

HeadLoss = Callable[[mx.array], tuple[mx.array, dict[str, mx.array]]]


@dataclass
class Params:
    """Named trainable arrays of a model (paths as in tree_flatten), and the model computing with others in their place."""

    model: nn.Module
    names: list[str]
    arrays: list[mx.array]

    @contextmanager
    def replaced(self, arrays: Sequence[mx.array]) -> Iterator[None]:
        """While inside, the model's arrays at `names` are `arrays` (for tracing a function of them); restored after."""
        if not self.names:
            yield
            return
        self.model.update(tree_unflatten(list(zip(self.names, arrays))))
        try:
            yield
        finally:
            self.model.update(tree_unflatten(list(zip(self.names, self.arrays))))


# (h, the trainable parameters outside the layers) -> ((loss, metrics), d loss / d h, d loss / d each of them):
# a head that differentiates itself (evaluating as it goes), computing with `Params.replaced` under its vjp.
HeadValueAndGrad = Callable[[mx.array, Params],
                            tuple[tuple[mx.array, dict[str, mx.array]], mx.array, list[mx.array]]]


def add_into(into: dict[str, mx.array], grads: Any) -> Any:
    """Add a gradient tree into running sums keyed by path (taking it where a path is new); returns the sums' tree.
    The sums are replaced, not kept beside: an old sum referenced only by its addition lends it its buffer."""
    for path, g in tree_flatten(grads):
        _add(into, path, g)
    return tree_map_with_path(lambda path, _: into[path], grads)


def _add(sums: dict[str, mx.array], path: str, g: mx.array) -> mx.array:
    """sums[path] += g (taking g where the path is new); returns the new sum."""
    sums[path] = sums[path] + g if path in sums else g
    return sums[path]


def _layer_params(stack: Stack, model: nn.Module) -> tuple[list[tuple[str, list[tuple[str, mx.array]]]], Params, Params]:
    """Per layer: its path in the model and its trainable parameters (layer-relative path, array); and the
    trainable parameters outside the layers: all of them (the head's end) and the embedding's (the bottom end)."""
    names = {id(m): name for name, m in model.named_modules()}
    per_layer = [(names[id(layer)], tree_flatten(layer.trainable_parameters())) for layer in stack.layers]
    inside = {f"{prefix}.{k}" for prefix, items in per_layer for k, _ in items}
    outside = [(k, v) for k, v in tree_flatten(model.trainable_parameters()) if k not in inside]
    embed = names[id(stack.inner.embed_tokens)] + "."
    bottom = [(k, v) for k, v in outside if k.startswith(embed)]
    return (per_layer, Params(model, [k for k, _ in outside], [v for _, v in outside]),
            Params(model, [k for k, _ in bottom], [v for _, v in bottom]))


def _head_value_and_grad(head_loss: HeadLoss) -> HeadValueAndGrad:
    """The head by autodiff: value and gradients with respect to h and the parameters outside the layers."""

    def value_and_grad(h: mx.array, top: Params) -> tuple[tuple[mx.array, dict[str, mx.array]], mx.array, list[mx.array]]:
        if not top.names:  # a single argnum's gradient comes back bare, not in a tuple
            out, cot = mx.value_and_grad(head_loss)(h)
            return out, cot, []

        def loss(h: mx.array, *arrays: mx.array) -> tuple[mx.array, dict[str, mx.array]]:
            with top.replaced(arrays):
                return head_loss(h)

        out, (cot, *grads) = mx.value_and_grad(loss, argnums=list(range(1 + len(top.arrays))))(h, *top.arrays)
        return out, cot, grads

    return value_and_grad


def _segment(stack: Stack, a: int, b: int, what: str, mlp_chunks: int = 1) -> Callable:
    """Layers a..b-1: "forward" (h, masks, positions) -> their output; "vjp" (h_in, cotangent of the output, masks,
    positions) -> [cotangent of h_in, grads of each trainable array, layer by layer in tree_flatten order], each
    MLP in `mlp_chunks` token chunks (orpo.engine.tiled)."""
    if what == "forward":
        return lambda h, masks, positions: stack.run(h, masks, a, b, positions)
    layers = stack.layers[a:b]

    def vjp(h_in: mx.array, cot: mx.array, masks: list[Any], positions: mx.array | None) -> list[mx.array]:
        arrays = trainables_of(layers)

        def segment(h0: mx.array, *params: mx.array) -> list[mx.array]:
            with trainables_replaced(layers, params):
                return [stack.run(h0, masks, a, b, positions, tiled_mlps(layers, mlp_chunks, stack.gated))]

        _, vjps = mx.vjp(segment, [h_in, *arrays], [cot])
        return vjps

    return vjp


def _compiled_segment(stack: Stack, layout: Layout, a: int, b: int, what: str, mlp_chunks: int = 1) -> Callable:
    """`_segment` under mx.compile, kept per model and program (orpo.engine.compiled)."""
    states = [layer.state for layer in stack.layers[a:b]]

    def call(*args: Any) -> Any:
        *lead, masks, positions = args
        spec, arrays = mask_arrays(masks[a:b])
        key = ("segment", what, a, b, spec, layout_arrays(layout)[0], mlp_chunks, stack.gated)

        def build() -> Callable:
            inner = _segment(stack, a, b, what, mlp_chunks)

            def traced(*xs: Any) -> Any:
                *lead_t, mask_t, positions_t = xs
                return inner(*lead_t, [None] * a + masks_from(spec, mask_t), positions_t[0] if positions_t else None)

            return mx.compile(traced, inputs=states, outputs=None if what == "forward" else states)

        return kept(stack.model, key, build)(*lead, arrays, [] if positions is None else [positions])

    return call


def segmented_value_and_grad(model: nn.Module, stack: Stack, layout: Layout, head_loss: HeadLoss,
                             segment_layers: int, head_value_and_grad: HeadValueAndGrad | None = None,
                             compiled: bool = False, overlap: int = 0, mlp_chunks: int = 1,
                             into: dict[str, mx.array] | None = None
                             ) -> tuple[tuple[mx.array, dict[str, mx.array]], Any]:
    """((loss, metrics), grads) of head_loss(last layer's output), grads shaped like trainable_parameters().

    `into`: running sums the gradients are added into as evaluated (the grads returned are the sums). `compiled`:
    segments under mx.compile. `overlap`: evaluations left in flight (orpo.engine.queue). `mlp_chunks`: token
    chunks of each layer's MLP backward (orpo.engine.tiled).
    """
    n = len(stack.layers)
    segments = list(pairwise([*range(0, n, segment_layers), n]))
    per_layer, top, bottom = _layer_params(stack, model)
    # Layers below the lowest trainable one need no backward, unless the embedding trains.
    lowest = 0 if bottom.names else next((i for i, (_, items) in enumerate(per_layer) if items), n)

    def segment(a: int, b: int, what: str) -> Callable:
        return (_compiled_segment(stack, layout, a, b, what, mlp_chunks) if compiled
                else _segment(stack, a, b, what, mlp_chunks))

    h = mx.stop_gradient(stack.embed(layout.tokens))
    masks = stack.masks(layout, h)
    positions = layout.positions
    grads: dict[str, mx.array] = {}

    def put(names: Sequence[str], arrays: Sequence[mx.array]) -> list[mx.array]:
        """Add gradients to this call's (a tied embedding's to its head's) or the running sums; returns them."""
        for k, g in zip(names, arrays):
            grads[k] = _add(grads, k, g) if into is None else _add(into, k, g)
        return [grads[k] for k in names]

    queue = EvalQueue(overlap)
    boundary = [h]
    queue.push(h)
    for a, b in segments:
        h = segment(a, b, "forward")(boundary[-1], masks, positions)
        queue.push(h)
        boundary.append(h)
    queue.drain()

    (loss, metrics), cot, top_grads = (head_value_and_grad or _head_value_and_grad(head_loss))(boundary.pop(), top)
    mx.eval(loss, metrics, cot, put(top.names, top_grads))

    for a, b in reversed(segments):
        h_in = boundary.pop()
        if b <= lowest:
            break
        cot, *param_grads = segment(a, b, "vjp")(h_in, cot, masks, positions)
        names = [f"{prefix}.{k}" for prefix, items in per_layer[a:b] for k, _ in items]
        queue.push(cot, put(names, param_grads))
    queue.drain()
    if bottom.names:  # the embedding's gradients from the lowest boundary's cotangent, added to a tied head's

        def embed(*arrays: mx.array) -> list[mx.array]:
            with bottom.replaced(arrays):
                return [stack.embed(layout.tokens)]

        mx.eval(put(bottom.names, mx.vjp(embed, bottom.arrays, [cot])[1]))
    return (loss, metrics), tree_map_with_path(lambda path, _: grads[path], model.trainable_parameters())
