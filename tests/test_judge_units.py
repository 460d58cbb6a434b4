"""The judge's parts without a judge: verdict parsing, templates, outcomes and rates, inputs, the cache."""

from __future__ import annotations

import json
from pathlib import Path

import polars as pl
import pytest

from orpo.eval.judge.cache import VerdictCache
from orpo.eval.judge.prompts import load_judge_prompt, parse_verdict
from orpo.eval.judge.questions import load_questions, read_answers, write_prompts
from orpo.eval.judge.settings import resolve_settings
from orpo.eval.judge.summary import outcome, summarize, winner
from orpo.io import InputError

MT_BENCH = Path(__file__).resolve().parents[1].parent / "shared" / "data" / "mt_bench"


def test_verdicts_parse_by_fastchats_precedence():
    assert parse_verdict("B is clearer. [[B]]") == "B"
    assert parse_verdict("[[C]]") == "tie"
    assert parse_verdict("Output [[A]] if A is better. My verdict: [[B]]") == "A"  # FastChat checks [[A]] first
    assert parse_verdict("Verdict: [A]") is None and parse_verdict("") is None


def test_only_single_turn_pairwise_templates_load():
    p = load_judge_prompt(MT_BENCH / "judge_prompts.jsonl", "pair-v2")
    msgs = p.messages("Q?", "one", "two")
    assert msgs[0]["role"] == "system" and "[[C]]" in msgs[0]["content"]
    assert msgs[1]["content"].startswith("[User Question]\nQ?\n\n[The Start of Assistant A's Answer]\none\n")
    for name, why in (("pair-math-v1", "reference"), ("single-v1", "pairwise"), ("pair-v2-multi-turn", "single-turn"),
                      ("nope", "no template")):
        with pytest.raises(InputError, match=why):
            load_judge_prompt(MT_BENCH / "judge_prompts.jsonl", name)


def test_outcomes_combine_both_orders():
    assert winner("A", "ab") == "a" and winner("A", "ba") == "b" and winner("B", "ba") == "a"
    assert outcome(winner("A", "ab"), winner("B", "ba")) == "win"
    assert outcome(winner("B", "ab"), winner("A", "ba")) == "loss"
    assert outcome(winner("A", "ab"), winner("A", "ba")) == "inconsistent"
    assert outcome(winner("tie", "ab"), winner("A", "ba")) == "inconsistent"
    assert outcome(winner("tie", "ab"), winner("tie", "ba")) == "tie"
    assert outcome(winner(None, "ab"), winner("A", "ba")) == "error"


def test_rates_and_seeded_bootstrap():
    outcomes = ["win"] * 6 + ["loss"] * 2 + ["tie"] + ["inconsistent"] + ["error"] * 3
    s = summarize(outcomes, n_resamples=500, seed=1)
    assert s["questions"] == 13 and s["judged"] == 10 and s["counts"]["error"] == 3
    assert s["win_rate"]["estimate"] == 0.6 and s["tie_rate"]["estimate"] == 0.2
    assert s["loss_rate"]["estimate"] == 0.2 and s["adjusted_win_rate"]["estimate"] == 0.7
    assert s["win_rate"]["lo"] < 0.6 < s["win_rate"]["hi"]
    assert summarize(outcomes, 500, 1) == s and summarize(outcomes, 500, 2) != s
    assert summarize(["error"], 10, 0)["win_rate"]["estimate"] is None


def test_mt_bench_questions_are_first_turns():
    qs, skipped = load_questions("mt_bench", MT_BENCH / "question.jsonl")
    first = json.loads((MT_BENCH / "question.jsonl").read_text().splitlines()[0])
    assert len(qs) == 80 and skipped == {}
    assert (qs[0].id, qs[0].text, qs[0].category) == (str(first["question_id"]), first["turns"][0], first["category"])


def test_validation_prompts_and_answers(tmp_path):
    pl.DataFrame({"id": ["x1", "x2", "x3"], "prompt": [
        [{"role": "user", "content": "Say hi."}],
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Say bye."}],
        [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"},
         {"role": "user", "content": "And?"}],
    ]}).write_parquet(tmp_path / "validation.parquet")
    qs, skipped = load_questions("validation", tmp_path / "validation.parquet")
    assert [(q.id, q.text) for q in qs] == [("x1", "Say hi."), ("x2", "Say bye.")]
    assert skipped == {"multi_turn": {"count": 1, "examples": ["x3"]}}
    write_prompts(qs, tmp_path / "prompts.jsonl")
    assert json.loads((tmp_path / "prompts.jsonl").read_text().splitlines()[1]) == {"key": "x2", "prompt": "Say bye."}

    gen = tmp_path / "gen.jsonl"
    gen.write_text(json.dumps({"prompt": "Say hi.", "response": "hi"}) + "\n")
    assert read_answers(gen) == {"Say hi.": "hi"}
    gen.write_text(gen.read_text() + json.dumps({"prompt": "Say hi.", "response": "hello"}) + "\n")
    with pytest.raises(InputError, match="line 2"):
        read_answers(gen)


def test_cache_survives_a_torn_last_line(tmp_path):
    path = tmp_path / "cache.jsonl"
    rec = {"key": "k1", "verdict": "A", "judgment": "[[A]]", "rejected": [], "attempts": 1}
    VerdictCache(path).append(rec)
    with open(path, "ab") as f:
        f.write(b'{"key": "k2", "verd')  # killed mid-write
    cache = VerdictCache(path)
    assert "k1" in cache and "k2" not in cache and cache.bad_lines == 1
    cache.append({**rec, "key": "k2"})
    again = VerdictCache(path)
    assert "k2" in again and again.bad_lines == 1


def test_cache_holds_verdicts_only(tmp_path):
    path = tmp_path / "cache.jsonl"
    rec = {"key": "k1", "verdict": None, "judgment": "I cannot say.", "rejected": [], "attempts": 1}
    path.write_text(json.dumps(rec) + "\n")  # a failure cached by an older version
    cache = VerdictCache(path)
    assert "k1" not in cache and cache.bad_lines == 0
    with pytest.raises(ValueError, match="only judgments with a verdict"):
        cache.append(rec)
    assert path.read_text().count("\n") == 1
    cache.append({**rec, "verdict": "tie", "judgment": "[[C]]"})
    assert VerdictCache(path)["k1"]["verdict"] == "tie"


def test_settings_name_the_bad_key():
    base = {"model": "m", "prompts_file": "p.jsonl"}
    assert resolve_settings(base).template == "orpo-pairwise"
    for bad, key in (({"kind": "vllm"}, "kind"), ({"max_retries": -1}, "max_retries"), ({"timeout_s": 0}, "timeout_s"),
                     ({"model": None}, "model"), ({"colour": 1}, "colour")):
        with pytest.raises(ValueError, match=key):
            resolve_settings({**base, **bad})


def test_the_projects_own_judge_prompt_is_the_default_and_loads():
    from orpo.eval.judge.prompts import load_judge_prompt
    from orpo.eval.judge.settings import resolve_settings

    s = resolve_settings({"model": "m"})
    prompt = load_judge_prompt(s.prompts_file, s.template)
    system, user = prompt.messages("Q?", "first answer", "second answer")
    assert system["role"] == "system" and "[[A]]" in system["content"] and "[[C]]" in system["content"]
    assert user["content"].index("first answer") < user["content"].index("second answer")
