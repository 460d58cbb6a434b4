"""The local MLX judge on the tiny base model: it cannot follow the judge prompt, and that must fail the run."""

from __future__ import annotations

from pathlib import Path

import pytest

from orpo.eval.judge import NoVerdicts, Question, judge_pairs

JUDGE_PROMPTS = Path(__file__).resolve().parents[1].parent / "shared" / "data" / "mt_bench" / "judge_prompts.jsonl"


def test_tiny_mlx_judge_without_a_single_verdict_fails_the_run(tiny_base, tmp_path):
    qs = [Question("q0", "Tell me about the river."), Question("q1", "Write a short note about the apple.")]
    a = {q.text: "The river is long and calm." for q in qs}
    b = {q.text: "Apples are red." for q in qs}
    settings = {"kind": "mlx", "model": str(tiny_base), "max_tokens": 12,
                "batch_size": 4, "max_parse_retries": 1, "n_resamples": 50}
    # A 1M-parameter model trained on synthetic chat does not produce [[A]]/[[B]]/[[C]].
    with pytest.raises(NoVerdicts, match=r"no verdict in any of the 4 judgments \(kind mlx, model .*after 2 attempt"):
        judge_pairs(qs, a, b, tmp_path / "out", settings)
    assert not (tmp_path / "out" / "summary.json").exists()
    assert not (tmp_path / "out" / "cache.jsonl").exists()  # nothing cached: a rerun asks again
