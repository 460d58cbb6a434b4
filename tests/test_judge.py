"""The pairwise judge against a real OpenAI-compatible HTTP server of ours with scripted verdicts.

Each question's first word scripts the judge: win/loss (the ALPHA answer, model a's, is better/worse
wherever it is shown), tie, first (always [[A]]: position bias), garbage (never a verdict), flaky (no
verdict on the first ask), http500/http429/slow (fails, or outlasts the timeout, on the first ask).
A server made with mute=True answers every request with null content, as a misconfigured one can.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from orpo.eval.judge import JudgeRequestError, JudgeUnavailable, Question, judge_files, judge_pairs, load_questions

ROOT = Path(__file__).resolve().parents[1]
SHARED = Path(__file__).resolve().parents[1].parent / "shared"
JUDGE_PROMPTS = SHARED / "data" / "mt_bench" / "judge_prompts.jsonl"
SLOW_S = 1.0
_SLOT_A = re.compile(r"\[User Question\]\n(.*?)\n\n"
                     r"\[The Start of Assistant A's Answer\]\n(.*?)\n\[The End of Assistant A's Answer\]", re.S)


class ScriptedJudgeServer:
    """/v1/chat/completions on 127.0.0.1, answering from the script; logs every request it receives."""

    def __init__(self, delay_s: float = 0.0, mute: bool = False):
        self.delay_s, self.mute = delay_s, mute
        self.requests: list[dict] = []
        self.seen: Counter[str] = Counter()
        self.lock = threading.Lock()
        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self.httpd.daemon_threads = True
        self.httpd.handle_error = lambda request, client_address: None  # a client that timed out hung up
        threading.Thread(target=self.httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}/v1"

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()

    def users(self, since: int = 0) -> list[str]:
        """The user prompts received (from request number `since` on)."""
        return [r["body"]["messages"][-1]["content"] for r in self.requests[since:]]

    def _handler(self) -> type[BaseHTTPRequestHandler]:
        server = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args) -> None:
                pass

            def do_POST(self) -> None:
                if self.path != "/v1/chat/completions":
                    return self._send(404, {"error": "not found"})
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                user = body["messages"][-1]["content"]
                with server.lock:
                    n = server.seen[user]
                    server.seen[user] += 1
                    server.requests.append({"body": body, "auth": self.headers.get("Authorization"),
                                            "t": time.monotonic()})
                time.sleep(server.delay_s)
                question, in_a = _SLOT_A.match(user).groups()
                script = question.split()[0]
                if script == "unauthorized":
                    return self._send(401, {"error": "bad key"})
                if script == "http500" and n == 0:
                    return self._send(500, {"error": "boom"})
                if script == "http429" and n == 0:
                    return self._send(429, {"error": "slow down"}, {"Retry-After": "0"})
                if script == "slow" and n == 0:
                    time.sleep(SLOW_S)
                better = "A" if in_a.startswith("ALPHA") else "B"
                worse = "B" if better == "A" else "A"
                verdict = {"loss": worse, "tie": "C", "first": "A", "garbage": None,
                           "flaky": None if n == 0 else better}.get(script, better)
                text = "Both answers are fine. " + (f"My final verdict: [[{verdict}]]" if verdict else "I cannot say.")
                if server.mute:
                    text = None
                self._send(200, {"id": "x", "object": "chat.completion", "model": body["model"], "choices": [
                    {"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": "stop"}]})

            def _send(self, code: int, obj: dict, headers: dict | None = None) -> None:
                data = json.dumps(obj).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                for k, v in (headers or {}).items():
                    self.send_header(k, v)
                self.end_headers()
                self.wfile.write(data)

        return Handler


@pytest.fixture
def server():
    s = ScriptedJudgeServer()
    yield s
    s.close()


def _qa(scripts: list[str]) -> tuple[list[Question], dict[str, str], dict[str, str]]:
    qs = [Question(f"q{i}", f"{s} question number {i}: tell me about the river.") for i, s in enumerate(scripts)]
    return qs, {q.text: f"ALPHA answer to {q.id}." for q in qs}, {q.text: f"BETA answer to {q.id}." for q in qs}


def _settings(url: str, **kw) -> dict:
    return {"kind": "openai", "model": "scripted-judge", "base_url": url, "prompts_file": str(JUDGE_PROMPTS),
            "template": "pair-v2",
            "max_retries": 2, "backoff_s": 0.01, "timeout_s": 5.0, "n_resamples": 200, **kw}


def _rows(out: Path) -> list[dict]:
    return [json.loads(x) for x in (out / "verdicts.jsonl").read_text().splitlines()]


def test_both_orders_are_judged_and_combined_as_fastchat_does(server, tmp_path):
    qs, a, b = _qa(["win", "loss", "tie", "first"])
    summary = judge_pairs(qs, a, b, tmp_path / "out", _settings(server.url), labels=("orpo", "base"))

    # The judge saw every question twice, once with each model's answer as Assistant A, in MT-Bench's exact prompt.
    pair_v2 = next(json.loads(x) for x in JUDGE_PROMPTS.read_text().splitlines() if '"pair-v2"' in x)
    for q in qs:
        expected = {pair_v2["prompt_template"].format(question=q.text, answer_a=x, answer_b=y)
                    for x, y in ((a[q.text], b[q.text]), (b[q.text], a[q.text]))}
        assert {u for u in server.users() if q.text in u} == expected
    system = {"role": "system", "content": pair_v2["system_prompt"]}
    assert all(r["body"]["messages"][0] == system for r in server.requests)
    assert all(r["body"]["temperature"] == 0.0 and r["body"]["model"] == "scripted-judge" for r in server.requests)
    assert len(server.requests) == 8

    assert summary["counts"] == {"win": 1, "loss": 1, "tie": 1, "inconsistent": 1, "error": 0}
    assert summary["win_rate"]["estimate"] == 0.25 and summary["loss_rate"]["estimate"] == 0.25
    assert summary["tie_rate"]["estimate"] == 0.5 and summary["adjusted_win_rate"]["estimate"] == 0.5
    assert summary["inconsistent_rate"]["estimate"] == 0.25
    for rate in ("win_rate", "tie_rate", "loss_rate", "adjusted_win_rate"):
        r = summary[rate]
        assert 0 <= r["lo"] <= r["estimate"] <= r["hi"] <= 1 and r["lo"] < r["hi"]
    assert summary["position"] == {"A": 4, "B": 2, "tie": 2, "error": 0}
    assert summary["models"] == {"a": "orpo", "b": "base"} and summary["judge"]["template"] == "pair-v2"

    rows = _rows(tmp_path / "out")
    first = [r for r in rows if r["question_id"] == "q3"]
    assert [(r["order"], r["assistant_a"], r["verdict"], r["winner"], r["outcome"]) for r in first] == [
        ("ab", "orpo", "A", "orpo", "inconsistent"), ("ba", "base", "A", "base", "inconsistent")]
    assert all(r["judgment"].endswith("]]") and r["attempts"] == 1 for r in rows)
    assert json.loads((tmp_path / "out" / "summary.json").read_text())["counts"] == summary["counts"]


def test_unparseable_judgments_are_retried_then_counted_as_errors(server, tmp_path):
    qs, a, b = _qa(["win", "garbage", "flaky"])
    summary = judge_pairs(qs, a, b, tmp_path / "out", _settings(server.url, max_parse_retries=2))

    asks = Counter(u.split("\n")[1].split()[0] for u in server.users())
    assert asks == {"win": 2, "garbage": 2 * 3, "flaky": 2 * 2}
    assert summary["counts"] == {"win": 2, "loss": 0, "tie": 0, "inconsistent": 0, "error": 1}
    assert summary["errors"] == ["q1"] and summary["questions"] == 3 and summary["judged"] == 2
    assert summary["win_rate"]["estimate"] == 1.0 and summary["position"]["error"] == 2
    rows = {(r["question_id"], r["order"]): r for r in _rows(tmp_path / "out")}
    assert rows["q1", "ab"]["verdict"] is None and rows["q1", "ab"]["attempts"] == 3
    assert len(rows["q1", "ba"]["rejected"]) == 2 and rows["q1", "ba"]["outcome"] == "error"
    assert rows["q2", "ab"]["attempts"] == 2
    assert rows["q2", "ab"]["rejected"] == ["Both answers are fine. I cannot say."]


def test_http_500_and_429_are_retried_after_a_backoff(server, tmp_path):
    qs, a, b = _qa(["http500", "http429"])
    summary = judge_pairs(qs, a, b, tmp_path / "out", _settings(server.url, backoff_s=0.2))
    assert summary["counts"]["win"] == 2
    assert set(server.seen.values()) == {2} and len(server.seen) == 4
    times: dict[str, list[float]] = {}
    for r in server.requests:
        times.setdefault(r["body"]["messages"][-1]["content"], []).append(r["t"])
    assert all(t[1] - t[0] >= 0.2 for t in times.values())


def test_a_timed_out_request_is_retried(server, tmp_path):
    qs, a, b = _qa(["slow"])
    t0 = time.monotonic()
    summary = judge_pairs(qs, a, b, tmp_path / "out", _settings(server.url, timeout_s=0.3))
    assert summary["counts"]["win"] == 1 and set(server.seen.values()) == {2}
    assert time.monotonic() - t0 < 2 * SLOW_S  # gave up on each slow ask instead of waiting it out
    assert all(r["attempts"] == 1 for r in _rows(tmp_path / "out"))


def test_an_unreachable_server_stops_the_run_and_keeps_finished_verdicts(server, tmp_path):
    import socket

    qs, a, b = _qa(["win", "loss", "tie"])
    cache = tmp_path / "cache.jsonl"
    judge_pairs(qs[:2], a, b, tmp_path / "first", _settings(server.url, cache=str(cache)))
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        dead = f"http://127.0.0.1:{s.getsockname()[1]}/v1"
    with pytest.raises(JudgeUnavailable, match="gave up after 3 attempts"):
        judge_pairs(qs, a, b, tmp_path / "out", _settings(dead, cache=str(cache)))
    assert len(cache.read_text().splitlines()) == 4 and not (tmp_path / "out" / "summary.json").exists()
    # Back up: only the question that never got judged is asked.
    before = len(server.requests)
    summary = judge_pairs(qs, a, b, tmp_path / "out", _settings(server.url, cache=str(cache)))
    assert len(server.requests) - before == 2 and summary["counts"]["tie"] == 1


def test_client_errors_stop_at_once_without_retrying(server, tmp_path):
    qs, a, b = _qa(["unauthorized"])
    with pytest.raises(JudgeRequestError, match="HTTP 401"):
        judge_pairs(qs, a, b, tmp_path / "out", _settings(server.url))
    assert len(server.requests) == 1


def test_the_api_key_comes_from_the_named_variable_and_is_never_written(server, tmp_path, monkeypatch):
    qs, a, b = _qa(["win"])
    with pytest.raises(ValueError, match="ORPO_TEST_JUDGE_KEY"):
        judge_pairs(qs, a, b, tmp_path / "out", _settings(server.url, api_key_env="ORPO_TEST_JUDGE_KEY"))
    monkeypatch.setenv("ORPO_TEST_JUDGE_KEY", "sk-test-secret-123")
    judge_pairs(qs, a, b, tmp_path / "out", _settings(server.url, api_key_env="ORPO_TEST_JUDGE_KEY"))
    assert {r["auth"] for r in server.requests} == {"Bearer sk-test-secret-123"}
    assert not any("sk-test-secret" in p.read_text() for p in (tmp_path / "out").iterdir())


def test_a_rerun_asks_only_for_what_changed(server, tmp_path):
    qs, a, b = _qa(["win", "loss", "tie"])
    first = judge_pairs(qs, a, b, tmp_path / "out", _settings(server.url))
    assert first["judged_now"] == 6 and len(server.requests) == 6
    again = judge_pairs(qs, a, b, tmp_path / "out", _settings(server.url))
    assert again["from_cache"] == 6 and len(server.requests) == 6
    b[qs[1].text] = "BETA answer, revised."  # model b's answer to q1 changed: both orders of q1 are new
    judge_pairs(qs, a, b, tmp_path / "out", _settings(server.url))
    assert len(server.requests) == 8 and all(qs[1].text in u for u in server.users(6))


def test_concurrent_requests_give_the_same_verdicts_in_order(server, tmp_path):
    qs, a, b = _qa(["win", "loss", "tie", "first", "win"] * 2)
    one = judge_pairs(qs, a, b, tmp_path / "one", _settings(server.url))
    four = judge_pairs(qs, a, b, tmp_path / "four",
                       _settings(server.url, concurrency=4, cache=str(tmp_path / "c4.jsonl")))
    assert four["judged_now"] == 20 and len(server.requests) == 40
    assert four["counts"] == one["counts"] == {"win": 4, "loss": 2, "tie": 2, "inconsistent": 2, "error": 0}
    assert _rows(tmp_path / "four") == _rows(tmp_path / "one")


def test_mt_bench_first_turns_judged_from_generation_files(server, tmp_path):
    questions = SHARED / "data" / "mt_bench" / "question.jsonl"
    qs, _ = load_questions("mt_bench", questions)
    for label, prefix in (("orpo", "ALPHA"), ("base", "BETA")):  # the generate stage's jsonl
        rows = [{"key": q.id, "prompt": q.text, "response": f"{prefix} says: {q.id}", "label": label} for q in qs]
        (tmp_path / f"{label}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    summary = judge_files(questions, ("orpo", tmp_path / "orpo.jsonl"), ("base", tmp_path / "base.jsonl"),
                          tmp_path / "out", _settings(server.url, prompt_set="mt_bench", limit=3))
    assert summary["questions"] == 3 and summary["counts"]["win"] == 3 and summary["first_turn_only"]
    assert summary["models"] == {"a": "orpo", "b": "base"} and len(server.requests) == 6
    assert all(qs[i].text in u for i, u in zip([0, 0, 1, 1, 2, 2], server.users(), strict=True))
    assert [r["category"] for r in _rows(tmp_path / "out")][:2] == [qs[0].category] * 2


RUNNER = """
import json, sys
from orpo.eval.judge import Question, judge_pairs
spec = json.load(open(sys.argv[1]))
judge_pairs([Question(**q) for q in spec["questions"]], spec["a"], spec["b"], spec["out"], spec["settings"])
"""


def test_resume_after_a_killed_run_loses_nothing_and_repeats_nothing(tmp_path):
    server = ScriptedJudgeServer(delay_s=0.05)
    try:
        qs, a, b = _qa(["win", "loss", "tie", "first"] * 4)
        total = 2 * len(qs)
        spec = {"questions": [q.__dict__ for q in qs], "a": a, "b": b, "out": str(tmp_path / "killed"),
                "settings": _settings(server.url)}
        (tmp_path / "spec.json").write_text(json.dumps(spec))
        proc = subprocess.Popen([sys.executable, "-c", RUNNER, str(tmp_path / "spec.json")], cwd=ROOT,
                                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        cache = tmp_path / "killed" / "cache.jsonl"
        deadline = time.monotonic() + 30
        while not (cache.exists() and cache.read_bytes().count(b"\n") >= 8):
            assert proc.poll() is None, proc.stderr.read().decode()
            assert time.monotonic() < deadline
            time.sleep(0.01)
        os.kill(proc.pid, signal.SIGKILL)
        assert proc.wait() == -signal.SIGKILL
        cached = cache.read_bytes().count(b"\n")
        assert 8 <= cached < total and not (tmp_path / "killed" / "summary.json").exists()

        # The killed client's last requests may reach the server after the kill: count them before resuming.
        before = -1
        while before != len(server.requests):
            before = len(server.requests)
            time.sleep(4 * server.delay_s)
        resumed = judge_pairs(qs, a, b, tmp_path / "killed", _settings(server.url))
        rerun = server.users(before)
        # Every uncached judgment asked once; none of the cached ones asked again.
        assert len(rerun) == len(set(rerun)) == total - cached
        assert resumed["from_cache"] == cached and resumed["judged_now"] == total - cached

        fresh = judge_pairs(qs, a, b, tmp_path / "fresh", _settings(server.url))
        strip = {"judged_now", "from_cache", "cache_bad_lines"}
        assert {k: v for k, v in resumed.items() if k not in strip} == {k: v for k, v in fresh.items() if k not in strip}
        for name in ("summary.json", "verdicts.jsonl"):
            assert (tmp_path / "killed" / name).read_bytes() == (tmp_path / "fresh" / name).read_bytes()
    finally:
        server.close()
