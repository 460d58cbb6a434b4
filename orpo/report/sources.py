"""Read the artifacts the report draws from: a run's metrics and validations, manifests, benchmark files."""

from __future__ import annotations

import csv
import json
import math
import os
from pathlib import Path
from typing import Any

from orpo.io import read_jsonl

IFEVAL_METRICS = ("prompt_level_strict_acc", "prompt_level_loose_acc", "inst_level_strict_acc", "inst_level_loose_acc")


def read_json(path: str | os.PathLike) -> Any:
    """A JSON file, with an error that names it."""
    try:
        return json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"{path}: cannot read JSON ({e})") from None


def train_metrics(run: str | os.PathLike) -> list[dict[str, Any]]:
    """The run's per-step training records (split == "train"), in step order."""
    rows = [row for _, row in read_jsonl(Path(run) / "metrics.jsonl")]
    return sorted((r for r in rows if r.get("split", "train") == "train"), key=lambda r: r["step"])


def validation_points(run: str | os.PathLike) -> list[dict[str, Any]]:
    """Validation metrics per checkpoint step from index.json, step 0 (the untrained adapter) first."""
    index = read_json(Path(run) / "index.json")
    points = [{"step": 0, **index["baseline"]}] if index.get("baseline") else []
    for step, entry in index.get("checkpoints", {}).items():
        if entry.get("validation"):
            points.append({"step": int(step), **entry["validation"]})
    return sorted(points, key=lambda p: p["step"])


def _number(text: str) -> float | None:
    try:
        value = float(text)
    except (TypeError, ValueError):
        return None  # "NA": Snakemake could not sample a very short job
    return value if math.isfinite(value) else None


def benchmark(path: str | os.PathLike) -> dict[str, float | None]:
    """The last record of a Snakemake benchmark file: s, max_rss (MB), cpu_time (s), mean_load, ..."""
    with open(path, newline="") as f:
        rows = list(csv.DictReader(f, delimiter="\t"))
    if not rows:
        raise ValueError(f"{path}: benchmark file has no record")
    return {k: _number(v) for k, v in rows[-1].items() if k != "h:m:s"}


def benchmarks(files: dict[str, str]) -> dict[str, dict[str, float | None]]:
    """Rule -> its benchmark record, for the files that exist (a rule skipped in this config has none)."""
    return {rule: benchmark(path) for rule, path in files.items() if Path(path).is_file()}


def manifest(folder: str | os.PathLike) -> dict[str, Any]:
    """A stage's manifest.json."""
    return read_json(Path(folder) / "manifest.json")
