"""A judge behind any OpenAI-compatible chat-completions server, over the standard library's urllib.

Connection errors, timeouts, HTTP 5xx and 429 are retried with exponential backoff (a 429's
Retry-After is honoured); after `max_retries` retries the run stops with JudgeUnavailable, since
counting an outage as a verdict would measure the server, not the models. Other HTTP errors
(400, 401, 404, ...) are configuration problems and stop the run at once.
"""

from __future__ import annotations

import http.client
import json
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor

from orpo.eval.judge.settings import JudgeSettings, api_key

MAX_BACKOFF_S = 60.0


class JudgeUnavailable(RuntimeError):
    """The judge server could not be reached or kept failing after every retry."""


class JudgeRequestError(RuntimeError):
    """The judge server refused a request for a reason retrying cannot fix (bad URL, model or key)."""


class _Retryable(Exception):
    def __init__(self, message: str, wait_s: float | None = None):
        super().__init__(message)
        self.wait_s = wait_s


class HttpJudge:
    """Chat completions from an OpenAI-compatible server; `complete` keeps the input order."""

    def __init__(self, s: JudgeSettings):
        self.url = s.base_url.rstrip("/") + "/chat/completions"
        self.model, self.max_tokens, self.temperature = s.model, s.max_tokens, s.temperature
        self.timeout_s, self.backoff_s = s.timeout_s, s.backoff_s
        self.max_retries = s.max_retries
        self.chunk_size = s.concurrency
        self._headers = {"Content-Type": "application/json"}
        key = api_key(s)
        if key:
            self._headers["Authorization"] = f"Bearer {key}"
        # What decides the judgments, and so keys the cache: which server, which model there, how it samples.
        self.identity = {"kind": "openai", "base_url": s.base_url.rstrip("/"), "model": self.model,
                         "max_tokens": self.max_tokens, "temperature": self.temperature}

    def complete(self, chats: list[list[dict[str, str]]], attempt: int = 0) -> list[str]:
        """One judgment text per chat, requests `concurrency` at a time."""
        if self.chunk_size == 1 or len(chats) == 1:
            return [self._ask(c) for c in chats]
        with ThreadPoolExecutor(max_workers=self.chunk_size) as pool:
            return list(pool.map(self._ask, chats))

    def _ask(self, messages: list[dict[str, str]]) -> str:
        body = json.dumps({"model": self.model, "messages": messages, "max_tokens": self.max_tokens,
                           "temperature": self.temperature}).encode()
        for retry in range(self.max_retries + 1):
            try:
                return self._post(body)
            except _Retryable as e:
                if retry == self.max_retries:
                    raise JudgeUnavailable(f"judge server {self.url}: gave up after {retry + 1} attempts; "
                                           f"last error: {e}") from None
                wait = min(self.backoff_s * 2**retry, MAX_BACKOFF_S)
                time.sleep(min(max(wait, e.wait_s or 0.0), MAX_BACKOFF_S))
        raise AssertionError("unreachable")

    def _post(self, body: bytes) -> str:
        req = urllib.request.Request(self.url, data=body, headers=self._headers, method="POST")
        try:
            with urllib.request.urlopen(req, timeout=self.timeout_s) as resp:
                raw = resp.read()
        except urllib.error.HTTPError as e:
            detail = _error_text(e)
            if e.code == 429 or e.code >= 500:
                raise _Retryable(f"HTTP {e.code}: {detail}", _retry_after(e)) from None
            raise JudgeRequestError(f"judge server {self.url}: HTTP {e.code}: {detail}") from None
        except (urllib.error.URLError, TimeoutError, ConnectionError, http.client.HTTPException) as e:
            raise _Retryable(f"{type(e).__name__}: {getattr(e, 'reason', e)}") from None
        try:
            content = json.loads(raw)["choices"][0]["message"]["content"]
        except (ValueError, KeyError, IndexError, TypeError):
            raise _Retryable(f"not a chat completion: {raw[:200]!r}") from None
        # Some servers send null content (e.g. only a refusal or tool call): no verdict, not a crash.
        return content if isinstance(content, str) else ""


def _error_text(e: urllib.error.HTTPError) -> str:
    try:
        return e.read(500).decode("utf-8", "replace").strip() or str(e.reason)
    except Exception:  # the body of an error response is best-effort detail only
        return str(e.reason)


def _retry_after(e: urllib.error.HTTPError) -> float | None:
    try:
        return float(e.headers.get("Retry-After", ""))
    except (TypeError, ValueError):
        return None
