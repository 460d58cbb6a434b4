"""Where raw rows come from, for every stage that reads them (base, curate, spin): local .jsonl/.json/.parquet
files, folders of them, or hub ids (the forms `data.raw` takes).

Rows are streamed as Items in input order. A row that cannot be read (bad JSON, not UTF-8, not an
object) is an Item with `error` set when on_error="skip"; with "raise" it raises InputError. Problems
with a whole source (missing file, unreadable parquet or .json, hub dataset unavailable) always raise.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from orpo.hub import DATA_SUFFIXES, hub_failure_reason, is_hub_dataset
from orpo.io import InputError, read_jsonl, sha256_file


@dataclass(frozen=True)
class Item:
    """One input row (or the error reading it) and where it came from."""

    path: str
    line: int | None  # JSONL line (1-based)
    index: int | None  # row number (1-based) in a .json list, parquet file or hub split
    row: dict | None
    error: InputError | None
    input_name: str  # the input as given: the default `source` of binarized rows that lack one

    @property
    def origin(self) -> str:
        """file:line for JSONL, file#row otherwise."""
        return f"{self.path}:{self.line}" if self.line is not None else f"{self.path}#{self.index}"

    def located(self, field: str | None, message: str) -> InputError:
        """An InputError for this row naming file, line (or row) and field."""
        prefix = f"row {self.index}: " if self.index is not None else ""
        return InputError(self.path, self.line, field, prefix + message)


def _jsonl(path: str, name: str, on_error: str) -> Iterator[Item]:
    errors: list[InputError] = []
    flushed = 0
    for lineno, obj in read_jsonl(path, on_error=on_error, errors=errors):  # type: ignore[arg-type]
        # read_jsonl appends a bad line's error before yielding the next good line: keep file order.
        for err in errors[flushed:]:
            yield Item(path, err.line, None, None, err, name)
        flushed = len(errors)
        yield Item(path, lineno, None, obj, None, name)
    for err in errors[flushed:]:
        yield Item(path, err.line, None, None, err, name)


def _json(path: str, name: str, on_error: str) -> Iterator[Item]:
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise InputError(path, getattr(e, "lineno", None), None, f"not a readable JSON file ({e})") from None
    if not isinstance(data, list):
        raise InputError(path, None, None, f"expected a JSON list of row objects, got {type(data).__name__}")
    for i, obj in enumerate(data, start=1):
        if isinstance(obj, dict):
            yield Item(path, None, i, obj, None, name)
            continue
        err = InputError(path, None, None, f"row {i}: expected a JSON object, got {type(obj).__name__}")
        if on_error == "raise":
            raise err
        yield Item(path, None, i, None, err, name)


def _parquet(path: str, name: str) -> Iterator[Item]:
    import polars as pl

    try:
        frame = pl.read_parquet(path)
    except Exception as e:  # polars raises several kinds for a bad file
        raise InputError(path, None, None, f"not a readable parquet file ({e})") from None
    for i, row in enumerate(frame.iter_rows(named=True), start=1):
        yield Item(path, None, i, row, None, name)


def _hub(spec: str) -> Iterator[Item]:
    name, _, split = spec.partition(":")
    split = split or "train"
    try:
        import datasets  # slow to import: only on this path
    except ImportError:
        raise InputError(spec, None, None, "hub datasets need the `datasets` package: pip install datasets") from None
    try:
        ds = datasets.load_dataset(name, split=split)
    except Exception as e:
        why = hub_failure_reason(e)
        raise InputError(
            spec, None, None, f"cannot load hub dataset '{name}' split '{split}': {why} ({type(e).__name__}: {e})"
        ) from None
    for i, row in enumerate(ds, start=1):
        yield Item(spec, None, i, dict(row), None, spec)


def data_files(spec: str) -> list[str]:
    """The data files of a local input (itself, or a folder's, sorted); InputError for none or an unreadable kind."""
    p = Path(spec)
    if p.is_dir():
        found = sorted(
            q.relative_to(p).as_posix()
            for q in p.rglob("*")
            if q.is_file() and q.suffix in DATA_SUFFIXES and not any(part.startswith(".") for part in q.relative_to(p).parts)
        )
        if not found:
            raise InputError(spec, None, None, f"folder holds no {'/'.join(DATA_SUFFIXES)} files")
        return [str(p / rel) for rel in found]
    if p.is_file():
        if p.suffix not in DATA_SUFFIXES:
            raise InputError(spec, None, None, f"unsupported file type '{p.suffix}' (expected {'/'.join(DATA_SUFFIXES)})")
        return [spec]
    raise InputError(spec, None, None, "no such file or folder (nor a hub id of the form owner/name[:split])")


def describe(spec: str) -> dict:
    """The manifest's record of one input: kind and, for local files, each file's sha256."""
    if is_hub_dataset(spec):
        name, _, split = spec.partition(":")
        return {"input": spec, "kind": "hub", "dataset": name, "split": split or "train"}
    files = data_files(spec)
    kind = "folder" if Path(spec).is_dir() else Path(spec).suffix.lstrip(".")
    return {"input": spec, "kind": kind, "files": [{"path": f, "sha256": sha256_file(f)} for f in files]}


def iter_items(inputs: list[str], on_error: str) -> Iterator[Item]:
    """Stream every row of every input, in the order given (folders: files sorted by path)."""
    for spec in inputs:
        if is_hub_dataset(spec):
            yield from _hub(spec)
            continue
        for path in data_files(spec):
            suffix = Path(path).suffix
            if suffix == ".jsonl":
                yield from _jsonl(path, spec, on_error)
            elif suffix == ".json":
                yield from _json(path, spec, on_error)
            else:
                yield from _parquet(path, spec)
