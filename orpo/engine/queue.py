"""Evaluation order for the engine's chunked loops: chunks chained in one graph, or evaluations in flight.

`mx.eval` after each segment (or head chunk) bounds memory but leaves the GPU idle while the next one is
encoded; `mx.async_eval` overlaps the encoding, for buffers allocated earlier (bench/README.md).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator
from contextlib import contextmanager

import mlx.core as mx


def after(x: mx.array, previous: list[mx.array]) -> mx.array:
    """x, made to wait for `previous` (the previous chunk's results) within one lazy graph.

    Left independent, MLX's breadth-first eval holds many chunks' buffers together (on CPU up to ~20 head blocks);
    chained, only the backend's run-ahead window (~8 on CPU), whatever the chunk count.
    """
    return mx.depends(x, previous) if previous else x


class EvalQueue:
    """Evaluates what is pushed, in order, leaving at most `depth` evaluations unfinished (0: each waited for)."""

    def __init__(self, depth: int = 0):
        self.depth = depth
        self._pending: deque[tuple] = deque()

    def push(self, *arrays: object) -> None:
        """Start evaluating `arrays`; wait for the oldest evaluations beyond `depth`."""
        if self.depth == 0:
            mx.eval(*arrays)
            return
        mx.async_eval(*arrays)
        self._pending.append(arrays)
        while len(self._pending) > self.depth:
            mx.eval(*self._pending.popleft())

    def drain(self) -> None:
        """Wait for everything pushed."""
        while self._pending:
            mx.eval(*self._pending.popleft())


@contextmanager
def memory_limit(gb: float) -> Iterator[None]:
    """While inside, MLX's memory limit is `gb` (0: left as it is): past it, evaluation waits for queued work
    before encoding more, so an `EvalQueue` runs ahead only while memory allows."""
    if gb <= 0:
        yield
        return
    previous = mx.set_memory_limit(int(gb * 1e9))
    try:
        yield
    finally:
        mx.set_memory_limit(previous)
