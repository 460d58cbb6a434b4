"""MLX's buffer cache, bounded by the run: freed buffers are kept for reuse only up to what fits beside the peak.

MLX reuses a cached buffer only for a request of about its size and on a GPU caches up to its memory limit, so
variable-length batches fill the cache until CUDA's allocator fails (bench/README.md). `auto` caches nothing in
the first step (a 7B full-parameter step failed with a cache beside its predicted peak), then caps the cache at
two steps' working sets and at what is left under HEADROOM of the device beside the larger of the peak so far
and the run's predicted peak (a later, wider micro-batch needs its room: bench/README.md), moved as the peak
grows; MLX's memory limit stands at that ceiling throughout.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx

from orpo.device import device_memory

GB = 1e9
# The share of the device's memory that active plus cached buffers may take: CUDA's stream-ordered pool
# keeps freed memory reserved, so a cache allowed up to MLX's own limit (95%) leaves allocations failing.
HEADROOM = 0.85


@dataclass
class CachePolicy:
    """The cache limit a run sets: `setting` "auto" (derived, see the module) or a number of GB (0 = no cache)."""

    setting: str | float
    resident: int = 0  # active bytes before the first step: weights, adapters, optimizer state
    planned: int = 0  # the run's predicted peak (orpo.train.footprint), held free of cache
    peak_seen: int = 0
    limit: int | None = None
    changes: list[dict[str, float]] = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.setting != "auto":
            self._set(int(self.setting * GB), 0)

    def start(self, planned: int = 0) -> None:
        """Note what is resident before the first step (the run's peak counts from here) and the run's predicted
        peak in bytes; auto caches nothing yet."""
        self.planned = planned
        mx.clear_cache()  # what loading and attaching freed: the step's own buffers are another size
        self.resident = mx.get_active_memory()
        mx.reset_peak_memory()
        if self.setting == "auto":
            self._set(0, 0)

    def update(self, step: int) -> None:
        """After a step: with auto, a new peak raises (or, near the ceiling, lowers) the cache limit."""
        if self.setting != "auto":
            return
        peak = mx.get_peak_memory()
        if peak <= self.peak_seen:
            return
        self.peak_seen = peak
        ceiling = min(HEADROOM * device_memory(), mx.get_memory_limit())
        self._set(int(max(0, min(ceiling - max(peak, self.planned), 2 * (peak - self.resident)))), step)

    def _set(self, limit: int, step: int) -> None:
        if limit != self.limit:
            mx.set_cache_limit(limit)
            self.limit = limit
            self.changes.append({"step": step, "cache_limit_gb": round(limit / GB, 6)})

    def record(self) -> dict[str, Any]:
        """What the run's index.json keeps: the setting, the limit it ended at and when it changed."""
        return {"cache_limit": self.setting, "cache_limit_gb": round((self.limit or 0) / GB, 6),
                "memory_limit_gb": round(mx.get_memory_limit() / GB, 3), "device_gb": round(device_memory() / GB, 3),
                "peak_gb": round(mx.get_peak_memory() / GB, 6),
                "resident_gb": round(self.resident / GB, 6), "cache_limit_changes": self.changes[-20:]}


@contextmanager
def cache_policy(setting: str | float) -> Iterator[CachePolicy]:
    """While inside, the run's CachePolicy holds MLX's cache limit and MLX's memory limit stands at HEADROOM of
    the device (or lower where it was set lower); both previous limits come back after."""
    previous = mx.set_cache_limit(mx.get_memory_limit())  # read it (MLX has no getter) and restore it below
    mx.set_cache_limit(previous)
    memory = mx.set_memory_limit(int(min(HEADROOM * device_memory(), mx.get_memory_limit())))
    try:
        yield CachePolicy(setting)
    finally:
        mx.set_cache_limit(previous)
        mx.set_memory_limit(memory)
