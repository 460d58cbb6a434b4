"""What the verdict cache may answer for, and how a run without verdicts ends, against real HTTP servers.

The servers are test_judge's scripted ones on 127.0.0.1; a mute one answers every request with null content.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from test_judge import JUDGE_PROMPTS, ROOT, SHARED, ScriptedJudgeServer, _qa, _settings

from orpo.eval.judge import judge_pairs, load_questions


@pytest.fixture
def servers():
    """Start scripted judge servers on demand (each on its own port); all are closed afterwards."""
    started: list[ScriptedJudgeServer] = []

    def start(**kw) -> ScriptedJudgeServer:
        started.append(ScriptedJudgeServer(**kw))
        return started[-1]

    yield start
    for s in started:
        s.close()


def _cached(path: Path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []


def test_a_judgment_without_a_verdict_is_not_cached_and_is_asked_again(servers, tmp_path):
    server = servers()
    qs, a, b = _qa(["win", "flaky"])  # flaky: no verdict on the first ask, one on the next
    settings = _settings(server.url, max_parse_retries=0)
    first = judge_pairs(qs, a, b, tmp_path / "out", settings)
    assert first["counts"]["error"] == 1 and len(server.requests) == 4
    assert [r["verdict"] for r in _cached(tmp_path / "out" / "cache.jsonl")] == ["A", "B"]

    again = judge_pairs(qs, a, b, tmp_path / "out", settings)
    # Only the two judgments that had no verdict are asked again; now they have one.
    assert len(server.requests) == 6 and all(qs[1].text in u for u in server.users(4))
    assert again["judged_now"] == 2 and again["from_cache"] == 2
    assert again["counts"] == {"win": 2, "loss": 0, "tie": 0, "inconsistent": 0, "error": 0}


def test_the_cache_never_answers_for_another_server_model_or_sampling(servers, tmp_path):
    one, two = servers(), servers()
    qs, a, b = _qa(["win", "loss"])
    cache = str(tmp_path / "cache.jsonl")
    judge_pairs(qs, a, b, tmp_path / "one", _settings(one.url, cache=cache))
    assert len(one.requests) == 4

    on_two = judge_pairs(qs, a, b, tmp_path / "two", _settings(two.url, cache=cache))
    assert len(two.requests) == 4 and on_two["judged_now"] == 4 and on_two["from_cache"] == 0
    # The same server again (a trailing slash is the same address): every judgment comes from the cache.
    again = judge_pairs(qs, a, b, tmp_path / "one", _settings(one.url + "/", cache=cache))
    assert len(one.requests) == 4 and again["from_cache"] == 4

    for change in ({"model": "another-judge"}, {"temperature": 0.7}, {"max_tokens": 64}):
        before = len(one.requests)
        r = judge_pairs(qs, a, b, tmp_path / "one", _settings(one.url, cache=cache, **change))
        assert len(one.requests) - before == 4 and r["from_cache"] == 0, change


def test_a_mute_server_fails_the_run_and_a_working_one_is_then_asked(servers, tmp_path):
    mute, working = servers(mute=True), servers()
    qs, a, b = _qa(["win", "loss", "tie"])
    cache = tmp_path / "out" / "cache.jsonl"
    with pytest.raises(RuntimeError, match=r"no verdict in any of the 6 judgments \(kind openai, model "
                                           r"scripted-judge, base_url http://127\.0\.0\.1:\d+/v1\)"):
        judge_pairs(qs, a, b, tmp_path / "out", _settings(mute.url))
    assert len(mute.requests) == 6 * 3 and _cached(cache) == []  # each asked 1 + max_parse_retries times
    assert not (tmp_path / "out" / "summary.json").exists()

    summary = judge_pairs(qs, a, b, tmp_path / "out", _settings(working.url))
    assert len(working.requests) == 6 and summary["judged_now"] == 6
    assert summary["counts"] == {"win": 1, "loss": 1, "tie": 1, "inconsistent": 0, "error": 0}


def test_some_judgments_without_a_verdict_give_a_summary_and_a_warning(servers, tmp_path, capsys):
    server = servers()
    qs, a, b = _qa(["win", "garbage", "tie", "garbage"])
    summary = judge_pairs(qs, a, b, tmp_path / "out", _settings(server.url, max_parse_retries=0))
    assert summary["counts"]["error"] == 2 and summary["errors"] == ["q1", "q3"]
    assert (tmp_path / "out" / "summary.json").exists()
    warning = [x for x in capsys.readouterr().err.splitlines() if "warning" in x]
    assert warning == [f"judge: warning: 4 of 8 judgments have no verdict (kind openai, model scripted-judge, "
                       f"base_url {server.url}); 2 question(s) left out of the rates: q1, q3"]


def test_the_cli_exits_1_when_nothing_is_judged_and_judges_on_a_working_server(servers, tmp_path):
    mute, working = servers(mute=True), servers()
    questions = SHARED / "data" / "mt_bench" / "question.jsonl"
    qs, _ = load_questions("mt_bench", questions)
    for label, prefix in (("orpo", "ALPHA"), ("base", "BETA")):
        rows = [{"key": q.id, "prompt": q.text, "response": f"{prefix} says: {q.id}", "label": label} for q in qs]
        (tmp_path / f"{label}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))

    def orpo_judge(url: str) -> subprocess.CompletedProcess:
        settings = {**_settings(url), "prompt_set": "mt_bench", "limit": 2, "prompts_file": str(JUDGE_PROMPTS)}
        return subprocess.run(
            [sys.executable, "-m", "orpo.cli", "judge", "run", "--questions", str(questions),
             "--a", f"orpo={tmp_path / 'orpo.jsonl'}", "--b", f"base={tmp_path / 'base.jsonl'}",
             "--out", str(tmp_path / "out"), "--settings", json.dumps(settings)],
            cwd=ROOT, capture_output=True, text=True, env={**os.environ, "ORPO_DEBUG": ""}, timeout=120)

    failed = orpo_judge(mute.url)
    assert failed.returncode == 1, failed.stderr
    assert "orpo judge: error: judge: no verdict in any of the 4 judgments" in failed.stderr
    assert len(mute.requests) == 4 * 3 and not (tmp_path / "out" / "summary.json").exists()

    judged = orpo_judge(working.url)
    assert judged.returncode == 0, judged.stderr
    result = json.loads(judged.stdout[judged.stdout.index("{"):])
    assert len(working.requests) == 4 and result["judged_now"] == 4 and result["judged"] == 2
