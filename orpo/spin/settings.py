"""The spin stage's settings (config section `spin`, less the keys that shape the DAG), typed."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from orpo.config import SPIN_DAG_KEYS, section_defaults
from orpo.settings import typed

# The schema is the single source of defaults; iterations, sft and adapter shape the DAG, not the core.
DAG_KEYS = SPIN_DAG_KEYS
DEFAULTS: dict[str, Any] = {k: v for k, v in section_defaults("spin").items() if k not in DAG_KEYS}
GENERATION_KEYS = ("max_tokens", "batch_size", "temperature", "top_p", "seed")


@dataclass(frozen=True)
class SpinSettings:
    """The `spin` section less DAG_KEYS (the schema describes each key)."""

    max_tokens: int
    batch_size: int
    temperature: float
    top_p: float
    seed: int
    limit: int
    validation_fraction: float
    on_error: str
    max_prompt_tokens: int
    max_answer_tokens: int


def resolve_settings(settings: SpinSettings | Mapping[str, Any] | None) -> SpinSettings:
    """SpinSettings, built from a mapping as the command line builds them (checked, the schema's defaults)."""
    return typed(SpinSettings, "spin", settings, drop=DAG_KEYS)
