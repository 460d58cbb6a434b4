"""The judge stage's settings: defaults, one-line meanings, and checks that name the bad key."""

from __future__ import annotations

import os
from typing import Any

# Until the config schema carries a `judge` section, these are the defaults (and its proposed text).
DEFAULTS: dict[str, Any] = {
    "kind": "openai",            # mlx: a local MLX model in-process; openai: an OpenAI-compatible server
    "model": None,               # mlx: model folder or hub id; openai: the model name the server expects
    "base_url": "http://127.0.0.1:8080/v1",  # openai: server root holding /chat/completions (mlx_lm.server's default)
    "api_key_env": None,         # openai: NAME of the environment variable holding the API key (none: no auth header)
    "prompts_file": None,        # FastChat-format judge_prompts.jsonl holding the template
    "template": "pair-v2",       # the pairwise template's name in prompts_file (MT-Bench's general pairwise prompt)
    "max_tokens": 2048,          # longest judgment in tokens (FastChat: 2048 for GPT-4)
    "temperature": 0.0,          # 0 = greedy, as MT-Bench judges
    "seed": 0,                   # judge sampling seed (temperature > 0) and bootstrap seed
    "timeout_s": 120.0,          # openai: per-request timeout
    "max_retries": 5,            # openai: retries on connection errors, timeouts, HTTP 5xx and 429
    "backoff_s": 1.0,            # openai: first retry wait; doubles each retry (capped at 60 s)
    "concurrency": 1,            # openai: requests in flight at once
    "batch_size": 8,             # mlx: judge prompts decoded together
    "max_parse_retries": 2,      # asks again when a judgment has no [[A]]/[[B]]/[[C]]; then it is an error
    "n_resamples": 1000,         # bootstrap resamples over questions
    "prompt_set": "validation",  # validation (curated validation.parquet) or mt_bench (question.jsonl, first turn)
    "limit": 0,                  # judge only the first N questions (0 = all)
    "cache": None,               # verdict cache (append-only jsonl); none = OUT/cache.jsonl
}

KINDS = ("mlx", "openai")
PROMPT_SETS = ("validation", "mt_bench")


def resolve_settings(settings: dict[str, Any]) -> dict[str, Any]:
    """Defaults filled in and every value checked; raises ValueError naming the key."""
    unknown = sorted(set(settings) - set(DEFAULTS))
    if unknown:
        raise ValueError(f"judge settings: unknown key {', '.join(unknown)} (allowed: {', '.join(sorted(DEFAULTS))})")
    s = {**DEFAULTS, **settings}
    if s["kind"] not in KINDS:
        raise ValueError(f"judge settings: kind must be one of {', '.join(KINDS)}, got {s['kind']!r}")
    if s["prompt_set"] not in PROMPT_SETS:
        raise ValueError(f"judge settings: prompt_set must be one of {', '.join(PROMPT_SETS)}, got {s['prompt_set']!r}")
    for key in ("model", "prompts_file", "template"):
        if not s[key] or not isinstance(s[key], str):
            raise ValueError(f"judge settings: {key} is required (a non-empty string)")
    if s["kind"] == "openai" and not s["base_url"]:
        raise ValueError("judge settings: base_url is required with kind openai")
    for key in ("max_tokens", "batch_size", "concurrency", "n_resamples"):
        if not isinstance(s[key], int) or s[key] < 1:
            raise ValueError(f"judge settings: {key} must be an integer >= 1, got {s[key]!r}")
    for key in ("max_retries", "max_parse_retries", "limit", "seed"):
        if not isinstance(s[key], int) or s[key] < 0:
            raise ValueError(f"judge settings: {key} must be an integer >= 0, got {s[key]!r}")
    for key in ("temperature", "backoff_s"):
        if not isinstance(s[key], (int, float)) or s[key] < 0:
            raise ValueError(f"judge settings: {key} must be a number >= 0, got {s[key]!r}")
    if not isinstance(s["timeout_s"], (int, float)) or s["timeout_s"] <= 0:
        raise ValueError(f"judge settings: timeout_s must be a number > 0, got {s['timeout_s']!r}")
    return s


def api_key(s: dict[str, Any]) -> str | None:
    """The API key from the environment variable named in settings (None when no variable is named)."""
    name = s["api_key_env"]
    if not name:
        return None
    value = os.environ.get(name)
    if not value:
        raise ValueError(f"judge settings: api_key_env names {name!r}, but that environment variable is not set")
    return value
