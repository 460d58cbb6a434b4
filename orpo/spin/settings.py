"""The spin stage's settings: defaults, types and checks."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from orpo.config import section_defaults
from orpo.curate.settings import is_int, is_number, overlay

# The schema is the single source of defaults; iterations, sft and adapter shape the DAG, not the core.
DAG_KEYS = ("iterations", "sft", "adapter")
DEFAULTS: dict[str, Any] = {k: v for k, v in section_defaults("spin").items() if k not in DAG_KEYS}
GENERATION_KEYS = ("max_tokens", "batch_size", "temperature", "top_p", "seed")


def resolve_settings(settings: Mapping[str, Any] | None) -> dict[str, Any]:
    """Return the defaults overlaid with `settings`; unknown keys and bad values raise ValueError."""
    s = overlay("spin", DEFAULTS, settings)

    def bad(key: str, want: str) -> ValueError:
        return ValueError(f"spin: setting '{key}' must be {want}, got {s[key]!r}")

    for key in ("max_tokens", "batch_size"):
        if not is_int(s[key]) or s[key] < 1:
            raise bad(key, "a positive integer")
    for key in ("limit", "max_prompt_tokens", "max_answer_tokens"):
        if not is_int(s[key]) or s[key] < 0:
            raise bad(key, "an integer >= 0 (0 = off)")
    if not is_int(s["seed"]):
        raise bad("seed", "an integer")
    if not is_number(s["temperature"]) or s["temperature"] < 0:
        raise bad("temperature", "a number >= 0")
    if not is_number(s["top_p"]) or not 0 < s["top_p"] <= 1:
        raise bad("top_p", "a number in (0, 1]")
    if not is_number(s["validation_fraction"]) or not 0 <= s["validation_fraction"] < 1:
        raise bad("validation_fraction", "a number in [0, 1)")
    if s["on_error"] not in ("raise", "skip"):
        raise bad("on_error", "'raise' or 'skip'")
    for key in ("temperature", "top_p", "validation_fraction"):
        s[key] = float(s[key])
    return s
