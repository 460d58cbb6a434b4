"""Questions to judge on (curated validation prompts or MT-Bench's first turns) and the answers to them."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from orpo.io import InputError, read_jsonl, write_jsonl


@dataclass(frozen=True)
class Question:
    """One single-turn question: a stable id, the user's text and, for MT-Bench, its category."""

    id: str
    text: str
    category: str | None = None


def mt_bench_questions(path: str | Path) -> list[Question]:
    """MT-Bench's question.jsonl; only the first turn of each question (the judge is single-turn)."""
    out = []
    for lineno, row in read_jsonl(path):
        turns = row.get("turns")
        if not isinstance(turns, list) or not turns or not isinstance(turns[0], str):
            raise InputError(path, lineno, "turns", "missing, empty or not a list of strings")
        if "question_id" not in row:
            raise InputError(path, lineno, "question_id", "missing")
        out.append(Question(str(row["question_id"]), turns[0], row.get("category")))
    return out


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
    """Questions of a prompt set (`validation` or `mt_bench`) from its file, and what was skipped."""
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
