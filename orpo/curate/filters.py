"""Per-pair filters of the curate stage: TruthfulQA matches, empty responses, token lengths."""

from __future__ import annotations

import json
from pathlib import Path

from orpo.curate.schema import Pair
from orpo.io import InputError, read_jsonl

TRUTHFULQA_SOURCE = "truthful_qa"


def load_questions(path: str) -> set[str]:
    """TruthfulQA questions, stripped: .txt (one a line), .jsonl (objects with `question`), .json
    (a list of strings or of such objects) or .parquet (a `question` column)."""
    p = Path(path)
    if not p.is_file():
        raise InputError(path, None, None, "truthfulqa_questions: no such file")
    if p.suffix == ".txt":
        return {q.strip() for q in p.read_text(encoding="utf-8").splitlines() if q.strip()}
    if p.suffix == ".parquet":
        import polars as pl

        frame = pl.read_parquet(path)
        if "question" not in frame.columns:
            raise InputError(path, None, "question", "missing column")
        return {q.strip() for q in frame["question"].drop_nulls().to_list() if isinstance(q, str)}
    if p.suffix == ".json":
        items = [(None, obj) for obj in json.loads(p.read_text(encoding="utf-8"))]
    elif p.suffix == ".jsonl":
        items = list(read_jsonl(path))
    else:
        raise InputError(path, None, None, "truthfulqa_questions: expected .txt, .jsonl, .json or .parquet")
    out = set()
    for line, obj in items:
        q = obj if isinstance(obj, str) else obj.get("question") if isinstance(obj, dict) else None
        if not isinstance(q, str):
            raise InputError(path, line, "question", "expected a string")
        out.add(q.strip())
    return out


def matches_question(pair: Pair, questions: set[str]) -> bool:
    """True when a user turn of the prompt equals a TruthfulQA question (surrounding whitespace aside),
    the exact match H4 and argilla used."""
    return any(role == "user" and content.strip() in questions for role, content in pair.prompt)


def is_blank(text: str) -> bool:
    """Empty or whitespace only."""
    return not text.strip()


def prompt_text(pair: Pair) -> str:
    """Every prompt turn's content, one per line (what decontamination compares)."""
    return "\n".join(content for _, content in pair.prompt)


def prompt_key(pair: Pair) -> str:
    """The exact identity of a prompt (roles and contents) for duplicate detection."""
    return json.dumps(pair.prompt, ensure_ascii=False)
