"""The spin stage's settings: defaults, types and checks."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

# Until the config schema has a `spin` section (then: section_defaults("spin") minus the DAG-only keys).
DEFAULTS: dict[str, Any] = {
    "max_tokens": 256,  # longest generated answer in tokens
    "batch_size": 32,  # prompts decoded together
    "temperature": 0.0,  # 0 = greedy; otherwise seeded sampling
    "top_p": 1.0,  # nucleus sampling mass (with temperature > 0)
    "seed": 0,  # sampling seed, the limit subset and the train/validation split
    "limit": 0,  # at most this many prompts per iteration, a seeded subset (0 = all)
    "validation_fraction": 0.05,  # fraction of pairs held out for validation
    "on_error": "raise",  # a malformed SFT row stops the stage (raise) or is dropped and counted (skip)
    "max_prompt_tokens": 0,  # drop rows whose templated generation prompt is longer (0 = no limit)
    "max_answer_tokens": 0,  # drop rows whose gold answer is longer (0 = no limit)
}
GENERATION_KEYS = ("max_tokens", "batch_size", "temperature", "top_p", "seed")


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def resolve_settings(settings: Mapping[str, Any] | None) -> dict[str, Any]:
    """Return the defaults overlaid with `settings`; unknown keys and bad values raise ValueError."""
    given = dict(settings or {})
    unknown = sorted(set(given) - set(DEFAULTS))
    if unknown:
        # A typo must not silently fall back to a default.
        raise ValueError(f"spin: unknown setting(s) {unknown}; known: {sorted(DEFAULTS)}")
    s = {**DEFAULTS, **given}

    def bad(key: str, want: str) -> ValueError:
        return ValueError(f"spin: setting '{key}' must be {want}, got {s[key]!r}")

    for key in ("max_tokens", "batch_size"):
        if not _is_int(s[key]) or s[key] < 1:
            raise bad(key, "a positive integer")
    for key in ("limit", "max_prompt_tokens", "max_answer_tokens"):
        if not _is_int(s[key]) or s[key] < 0:
            raise bad(key, "an integer >= 0 (0 = off)")
    if not _is_int(s["seed"]):
        raise bad("seed", "an integer")
    if not _is_number(s["temperature"]) or s["temperature"] < 0:
        raise bad("temperature", "a number >= 0")
    if not _is_number(s["top_p"]) or not 0 < s["top_p"] <= 1:
        raise bad("top_p", "a number in (0, 1]")
    if not _is_number(s["validation_fraction"]) or not 0 <= s["validation_fraction"] < 1:
        raise bad("validation_fraction", "a number in [0, 1)")
    if s["on_error"] not in ("raise", "skip"):
        raise bad("on_error", "'raise' or 'skip'")
    for key in ("temperature", "top_p", "validation_fraction"):
        s[key] = float(s[key])
    return s
