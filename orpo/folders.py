"""Folder outputs: complete or absent, with a marker file that is the workflow's declared output.

Why: Snakemake treats a `directory()` output that exists as done, and deletes it before rerunning its job.
A job that dies after the folder was emptied (or half rewritten) would leave it looking finished, and a failed
rebuild would already have deleted the previous, finished folder. So each stage writes its folder whole at a
temporary sibling, puts MARKER in it last, and renames it into place; the rules declare MARKER as the
output (Snakemake then deletes only the marker before a rerun, and the stage replaces the folder only
when its new version is complete), and stages that read a folder check its marker.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from orpo.io import InputError

MARKER = "complete.json"


def mark_complete(folder: str | os.PathLike, stage: str) -> None:
    """Write the marker into a folder whose every other file is written (the last write of a stage)."""
    (Path(folder) / MARKER).write_text(json.dumps({"stage": stage}) + "\n", encoding="utf-8")


def marker(folder: str | os.PathLike) -> str:
    """The marker's path in `folder` (what a rule declares)."""
    return os.path.join(str(folder), MARKER)


def require_complete(folder: str | os.PathLike, what: str) -> Path:
    """`folder`, or a clear error when a stage did not finish writing it (no marker in it)."""
    path = Path(folder)
    if not path.is_dir():
        raise InputError(path, None, None, f"no such folder ({what})")
    if not (path / MARKER).is_file():
        raise InputError(path, None, None, f"incomplete {what}: no {MARKER}, so the stage that writes it did not "
                                           "finish; run that stage again (Snakemake reruns it by itself)")
    return path
