"""The judge stage's settings: defaults, one-line meanings, and checks that name the bad key."""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from orpo.config import section_defaults
from orpo.settings import typed

# The schema is the single source of the defaults; prompts_file null means the project's own prompt.
DEFAULTS: dict[str, Any] = section_defaults("judge")
PROJECT_PROMPTS = Path(__file__).resolve().parent / "pairwise.jsonl"

KINDS = ("mlx", "openai")
PROMPT_SETS = ("validation", "mt_bench")


@dataclass(frozen=True)
class JudgeSettings:
    """The `judge` section (the schema describes each key)."""

    kind: str
    model: str | None
    base_url: str
    api_key_env: str | None
    prompts_file: str | None
    template: str
    max_tokens: int
    temperature: float
    seed: int
    timeout_s: float
    max_retries: int
    backoff_s: float
    concurrency: int
    batch_size: int
    max_parse_retries: int
    n_resamples: int
    prompt_set: str
    questions: str | None
    limit: int
    cache: str | None


def resolve_settings(settings: JudgeSettings | Mapping[str, Any]) -> JudgeSettings:
    """JudgeSettings (a mapping built as the command line builds them), prompts_file null read as the project's
    own prompt; what the schema cannot say (a judge model is needed) raises ValueError naming the key."""
    s = typed(JudgeSettings, "judge", settings)
    if not s.model:
        raise ValueError("judge settings: model is required (a non-empty string)")
    if s.kind == "openai" and not s.base_url:
        raise ValueError("judge settings: base_url is required with kind openai")
    return s if s.prompts_file else dataclasses.replace(s, prompts_file=str(PROJECT_PROMPTS))


def api_key(s: JudgeSettings) -> str | None:
    """The API key from the environment variable named in settings (None when no variable is named)."""
    name = s.api_key_env
    if not name:
        return None
    value = os.environ.get(name)
    if not value:
        raise ValueError(f"judge settings: api_key_env names {name!r}, but that environment variable is not set")
    return value
