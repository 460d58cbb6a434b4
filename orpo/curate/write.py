"""The curated-pairs artifact: seeded train/validation split and deterministic parquet files."""

from __future__ import annotations

import hashlib
import math
from pathlib import Path

import polars as pl

from orpo.curate.schema import Pair
from orpo.folders import mark_complete
from orpo.io import atomic_path, write_json

SCHEMA = {
    "id": pl.String,
    "prompt": pl.List(pl.Struct({"role": pl.String, "content": pl.String})),
    "chosen": pl.String,
    "rejected": pl.String,
    "source": pl.String,
    "score_chosen": pl.Float64,
    "score_rejected": pl.Float64,
}


def validation_size(n: int, fraction: float) -> int:
    """round(n * fraction), but at least 1 (and at most n - 1) once there are 2 rows; 0 for a fraction of 0 (every
    row trains: no hold-out)."""
    if n < 2 or fraction == 0:
        return 0
    return min(n - 1, max(1, math.floor(n * fraction + 0.5)))


def split(pairs: list[Pair], seed: int, fraction: float) -> tuple[list[Pair], list[Pair]]:
    """Seeded split: the validation rows are those with the smallest sha256(f"{seed}:split:{id}")
    (ties by position); both parts keep input order."""
    keys = pl.DataFrame(
        {
            "key": [hashlib.sha256(f"{seed}:split:{p.id}".encode()).hexdigest() for p in pairs],
            "pos": list(range(len(pairs))),
        },
        schema={"key": pl.String, "pos": pl.Int64},
    )
    chosen = set(keys.sort(["key", "pos"]).head(validation_size(len(pairs), fraction))["pos"].to_list())
    train = [p for i, p in enumerate(pairs) if i not in chosen]
    val = [p for i, p in enumerate(pairs) if i in chosen]
    return train, val


def to_frame(pairs: list[Pair]) -> pl.DataFrame:
    """Pairs as a frame with the contract's column types (also when empty)."""
    return pl.DataFrame(
        {
            "id": [p.id for p in pairs],
            "prompt": [[{"role": r, "content": c} for r, c in p.prompt] for p in pairs],
            "chosen": [p.chosen for p in pairs],
            "rejected": [p.rejected for p in pairs],
            "source": [p.source for p in pairs],
            "score_chosen": [p.score_chosen for p in pairs],
            "score_rejected": [p.score_rejected for p in pairs],
        },
        schema=SCHEMA,
    )


def write_parquet(path: Path, pairs: list[Pair]) -> None:
    """Write pairs with fixed options (no statistics, fixed compression and row groups) so equal
    pairs give equal bytes; polars writes no timestamp."""
    to_frame(pairs).write_parquet(path, compression="zstd", compression_level=3, statistics=False, row_group_size=65536)


def write_pairs(out_dir: str | Path, stage: str, train: list[Pair], validation: list[Pair], manifest: dict,
                input_rows: int, dropped: int) -> None:
    """Check that every input row is accounted for, then replace `out_dir` with the two splits and the manifest.

    The folder is replaced as a whole, so a failed run never leaves a mix of old and new files.
    """
    accounted = len(train) + len(validation) + dropped
    if input_rows != accounted:  # nothing disappears without a count
        raise AssertionError(f"{stage}: {input_rows} input rows but {accounted} outputs + drops")
    with atomic_path(out_dir) as tmp:
        tmp.mkdir()
        write_parquet(tmp / "train.parquet", train)
        write_parquet(tmp / "validation.parquet", validation)
        write_json(tmp / "manifest.json", manifest)
        mark_complete(tmp, stage)
