"""The resumable verdict cache: an append-only jsonl of finished judgments, keyed by what decided them.

Appended in place by design (not written atomically like the stage's outputs): each finished judgment
is one line, flushed and fsynced at once, so a killed run loses at most the judgment in flight and a
rerun asks the judge only for what is missing. A torn last line (killed mid-write) is skipped on reading.

Only judgments with a verdict are kept: one the judge could not be made to give a verdict for is asked
again on the next run (the server or model may have been fixed), so it is never written, and a null
verdict found in an older file is not a hit.
"""

from __future__ import annotations

import hashlib
import json
import os
import threading
from pathlib import Path
from typing import Any

from orpo.io import InputError, read_jsonl

VERDICTS = ("A", "B", "tie")


def cache_key(judge: dict[str, Any], prompt: dict[str, str], question: str, answer_in_a: str, answer_in_b: str,
              order: str) -> str:
    """sha256 of the judge identity, the template, the question, both answers as placed, and the order.

    The identity is the backend's (kind, where it runs, model, sampling settings): see each judge's `identity`.
    """
    blob = json.dumps({"judge": judge, "prompt": prompt, "question": question, "answer_in_a": answer_in_a,
                       "answer_in_b": answer_in_b, "order": order}, sort_keys=True, ensure_ascii=False)
    return hashlib.sha256(blob.encode("utf-8")).hexdigest()


class VerdictCache:
    """Judgments with a verdict by key, read from and appended to one jsonl file."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.records: dict[str, dict[str, Any]] = {}
        self.bad_lines = 0
        self._lock = threading.Lock()
        if self.path.exists():
            errors: list[InputError] = []
            for _, row in read_jsonl(self.path, on_error="skip", errors=errors):
                if not _valid(row):
                    self.bad_lines += 1
                elif row["verdict"] is not None:  # older versions cached failures: those are asked again
                    self.records[row["key"]] = row
            self.bad_lines += len(errors)

    def __contains__(self, key: str) -> bool:
        return key in self.records

    def __getitem__(self, key: str) -> dict[str, Any]:
        return self.records[key]

    def append(self, record: dict[str, Any]) -> None:
        """Add one judgment with a verdict, durably, before anything else happens; refuses one without."""
        if record.get("verdict") not in VERDICTS:
            raise ValueError(f"verdict cache: only judgments with a verdict are cached, got {record.get('verdict')!r}")
        line = json.dumps(record, ensure_ascii=False) + "\n"
        with self._lock:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            with open(self.path, "a+b") as f:
                # After a torn last line, start on a fresh one so the new record parses.
                if f.tell() > 0:
                    f.seek(-1, os.SEEK_END)
                    if f.read(1) != b"\n":
                        f.write(b"\n")
                f.write(line.encode("utf-8"))
                f.flush()
                os.fsync(f.fileno())
            self.records[record["key"]] = record


def _valid(row: dict[str, Any]) -> bool:
    return (isinstance(row.get("key"), str) and row.get("verdict") in (*VERDICTS, None)
            and isinstance(row.get("attempts"), int) and isinstance(row.get("judgment"), str)
            and isinstance(row.get("rejected"), list))
