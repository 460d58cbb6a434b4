"""The curate stage's settings: defaults, types and checks."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from orpo.config import section_defaults

RECIPES = ("h4", "argilla_clean", "binarized")

DEFAULTS: dict[str, Any] = section_defaults("curate")


def is_int(v: Any) -> bool:
    """An int that is not a bool."""
    return isinstance(v, int) and not isinstance(v, bool)


def is_number(v: Any) -> bool:
    """An int or float that is not a bool."""
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def overlay(stage: str, defaults: Mapping[str, Any], settings: Mapping[str, Any] | None) -> dict[str, Any]:
    """The defaults overlaid with `settings`; an unknown key raises (a typo must not fall back silently)."""
    given = dict(settings or {})
    unknown = sorted(set(given) - set(defaults))
    if unknown:
        raise ValueError(f"{stage}: unknown setting(s) {unknown}; known: {sorted(defaults)}")
    return {**defaults, **given}


def resolve_settings(settings: Mapping[str, Any] | None) -> dict[str, Any]:
    """Return the defaults overlaid with `settings`; unknown keys and bad values raise ValueError."""
    s = overlay("curate", DEFAULTS, settings)

    def bad(key: str, want: str) -> ValueError:
        return ValueError(f"curate: setting '{key}' must be {want}, got {s[key]!r}")

    if s["recipe"] not in RECIPES:
        raise bad("recipe", f"one of {list(RECIPES)}")
    if not is_int(s["seed"]):
        raise bad("seed", "an integer")
    if not isinstance(s["drop_truthfulqa"], bool):
        raise bad("drop_truthfulqa", "true or false")
    if s["truthfulqa_questions"] is not None and not isinstance(s["truthfulqa_questions"], str):
        raise bad("truthfulqa_questions", "a file path or null")
    if not is_number(s["validation_fraction"]) or not 0 <= s["validation_fraction"] < 1:
        raise bad("validation_fraction", "a number in [0, 1)")
    for key in ("max_prompt_tokens", "max_pair_tokens", "decontam_ngram"):
        if not is_int(s[key]) or s[key] < 1:
            raise bad(key, "a positive integer")
    if not is_number(s["decontam_threshold"]) or not 0 < s["decontam_threshold"] <= 1:
        raise bad("decontam_threshold", "a number in (0, 1]")
    if s["on_error"] not in ("raise", "skip"):
        raise bad("on_error", "'raise' or 'skip'")
    s["validation_fraction"] = float(s["validation_fraction"])
    s["decontam_threshold"] = float(s["decontam_threshold"])
    return s
