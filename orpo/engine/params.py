"""Arrays substituted for modules' trainable parameters while a function of them is traced (mx.vjp)."""

from __future__ import annotations

import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten, tree_unflatten

# Held while arrays are substituted into modules: two threads interleaving on shared modules would restore
# each other's traced arrays as the originals.
_SUBSTITUTING = threading.RLock()


def trainables_of(modules: Sequence[nn.Module]) -> list[mx.array]:
    """The modules' trainable arrays in the order `trainables_replaced` takes them (tree_flatten, module by module)."""
    return [v for m in modules for _, v in tree_flatten(m.trainable_parameters())]


@contextmanager
def trainables_replaced(modules: Sequence[nn.Module], arrays: Sequence[mx.array]) -> Iterator[None]:
    """While inside, the modules' trainable arrays are `arrays` (tree_flatten order, module by module), for tracing a
    function of the parameters (mx.vjp); restored after."""
    with _SUBSTITUTING:
        saved = [tree_flatten(m.trainable_parameters()) for m in modules]
        it = iter(arrays)
        try:
            for m, items in zip(modules, saved):
                if items:
                    m.update(tree_unflatten([(k, next(it)) for k, _ in items]))
            yield
        finally:
            for m, items in zip(modules, saved):
                if items:
                    m.update(tree_unflatten(items))
