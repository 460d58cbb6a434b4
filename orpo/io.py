"""Atomic writes (a failed one names its file and the cause), line-numbered input reading and hashing shared by
every stage."""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import os
import re
import resource
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


class WriteError(OSError):
    """A failed write, naming the file it was writing and the cause (errno message and name)."""

    detail = ""  # what was measured when the writer reported no errno (free space, ulimit -f)

    def __str__(self) -> str:
        name = errno.errorcode.get(self.errno) if self.errno is not None else None
        return (f"cannot write {self.filename}: {self.strerror}" + (f" ({name})" if name else "")
                + (f"; {self.detail}" if self.detail else ""))


# Writers that lose the errno: MLX's array saves ("[write] Unable to write N bytes to file.") and Rust IO
# (polars: "... underlying IO error: No space left on device (os error 28)").
_MLX_WRITE = re.compile(r"Unable to write (\d+) bytes")
_RUST_OS_ERROR = re.compile(r"\(os error (\d+)\)")
_FULL_ERRNOS = {errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EROFS, errno.EIO}
PROBE_BYTES = 1 << 20


def _diagnose(folder: Path, unwritten: int) -> tuple[int | None, str, str]:
    """(errno, message, detail) of a write that reported no errno: probe the folder, then free space and ulimit -f."""
    try:
        with tempfile.TemporaryFile(dir=folder) as f:
            f.write(b"\0" * min(unwritten, PROBE_BYTES))
            f.flush()
            os.fsync(f.fileno())
    except OSError as probe:
        if probe.errno is not None:
            return probe.errno, probe.strerror or os.strerror(probe.errno), f"{unwritten} bytes left unwritten"
    st = os.statvfs(folder)
    free = st.f_bavail * st.f_frsize
    if free < unwritten:
        return errno.ENOSPC, os.strerror(errno.ENOSPC), f"{free} bytes free, {unwritten} left unwritten"
    limit = resource.getrlimit(resource.RLIMIT_FSIZE)[0]
    if limit != resource.RLIM_INFINITY:
        return errno.EFBIG, os.strerror(errno.EFBIG), f"the file size limit (ulimit -f) is {limit} bytes"
    return None, "the writer reported no cause", f"{unwritten} bytes left unwritten, {free} bytes free"


def _newest_file(root: Path) -> Path | None:
    """The most recently modified file at or under `root`: the one a failed write was writing."""
    if root.is_file():
        return root
    files = [p for p in root.rglob("*") if p.is_file()] if root.is_dir() else []
    return max(files, key=lambda p: p.stat().st_mtime_ns, default=None)


def _write_error(path: Path, tmp: Path | None, e: BaseException) -> WriteError | None:
    """`e` as a WriteError naming the file under `path` and the cause, or None when `e` is no write failure."""
    def absolute(p: str | os.PathLike) -> Path:
        return Path(os.path.abspath(os.fsdecode(p)))

    whole, work = absolute(path), absolute(tmp) if tmp else None

    def error(code: int | None, message: str, filename: str | os.PathLike | None = None,
              detail: str = "") -> WriteError:
        f = absolute(filename) if filename is not None else (_newest_file(work) if work else None)
        inside = f is not None and work is not None and f.is_relative_to(work)
        out = WriteError(code, message, str(path / f.relative_to(work) if inside else path))
        out.detail = detail
        return out

    if isinstance(e, OSError):
        if e.errno is None or isinstance(e, (ConnectionError, TimeoutError)):
            return None
        named = e.filename if isinstance(e.filename, (str, bytes, os.PathLike)) else None
        ancestor = False
        if named is not None:
            f = absolute(named)
            ancestor = f != whole and whole.is_relative_to(f)
            if not (f == whole or ancestor or (work and f.is_relative_to(work.parent))):
                return None  # an input file's error: it names its own file
        detail = f"at {os.fsdecode(named)}" if ancestor else getattr(e, "detail", "")
        return error(e.errno, e.strerror or os.strerror(e.errno), named, detail)
    m = _RUST_OS_ERROR.search(str(e))
    if m and int(m.group(1)) in _FULL_ERRNOS:
        return error(int(m.group(1)), os.strerror(int(m.group(1))))
    m = _MLX_WRITE.search(str(e))
    if m and work is not None and isinstance(e, RuntimeError):
        code, message, detail = _diagnose(work.parent, int(m.group(1)))
        return error(code, message, detail=detail)
    return None


@contextlib.contextmanager
def atomic_path(path: str | os.PathLike) -> Iterator[Path]:
    """Yield a temporary sibling path; rename it onto `path` only if the block succeeds.

    Works for files and folders: whatever the block creates at the temporary path replaces `path`.
    A write that fails (disk full, quota, read-only, file size limit) raises WriteError naming the file
    being written (under `path`) and the cause, whichever library was writing.
    """
    path, tmp = Path(path), None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.", dir=path.parent)) / path.name
        yield tmp
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path)
        os.replace(tmp, path)
    except Exception as e:
        error = _write_error(path, tmp, e)
        if error is None:
            raise
        raise error from e
    finally:
        if tmp is not None:
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
