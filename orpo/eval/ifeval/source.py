"""IFEval prompts from any source (local jsonl, dataset folder, hub id), normalised to IFEval's input format."""

from __future__ import annotations

import os
from typing import Any

from orpo.eval.sources import load_dataset_rows, parse_source, require_columns
from orpo.io import write_jsonl

from .score import check_inputs, read_inputs

INPUT_COLUMNS = ("key", "prompt", "instruction_id_list", "kwargs")


def load_inputs(spec: str | os.PathLike) -> list[dict]:
    """Validated IFEval inputs (`key`, `prompt`, `instruction_id_list`, `kwargs`, null kwargs dropped) from a source.

    A local .jsonl is read as IFEval's input file; a dataset folder or `hub:` id must have google/IFEval's
    columns. A bad row is an InputError naming the file or split, the line or row, and the field.
    """
    source = parse_source(spec)
    if source.kind == "jsonl":
        return read_inputs(source.name)
    data = load_dataset_rows(source)
    require_columns(data, INPUT_COLUMNS, "google/IFEval's " + ", ".join(INPUT_COLUMNS))
    return check_inputs((f"row {i}", data.at(i), row) for i, row in enumerate(data.rows, start=1))


def write_inputs(spec: str | os.PathLike, out_path: str | os.PathLike) -> dict[str, Any]:
    """Write a source's IFEval inputs as an input-format jsonl (atomically); return the count and the source."""
    n = write_jsonl(out_path, load_inputs(spec))
    return {"prompts": n, **parse_source(spec).describe()}
