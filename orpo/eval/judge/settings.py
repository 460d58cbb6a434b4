"""The judge stage's settings: defaults, one-line meanings, and checks that name the bad key."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from orpo.config import section_defaults

# The schema is the single source of the defaults; prompts_file null means the project's own prompt.
DEFAULTS: dict[str, Any] = section_defaults("judge")
PROJECT_PROMPTS = Path(__file__).resolve().parent / "pairwise.jsonl"

KINDS = ("mlx", "openai")
PROMPT_SETS = ("validation", "mt_bench")


def resolve_settings(settings: dict[str, Any]) -> dict[str, Any]:
    """Defaults filled in and every value checked; raises ValueError naming the key."""
    unknown = sorted(set(settings) - set(DEFAULTS))
    if unknown:
        raise ValueError(f"judge settings: unknown key {', '.join(unknown)} (allowed: {', '.join(sorted(DEFAULTS))})")
    s = {**DEFAULTS, **settings}
    s["prompts_file"] = s["prompts_file"] or str(PROJECT_PROMPTS)
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
