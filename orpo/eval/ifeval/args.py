"""Validators for instruction kwargs: each returns the value to use or raises ArgumentError.

The reference draws a random value when an argument is missing or out of range; we refuse instead,
so a score never depends on chance.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

from .lang import LANGUAGE_CODES

Validator = Callable[[Any], Any]

RELATIONS = ("less than", "at least")


class ArgumentError(ValueError):
    """An instruction argument is missing, unknown or invalid; `field` names it."""

    def __init__(self, field: str, message: str):
        self.field, self.reason = field, message
        super().__init__(f"{field}: {message}")


def count(value: Any) -> int:
    """A non-negative integer (the reference redraws negative ones at random)."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"expected an integer, got {value!r}")
    if value < 0:
        raise ValueError(f"expected an integer >= 0, got {value}")
    return value


def positive(value: Any) -> int:
    """An integer >= 1."""
    if count(value) < 1:
        raise ValueError(f"expected an integer >= 1, got {value}")
    return value


def relation(value: Any) -> str:
    """'less than' or 'at least'."""
    if value not in RELATIONS:
        raise ValueError(f"expected one of {RELATIONS}, got {value!r}")
    return value


def text(value: Any) -> str:
    """A non-empty string, kept as given."""
    if not isinstance(value, str) or not value:
        raise ValueError(f"expected a non-empty string, got {value!r}")
    return value


def stripped(value: Any) -> str:
    """A string that is not blank, stripped (as the reference strips markers and phrases)."""
    if not isinstance(value, str) or not value.strip():
        raise ValueError(f"expected a non-blank string, got {value!r}")
    return value.strip()


def pattern(value: Any) -> str:
    """A non-empty string the reference uses as a regular expression, stripped; it must compile."""
    value = stripped(value)
    try:
        re.compile(value)
    except re.error as e:
        raise ValueError(f"{value!r} is not a valid regular expression ({e})") from None
    return value


def patterns(value: Any) -> list[str]:
    """A non-empty list of regular-expression strings (kept unstripped, as the reference does)."""
    if not isinstance(value, list) or not value:
        raise ValueError(f"expected a non-empty list of strings, got {value!r}")
    for item in value:
        text(item)
        try:
            re.compile(item)
        except re.error as e:
            raise ValueError(f"{item!r} is not a valid regular expression ({e})") from None
    return list(value)


def letter(value: Any) -> str:
    """One non-blank character, lowercased (any character, as in the fixed reference)."""
    if not isinstance(value, str) or len(value) != 1 or not value.strip():
        raise ValueError(f"expected a single non-blank character, got {value!r}")
    return value.lower()


def language(value: Any) -> str:
    """An ISO 639-1 code from the reference's language list."""
    if value not in LANGUAGE_CODES:
        raise ValueError(f"expected one of {sorted(LANGUAGE_CODES)}, got {value!r}")
    return value


def lowered(value: Any) -> str:
    """A non-blank string, lowercased (the reference lowercases the expected first word)."""
    return text(value).lower()


def parse(instruction_id: str, spec: dict[str, Validator], kwargs: Any, where: str) -> dict[str, Any]:
    """Validate `kwargs` against `spec`; None values count as absent (as in HF's copy of IFEval)."""
    if not isinstance(kwargs, dict):
        raise ArgumentError(where, f"expected an object of arguments, got {type(kwargs).__name__}")
    given = {k: v for k, v in kwargs.items() if v is not None}
    for name in given:
        if name not in spec:
            raise ArgumentError(f"{where}.{name}", f"unknown argument for {instruction_id}")
    out = {}
    for name, validate in spec.items():
        if name not in given:
            raise ArgumentError(f"{where}.{name}", f"missing, required by {instruction_id}")
        try:
            out[name] = validate(given[name])
        except ValueError as e:
            raise ArgumentError(f"{where}.{name}", str(e)) from None
    return out
