"""The local MLX judge on the tiny base model: it cannot follow the judge prompt, and that must be counted."""

from __future__ import annotations

import json
from pathlib import Path

from orpo.eval.judge import Question, judge_pairs

JUDGE_PROMPTS = Path(__file__).resolve().parents[1].parent / "shared" / "data" / "mt_bench" / "judge_prompts.jsonl"


def test_tiny_mlx_judge_counts_unparseable_judgments_as_errors(tiny_base, tmp_path):
    qs = [Question("q0", "Tell me about the river."), Question("q1", "Write a short note about the apple.")]
    a = {q.text: "The river is long and calm." for q in qs}
    b = {q.text: "Apples are red." for q in qs}
    settings = {"kind": "mlx", "model": str(tiny_base), "max_tokens": 12,
                "batch_size": 4, "max_parse_retries": 1, "n_resamples": 50}
    summary = judge_pairs(qs, a, b, tmp_path / "out", settings)
    rows = [json.loads(x) for x in (tmp_path / "out" / "verdicts.jsonl").read_text().splitlines()]

    assert len(rows) == 4 and all(r["judgment"] for r in rows)  # the model did generate text
    unparsed = [r for r in rows if r["verdict"] is None]
    assert unparsed, "a 1M-parameter model trained on synthetic chat should not produce [[A]]/[[B]]/[[C]]"
    assert all(r["attempts"] == 2 and len(r["rejected"]) == 1 for r in unparsed)
    assert summary["counts"]["error"] == len({r["question_id"] for r in unparsed})
    assert summary["position"]["error"] == len(unparsed)
    assert summary["judge"]["kind"] == "mlx" and summary["judge"]["weights"]

    again = judge_pairs(qs, a, b, tmp_path / "out", settings)  # all cached: nothing is generated again
    assert again["from_cache"] == 4 and again["counts"] == summary["counts"]
