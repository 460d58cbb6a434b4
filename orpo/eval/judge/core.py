"""The `judge` stage core: MT-Bench-style pairwise judging of two models' answers, both orders per question.

Outputs: `verdicts.jsonl` (per question and order: the judgment text, the parsed verdict, attempts) and
`summary.json` (outcome counts and rates with bootstrap intervals), each written atomically. The verdict
cache (default OUT/cache.jsonl) is appended in place as judgments finish; see cache.py for why.
A run that ends with no verdict at all raises NoVerdicts (no outputs); one with some warns on stderr.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from orpo.eval.judge.cache import VerdictCache, cache_key
from orpo.eval.judge.prompts import JudgePrompt, load_judge_prompt, parse_verdict
from orpo.eval.judge.questions import Question, load_questions, read_answers
from orpo.eval.judge.settings import JudgeSettings, resolve_settings
from orpo.eval.judge.summary import outcome, summarize, winner
from orpo.io import write_json, write_jsonl
from orpo.settings import as_dict

ORDERS = ("ab", "ba")  # "ab": model a's answer shown as Assistant A; "ba": swapped


class NoVerdicts(RuntimeError):
    """Not one judgment of the run has a verdict: a summary would measure the judge's failure, not the models."""


class Judge(Protocol):
    """What judge_pairs needs from a judge backend."""

    identity: dict[str, Any]
    chunk_size: int

    def complete(self, chats: list[list[dict[str, str]]], attempt: int = 0) -> list[str]: ...


@dataclass(frozen=True)
class _Item:
    question: Question
    order: str
    messages: list[dict[str, str]]
    key: str


def make_judge(s: JudgeSettings, dtype: str = "auto") -> Judge:
    """The judge backend the settings name (`kind`: mlx, computing in `dtype` (model.dtype), or openai)."""
    if s.kind == "mlx":
        from orpo.eval.judge.mlx_judge import MlxJudge

        return MlxJudge(s, dtype)
    from orpo.eval.judge.http_judge import HttpJudge

    return HttpJudge(s)


def judge_pairs(
    questions: list[Question], answers_a: dict[str, str], answers_b: dict[str, str], out_dir: str | Path,
    settings: JudgeSettings | Mapping[str, Any], labels: tuple[str, str] = ("a", "b"), meta: dict[str, Any] | None = None,
    dtype: str = "auto",
) -> dict[str, Any]:
    """Judge model a against model b on each question in both orders; write verdicts and summary, return the summary.

    Answers are keyed by question text. Returns the summary plus run counts (judged now, from cache). An mlx
    judge computes in `dtype` (model.dtype).
    """
    s = resolve_settings(settings)
    out_dir = Path(out_dir)
    prompt = load_judge_prompt(s.prompts_file, s.template)
    questions = questions[: s.limit] if s.limit else list(questions)
    _check(questions, answers_a, answers_b, labels)
    judge = make_judge(s, dtype)
    items = _items(questions, answers_a, answers_b, prompt, judge.identity)
    cache = VerdictCache(s.cache or out_dir / "cache.jsonl")
    pending = list({it.key: it for it in items if it.key not in cache}.values())
    failed = _judge_all(judge, pending, cache, s.max_parse_retries, len(items))
    records = {it.key: cache[it.key] if it.key in cache else failed[it.key] for it in items}
    _check_verdicts(items, records, judge.identity)

    rows, outcomes = _rows(items, records, labels)
    summary = {
        **summarize(outcomes, s.n_resamples, s.seed),
        "models": {"a": labels[0], "b": labels[1]},
        "judge": {**judge.identity, "template": prompt.name},
        "errors": [r["question_id"] for r in rows[::2] if r["outcome"] == "error"],
        "position": {v: sum(r["verdict"] == v for r in rows) for v in ("A", "B", "tie")}
        | {"error": sum(r["verdict"] is None for r in rows)},
        "settings": as_dict(s),
        **(meta or {}),
    }
    write_jsonl(out_dir / "verdicts.jsonl", rows)
    write_json(out_dir / "summary.json", summary)
    return {**summary, "judged_now": len(pending), "from_cache": len(items) - len(pending),
            "cache_bad_lines": cache.bad_lines}


def judge_files(
    questions_path: str | Path, generations_a: tuple[str, str | Path], generations_b: tuple[str, str | Path],
    out_dir: str | Path, settings: JudgeSettings | Mapping[str, Any], dtype: str = "auto",
) -> dict[str, Any]:
    """judge_pairs on files: the prompt set's question file and two (label, generations.jsonl) pairs."""
    s = resolve_settings(settings)
    questions, skipped = load_questions(s.prompt_set, questions_path)
    (label_a, path_a), (label_b, path_b) = generations_a, generations_b
    meta = {"prompt_set": s.prompt_set, "questions_file": str(questions_path), "skipped": skipped,
            "first_turn_only": s.prompt_set == "mt_bench",
            "generations": {label_a: str(path_a), label_b: str(path_b)}}
    return judge_pairs(questions, read_answers(path_a), read_answers(path_b), out_dir, s, (label_a, label_b), meta,
                       dtype)


def _check(questions: list[Question], answers_a: dict[str, str], answers_b: dict[str, str],
           labels: tuple[str, str]) -> None:
    if not questions:
        raise ValueError("judge: no questions")
    if labels[0] == labels[1]:
        raise ValueError(f"judge: both models are labelled {labels[0]!r}")
    ids = [q.id for q in questions]
    if len(set(ids)) != len(ids):
        raise ValueError("judge: question ids are not unique")
    for label, answers in zip(labels, (answers_a, answers_b), strict=True):
        missing = [q.id for q in questions if q.text not in answers]
        if missing:
            raise ValueError(f"judge: model {label!r} has no answer to {len(missing)} of {len(questions)} questions "
                             f"(e.g. {', '.join(missing[:3])})")


def _items(questions: list[Question], answers_a: dict[str, str], answers_b: dict[str, str], prompt: JudgePrompt,
           identity: dict[str, Any]) -> list[_Item]:
    template = {"name": prompt.name, "system_prompt": prompt.system_prompt, "prompt_template": prompt.prompt_template}
    items = []
    for q in questions:
        a, b = answers_a[q.text], answers_b[q.text]
        for order, (in_a, in_b) in zip(ORDERS, ((a, b), (b, a)), strict=True):
            key = cache_key(identity, template, q.text, in_a, in_b, order)
            items.append(_Item(q, order, prompt.messages(q.text, in_a, in_b), key))
    return items


def _check_verdicts(items: list[_Item], records: dict[str, dict[str, Any]], identity: dict[str, Any]) -> None:
    """Raise NoVerdicts when no judgment has a verdict; warn on stderr, naming how many, when some lack one."""
    missing = [it for it in items if records[it.key]["verdict"] is None]
    if not missing:
        return
    judge = ", ".join(f"{k} {identity[k]}" for k in ("kind", "model", "base_url") if k in identity)
    last = records[missing[-1].key]
    if len(missing) == len(items):
        raise NoVerdicts(f"judge: no verdict in any of the {len(items)} judgments ({judge}), so no summary is "
                         f"written; the last answer, after {last['attempts']} attempt(s), was "
                         f"{last['judgment'][-200:]!r}: check the judge's model, server and template")
    questions = list(dict.fromkeys(it.question.id for it in missing))
    print(f"judge: warning: {len(missing)} of {len(items)} judgments have no verdict ({judge}); "
          f"{len(questions)} question(s) left out of the rates: {', '.join(questions[:5])}"
          f"{', ...' if len(questions) > 5 else ''}", file=sys.stderr, flush=True)


def _judge_all(judge: Judge, items: list[_Item], cache: VerdictCache, max_parse_retries: int,
               total: int) -> dict[str, dict[str, Any]]:
    """Ask the judge for each item, a chunk at a time; re-ask unparseable ones; cache each verdict as it arrives.

    Returns the judgments that still have no verdict: kept for this run's outputs, never cached.
    """
    failed: dict[str, dict[str, Any]] = {}
    done = total - len(items)
    for start in range(0, len(items), judge.chunk_size):
        todo = items[start : start + judge.chunk_size]
        rejected: dict[str, list[str]] = {it.key: [] for it in todo}
        for attempt in range(max_parse_retries + 1):
            texts = judge.complete([it.messages for it in todo], attempt)
            retry = []
            for it, text in zip(todo, texts, strict=True):
                verdict = parse_verdict(text)
                if verdict is None and attempt < max_parse_retries:
                    rejected[it.key].append(text)
                    retry.append(it)
                    continue
                record = {"key": it.key, "verdict": verdict, "judgment": text, "rejected": rejected[it.key],
                          "attempts": attempt + 1}
                if verdict is None:
                    failed[it.key] = record
                else:
                    cache.append(record)
            todo = retry
            if not todo:
                break
        done += min(judge.chunk_size, len(items) - start)
        print(f"judge: {done}/{total} judgments", flush=True)
    return failed


def _rows(items: list[_Item], records: dict[str, dict[str, Any]],
          labels: tuple[str, str]) -> tuple[list[dict[str, Any]], list[str]]:
    """Verdict rows (question order, then ab, ba) and each question's outcome for model a."""
    name = {"a": labels[0], "b": labels[1]}
    rows, outcomes = [], []
    for first, second in zip(items[::2], items[1::2], strict=True):
        recs = [records[first.key], records[second.key]]
        winners = [winner(r["verdict"], it.order) for r, it in zip(recs, (first, second), strict=True)]
        result = outcome(*winners)
        outcomes.append(result)
        for it, rec, w in zip((first, second), recs, winners, strict=True):
            slot_a, slot_b = ("a", "b") if it.order == "ab" else ("b", "a")
            row = {"question_id": it.question.id, "order": it.order, "assistant_a": name[slot_a],
                   "assistant_b": name[slot_b], "verdict": rec["verdict"], "winner": name.get(w, w),
                   "outcome": result, "attempts": rec["attempts"], "judgment": rec["judgment"],
                   "rejected": rec["rejected"], "key": it.key}
            if it.question.category is not None:
                row["category"] = it.question.category
            rows.append(row)
    return rows, outcomes
