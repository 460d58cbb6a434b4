"""Data-parallel ranks: which rows of each global batch a rank takes, and the all_sum that joins their gradients.

Each step's rows (one seeded schedule on every rank) are cut into pieces of batch_size; rank r takes pieces
r, r + N, ..., so micro-batch j is spread over the ranks as one process with batch_size * N would hold it.
Gradients and metrics are averaged (the global batch's mean), token counts summed; every rank then updates
identically.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Sequence

import mlx.core as mx
import mlx.nn as nn

from orpo.train.keys import DropoutKeys
from orpo.train.settings import DistributedSettings

# Set by the launchers (ours and mlx.launch for ring/nccl/jaccl; mpirun for MPI): this process is a rank.
RANK_ENV = ("MLX_RANK", "OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_RANK")
# The backend our launcher started the ranks for ("any" would also probe backends it did not set up).
BACKEND_ENV = "ORPO_DIST_BACKEND"


def is_launched_rank() -> bool:
    """True when a distributed launcher started this process as one of several ranks."""
    return any(k in os.environ for k in RANK_ENV)


def shard_micro_batches(rows: Sequence[int], batch_size: int, rank: int, size: int) -> list[list[int]]:
    """Rank `rank`'s micro-batches of one global step: pieces rank, rank + size, ... of `rows` cut by batch_size."""
    if len(rows) % (batch_size * size):
        raise ValueError(f"a step of {len(rows)} rows does not split into {size} ranks x pieces of {batch_size}")
    pieces = [list(rows[i : i + batch_size]) for i in range(0, len(rows), batch_size)]
    return pieces[rank::size]


@dataclass(frozen=True)
class Shard:
    """This process's place among the data-parallel ranks (rank 0 of 1 when not distributed)."""

    rank: int = 0
    size: int = 1
    group: Any = None

    @property
    def is_main(self) -> bool:
        """Rank 0: the one that evaluates, logs and writes."""
        return self.rank == 0

    def dropout_keys(self, seed: int) -> DropoutKeys:
        """Dropout keys for this rank's pieces of each global step."""
        return DropoutKeys(seed, rank=self.rank, size=self.size)

    def reduce(self, grads: Any, metrics: dict[str, mx.array],
               counts: dict[str, int]) -> tuple[Any, dict[str, mx.array], dict[str, int]]:
        """The global batch's mean gradients and metrics and its summed token counts (identity when alone)."""
        if self.size == 1:
            return grads, metrics, counts
        # average_gradients packs the arrays into few large all_sums (then divides by size).
        grads = nn.average_gradients(grads, self.group)
        metrics = nn.average_gradients(metrics, self.group)
        keys = sorted(counts)
        total = mx.distributed.all_sum(mx.array([counts[k] for k in keys], dtype=mx.int32), group=self.group)
        mx.eval(grads, metrics, total)
        return grads, metrics, dict(zip(keys, total.tolist()))

    def broadcast_int(self, value: int) -> int:
        """Rank 0's `value` on every rank; also a barrier (every rank waits for rank 0 to get here)."""
        if self.size == 1:
            return value
        mine = mx.array([value if self.is_main else 0], dtype=mx.int32)
        return int(mx.distributed.all_sum(mine, group=self.group).item())

    def barrier(self) -> None:
        """Wait until every rank gets here."""
        self.broadcast_int(0)


def join(dist: DistributedSettings) -> Shard:
    """This process's Shard for the `train.distributed` settings: joins the group when processes > 1."""
    n = dist.processes
    if n == 1:
        return Shard()
    if not is_launched_rank():
        raise ValueError(f"train.distributed.processes is {n}, but this process is not one of {n} launched ranks: "
                         "`orpo train` and `orpo replay` launch them (a distributed run also replays on "
                         f"{n} processes), or start it with mlx.launch")
    backend = os.environ.get(BACKEND_ENV) or dist.backend
    group = mx.distributed.init(strict=True, backend=backend)
    if group.size() != n:
        raise ValueError(f"train.distributed.processes is {n}, but {group.size()} ranks joined (backend {backend})")
    return Shard(group.rank(), n, group)
