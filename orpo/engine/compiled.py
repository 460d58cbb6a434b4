"""The engine's step under `mx.compile`: compiled functions kept per model and program, traced per shape.

Every array a trace reads is an input (a reused trace would replay stale values); the Python-side structure
is the key a compiled function is kept by (docs/architecture.md, `compile`).
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from dataclasses import fields
from types import SimpleNamespace
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from orpo.engine.attention import ExclusionMask, HiddenSpans
from orpo.engine.stack import Layout


def _kept(owner: nn.Module) -> dict[Hashable, Callable]:
    """The compiled functions of `owner` by key, in an attribute of the model (so they go when it goes) holding a
    plain object (a dict would become a child module)."""
    if getattr(owner, "_compiled_functions", None) is None:
        owner._compiled_functions = SimpleNamespace(functions={})
    return owner._compiled_functions.functions


def kept(owner: nn.Module, key: Hashable, build: Callable[[], Callable]) -> Callable:
    """The compiled function kept on `owner` under `key` (built on first use)."""
    functions = _kept(owner)
    if key not in functions:
        functions[key] = build()
    return functions[key]


def kept_count(owner: nn.Module) -> int:
    """How many compiled functions `owner` holds (each traced anew per input shape by MLX)."""
    return len(_kept(owner))


def layout_arrays(layout: Layout) -> tuple[tuple[Hashable, ...], dict[str, mx.array]]:
    """(structure key, arrays) of a layout: which fields are set and its SplitRows (the key), and the arrays."""
    arrays = {k: v for k, v in vars(layout).items() if k != "split" and v is not None}
    return (*arrays, layout.split), arrays


def layout_from(structure: tuple[Hashable, ...], arrays: dict[str, mx.array]) -> Layout:
    """The Layout `layout_arrays` took apart (with traced arrays when called inside a trace)."""
    return Layout(**arrays, split=structure[-1])


def mask_arrays(masks: list[Any]) -> tuple[tuple[Hashable, ...], list[mx.array]]:
    """(kind key, arrays) of layer masks: "causal", None and SplitRows are keys; arrays, ExclusionMasks and
    HiddenSpans arrays (each mask's kind, first array and count in the key)."""
    spec: list[Hashable] = []
    arrays: list[mx.array] = []
    for m in masks:
        if isinstance(m, (mx.array, ExclusionMask, HiddenSpans)):
            parts = [m] if isinstance(m, mx.array) else [getattr(m, f.name) for f in fields(m)]
            spec.append((type(m), len(arrays), len(parts)))
            arrays.extend(parts)
        else:
            spec.append(m)
    return tuple(spec), arrays


def masks_from(spec: tuple[Hashable, ...], arrays: list[mx.array]) -> list[Any]:
    """The masks `mask_arrays` took apart."""
    out: list[Any] = []
    for s in spec:
        if isinstance(s, tuple):
            kind, first, n = s
            s = arrays[first] if kind is mx.array else kind(*arrays[first:first + n])
        out.append(s)
    return out
