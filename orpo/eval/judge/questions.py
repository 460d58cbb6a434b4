"""Questions to judge on (curated validation prompts or MT-Bench's first turns, from a file, folder or hub id)."""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from orpo.eval.sources import load_dataset_rows, parse_source
from orpo.io import InputError, read_jsonl, write_jsonl


@dataclass(frozen=True)
class Question:
    """One single-turn question: a stable id, the user's text and, for MT-Bench, its category."""

    id: str
    text: str
    category: str | None = None


def _mt_bench_row(row: dict[str, Any], at: Callable[[str | None, str], InputError]) -> tuple[dict[str, Any], str]:
    """One MT-Bench question in FastChat's layout (`question_id`, `category`, `turns`), and its id's field name.

    Also accepts the hub layout of HuggingFaceH4/mt_bench_prompts (`prompt_id`, `category`, `prompt` as the
    list of turns); other fields (`reference`) are dropped.
    """
    turns_field = "turns" if "turns" in row or "prompt" not in row else "prompt"
    id_field = "question_id" if "question_id" in row or "prompt_id" not in row else "prompt_id"
    turns = row.get(turns_field)
    if not isinstance(turns, list) or not turns or not all(isinstance(t, str) and t for t in turns):
        raise at(turns_field, "missing, empty or not a list of non-empty strings")
    qid = row.get(id_field)
    if isinstance(qid, bool) or not isinstance(qid, (int, str)) or qid == "":
        raise at(id_field, "missing, or not an integer or non-empty string")
    category = row.get("category")
    if category is not None and not isinstance(category, str):
        raise at("category", f"expected a string, got {type(category).__name__}")
    return {"question_id": qid, "category": category, "turns": list(turns)}, id_field


def mt_bench_rows(spec: str | Path) -> list[dict[str, Any]]:
    """MT-Bench questions in FastChat's layout from a question.jsonl, a dataset folder or a `hub:` id."""
    source = parse_source(spec)
    if source.kind == "jsonl":
        located = ((f"line {n}", functools.partial(InputError, spec, n), row) for n, row in read_jsonl(spec))
    else:
        data = load_dataset_rows(source)
        located = ((f"row {i}", data.at(i), row) for i, row in enumerate(data.rows, start=1))
    out, first = [], {}
    for where, at, row in located:
        q, id_field = _mt_bench_row(row, at)
        if str(q["question_id"]) in first:
            raise at(id_field, f"duplicate id {q['question_id']} (first on {first[str(q['question_id'])]})")
        first[str(q["question_id"])] = where
        out.append(q)
    return out


def write_mt_bench(spec: str | Path, out_path: str | Path) -> dict[str, Any]:
    """Write a source's MT-Bench questions as FastChat's question.jsonl layout (atomically); return count and source."""
    n = write_jsonl(out_path, mt_bench_rows(spec))
    return {"questions": n, **parse_source(spec).describe()}


def mt_bench_questions(spec: str | Path) -> list[Question]:
    """MT-Bench questions from any source; only the first turn of each (the judge is single-turn)."""
    return [Question(str(q["question_id"]), q["turns"][0], q["category"]) for q in mt_bench_rows(spec)]


def validation_questions(path: str | Path) -> tuple[list[Question], dict[str, Any]]:
    """The curate stage's validation.parquet as questions, and what was skipped.

    A prompt is used when it is one user turn (after an optional system turn); the generate stage answers
    a single user turn, so multi-turn prompts are skipped and counted, never judged out of context.
    """
    import polars as pl

    if Path(path).is_dir():  # the curate stage's output folder
        path = Path(path) / "validation.parquet"
    rows = pl.read_parquet(path, columns=["id", "prompt"]).to_dicts()
    out, skipped = [], []
    for row in rows:
        turns = [m for m in row["prompt"] if m.get("role") != "system"]
        if len(turns) == 1 and turns[0].get("role") == "user" and isinstance(turns[0].get("content"), str):
            out.append(Question(str(row["id"]), turns[0]["content"]))
        else:
            skipped.append(str(row["id"]))
    return out, {"multi_turn": {"count": len(skipped), "examples": skipped[:5]}}


def load_questions(prompt_set: str, path: str | Path) -> tuple[list[Question], dict[str, Any]]:
    """Questions of a prompt set (`validation` or `mt_bench`) from its source, and what was skipped."""
    if prompt_set == "mt_bench":
        return mt_bench_questions(path), {}
    if prompt_set == "validation":
        return validation_questions(path)
    raise ValueError(f"unknown prompt set {prompt_set!r} (validation or mt_bench)")


def write_prompts(questions: list[Question], path: str | Path) -> int:
    """The questions as an eval-prompts jsonl (`key`, `prompt`) the generate stage answers."""
    return write_jsonl(path, ({"key": q.id, "prompt": q.text} for q in questions))


def read_answers(path: str | Path) -> dict[str, str]:
    """Prompt text -> response from a generations jsonl (the generate stage's `prompt`, `response`)."""
    answers: dict[str, str] = {}
    for lineno, row in read_jsonl(path):
        prompt, response = row.get("prompt"), row.get("response")
        if not isinstance(prompt, str):
            raise InputError(path, lineno, "prompt", "missing or not a string")
        if not isinstance(response, str):
            raise InputError(path, lineno, "response", "missing or not a string")
        if answers.get(prompt, response) != response:
            raise InputError(path, lineno, "prompt", "the same prompt appears with a different response")
        answers[prompt] = response
    return answers
