"""Where eval prompt sets come from: a local jsonl (read as is), an HF-style dataset folder, or a hub id.

A hub id is written `hub:OWNER/NAME[@REVISION][:SPLIT]` (the prefix keeps a mistyped local path from being
taken for one). A folder is read the way `datasets.load_dataset(folder)` reads it: parquet/jsonl/csv files
and an optional README dataset card. `datasets` is slow to import, so it is imported only on those paths.
"""

from __future__ import annotations

import functools
import os
import re
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from orpo.hub import hub_failure_reason
from orpo.io import InputError

HUB_PREFIX = "hub:"
HUB_FORM = "hub:OWNER/NAME[@REVISION][:SPLIT]"
_HUB = re.compile(r"^hub:(?P<name>[A-Za-z0-9][\w.-]*/[\w.-]+)(?:@(?P<revision>[^:@\s]+))?(?::(?P<split>[\w.-]+))?$")


@dataclass(frozen=True)
class Source:
    """A parsed prompt-set source: `kind` is jsonl, folder or hub; `name` the path or hub dataset id."""

    spec: str
    kind: str
    name: str
    revision: str | None = None
    split: str | None = None

    def describe(self) -> dict[str, Any]:
        """The source as provenance: what was asked for, without the local machine's cache paths."""
        return {"source": self.spec, "kind": self.kind, "name": self.name, "revision": self.revision,
                "split": self.split}


@dataclass(frozen=True)
class DatasetRows:
    """The rows of one split of a folder or hub dataset, with its column names."""

    source: Source
    split: str
    columns: list[str]
    rows: list[dict[str, Any]]

    @property
    def label(self) -> str:
        """How messages name this split: the source as given and the split."""
        return f"{self.source.spec} (split {self.split})"

    def at(self, index: int) -> functools.partial[InputError]:
        """(field, message) -> InputError naming this split and row `index` (1-based)."""
        return functools.partial(InputError, f"{self.label}, row {index}", None)


def is_hub(spec: str | os.PathLike) -> bool:
    """True when `spec` names a hub dataset (starts with `hub:`)."""
    return str(spec).startswith(HUB_PREFIX)


def parse_source(spec: str | os.PathLike) -> Source:
    """Classify a source; a missing path, an unsupported file type or a malformed hub id is an InputError."""
    spec = str(spec)
    if is_hub(spec):
        m = _HUB.match(spec)
        if not m:
            raise InputError(spec, None, None, f"not a hub dataset id: expected {HUB_FORM}, e.g. hub:google/IFEval")
        return Source(spec, "hub", m["name"], m["revision"], m["split"])
    path = Path(spec)
    if path.is_dir():
        return Source(spec, "folder", spec)
    if path.is_file():
        if path.suffix == ".jsonl":
            return Source(spec, "jsonl", spec)
        raise InputError(spec, None, None, f"unsupported file type {path.suffix!r}: give a .jsonl file, an HF-style "
                                           f"dataset folder or {HUB_FORM}")
    raise InputError(spec, None, None, f"no such file or folder (a hub dataset is written {HUB_FORM})")


def _load_failure(source: Source, e: Exception) -> InputError:
    what = f"({type(e).__name__}: {e})"
    if source.kind == "folder":
        return InputError(source.spec, None, None, f"not a dataset folder `datasets.load_dataset` can read {what}")
    why = hub_failure_reason(e)
    hint = "; load it once with a network (it is then cached under HF_HOME), or give a local file or folder"
    return InputError(source.spec, None, None, f"cannot load hub dataset '{source.name}': {why} {what}{hint}")


def _pick_split(source: Source, splits: list[str]) -> str:
    if source.split:
        if source.split not in splits:
            have = ", ".join(sorted(splits))
            raise InputError(source.spec, None, None, f"no split {source.split!r} (splits: {have})")
        return source.split
    if "train" in splits or len(splits) == 1:
        return "train" if "train" in splits else splits[0]
    how = f"name one: {HUB_FORM}" if source.kind == "hub" else "keep only one in the folder"
    have = ", ".join(sorted(splits))
    raise InputError(source.spec, None, None, f"several splits and none is 'train' ({have}): {how}")


def load_dataset_rows(source: Source) -> DatasetRows:
    """One split of a folder or hub dataset (the one named, else `train`, else the only one), rows in order."""
    if source.kind not in ("folder", "hub"):
        raise ValueError(f"{source.spec}: not a dataset source ({source.kind})")
    try:
        import datasets
    except ImportError:
        why = "datasets need the `datasets` package: pip install datasets"
        raise InputError(source.spec, None, None, why) from None
    # datasets keys its cache of a carded local folder by the card, not by the folder or its files: an edited
    # folder, or another one with the same card, would come back stale. A folder goes through a throwaway cache.
    with tempfile.TemporaryDirectory(prefix="orpo-dataset-") as scratch:
        try:
            loaded = datasets.load_dataset(source.name, revision=source.revision,
                                           cache_dir=scratch if source.kind == "folder" else None)
        except Exception as e:  # datasets and huggingface_hub raise many kinds; each becomes one clear message
            raise _load_failure(source, e) from None
        split = _pick_split(source, list(loaded))
        table = loaded[split]
        return DatasetRows(source, split, list(table.column_names), [dict(row) for row in table])


def require_columns(data: DatasetRows, needed: tuple[str, ...], layout: str) -> None:
    """Raise an InputError naming the first missing column and the layout that was expected."""
    for name in needed:
        if name not in data.columns:
            raise InputError(data.label, None, name, f"no such column (have {', '.join(data.columns)}; "
                                                     f"expected {layout})")
