"""Evaluation with a bounded number of evaluations in flight, for the engine's eager loops.

`mx.eval` after each segment (or head chunk) bounds memory to one segment's working set but leaves the
GPU idle while the next segment's kernels are encoded; `mx.async_eval` lets the encoding overlap the
running segment, at the cost of the next segment's buffers being allocated while it runs. Measured on an
H200 (segments of one layer, compiled, Llama-1B shape): depth 1 gave 1.26x tokens/s for +2.4 GB peak.
"""

from __future__ import annotations

from collections import deque

import mlx.core as mx


class EvalQueue:
    """Evaluates what is pushed, in order, leaving at most `depth` evaluations unfinished (0: each waited for)."""

    def __init__(self, depth: int = 0):
        if depth < 0:
            raise ValueError(f"train.engine.overlap: must be >= 0 (got {depth})")
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
