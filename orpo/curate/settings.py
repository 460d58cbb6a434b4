"""The curate stage's settings (config section `curate`), typed: the schema holds their defaults and checks."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from orpo.config import section_defaults
from orpo.settings import typed

RECIPES = ("h4", "argilla_clean", "binarized")

DEFAULTS: dict[str, Any] = section_defaults("curate")


@dataclass(frozen=True)
class CurateSettings:
    """The `curate` section (the schema describes each key)."""

    recipe: str
    seed: int
    validation_fraction: float
    drop_truthfulqa: bool
    truthfulqa_questions: str | None
    max_prompt_tokens: int
    max_pair_tokens: int
    decontam_ngram: int
    decontam_threshold: float
    on_error: str


def resolve_settings(settings: CurateSettings | Mapping[str, Any] | None) -> CurateSettings:
    """CurateSettings, built from a mapping as the command line builds them (checked, the schema's defaults)."""
    return typed(CurateSettings, "curate", settings)
