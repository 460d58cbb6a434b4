"""Atomic writes, line-numbered input reading and hashing shared by every stage."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any, Iterable, Iterator, Literal


class InputError(ValueError):
    """Bad input, located: the message names the file, the line (1-based) and the field."""

    def __init__(self, path: str | os.PathLike, line: int | None, field: str | None, message: str):
        self.path, self.line, self.field, self.reason = str(path), line, field, message
        where = self.path + (f", line {line}" if line is not None else "")
        what = f", field '{field}'" if field else ""
        super().__init__(f"{where}{what}: {message}")


@contextlib.contextmanager
def atomic_path(path: str | os.PathLike) -> Iterator[Path]:
    """Yield a temporary sibling path; rename it onto `path` only if the block succeeds.

    Works for files and folders: whatever the block creates at the temporary path replaces `path`.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.", dir=path.parent)) / path.name
    try:
        yield tmp
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path)
        os.replace(tmp, path)
    finally:
        shutil.rmtree(tmp.parent, ignore_errors=True)


def write_text(path: str | os.PathLike, text: str) -> None:
    """Write a text file atomically (UTF-8)."""
    with atomic_path(path) as tmp:
        tmp.write_text(text, encoding="utf-8")


def write_json(path: str | os.PathLike, obj: Any) -> None:
    """Write JSON atomically, keys sorted and indented, so equal content gives equal bytes."""
    write_text(path, json.dumps(obj, indent=2, sort_keys=True, ensure_ascii=False) + "\n")


def write_jsonl(path: str | os.PathLike, rows: Iterable[dict]) -> int:
    """Write one JSON object per line atomically; returns the number of rows."""
    n = 0
    with atomic_path(path) as tmp, open(tmp, "w", encoding="utf-8") as f:
        for row in rows:
            f.write(json.dumps(row, ensure_ascii=False) + "\n")
            n += 1
    return n


def read_jsonl(
    path: str | os.PathLike,
    on_error: Literal["raise", "skip"] = "raise",
    errors: list[InputError] | None = None,
) -> Iterator[tuple[int, dict]]:
    """Yield (line number, object) for each non-blank line.

    A line that is not UTF-8, not JSON, or not a JSON object raises InputError naming the file and
    line; with on_error="skip" it is appended to `errors` instead (so the caller can count it).
    """
    with open(path, "rb") as f:
        for lineno, raw in enumerate(f, start=1):
            try:
                text = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                err = InputError(path, lineno, None, f"not valid UTF-8 ({e.reason} at byte {e.start})")
            else:
                if not text.strip():
                    continue
                try:
                    obj = json.loads(text)
                except json.JSONDecodeError as e:
                    err = InputError(path, lineno, None, f"not valid JSON ({e.msg} at column {e.colno})")
                else:
                    if isinstance(obj, dict):
                        yield lineno, obj
                        continue
                    err = InputError(path, lineno, None, f"expected a JSON object, got {type(obj).__name__}")
            if on_error == "raise":
                raise err
            if errors is not None:
                errors.append(err)


def sha256_file(path: str | os.PathLike) -> str:
    """Hex sha256 of a file's bytes."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()
