"""Row schemas the curate stage accepts, parsed into typed examples (raw UltraFeedback, binarized).

A row is *raw* when it has `completions` (openbmb/UltraFeedback) and *binarized* when it has
`chosen` and `rejected` but no `completions` (HuggingFaceH4/ultrafeedback_binarized and the like).
Only the fields a recipe uses are checked; a bad one raises FieldError naming it by path.
"""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import dataclass
from typing import Any, Literal

ASPECTS = ("instruction_following", "honesty", "truthfulness", "helpfulness")
NA = "N/A"


class FieldError(ValueError):
    """A row's field is missing or of the wrong type; `field` is its path, e.g. completions[1].response."""

    def __init__(self, field: str, message: str):
        self.field, self.message = field, message
        super().__init__(f"{field}: {message}")


@dataclass(frozen=True)
class Completion:
    """One candidate response with the scores the recipes rank by (None: absent or N/A)."""

    response: str
    model: str
    overall_score: float | None
    ratings: dict[str, float | None]


@dataclass(frozen=True)
class RawExample:
    """A raw UltraFeedback row: one instruction and its rated completions."""

    id: str
    source: str
    instruction: str
    completions: tuple[Completion, ...]


@dataclass(frozen=True)
class Pair:
    """A preference pair in the curated contract (prompt: every turn before the response)."""

    id: str
    prompt: tuple[tuple[str, str], ...]
    chosen: str
    rejected: str
    source: str
    score_chosen: float | None
    score_rejected: float | None


def stable_id(text: str) -> str:
    """sha256 hex of the text: the id of a row that carries none (H4's prompt_id is the same hash)."""
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def detect_form(row: dict) -> Literal["raw", "binarized"]:
    """Which schema a row is in, by its keys."""
    if "completions" in row:
        return "raw"
    if "chosen" in row and "rejected" in row:
        return "binarized"
    raise FieldError("completions", "missing: a row needs `completions` (raw) or `chosen` and `rejected` (binarized)")


def _require(row: dict, key: str, kind: type | tuple[type, ...], path: str) -> Any:
    if key not in row or row[key] is None:
        raise FieldError(path, "missing")
    value = row[key]
    if not isinstance(value, kind) or isinstance(value, bool):
        names = kind.__name__ if isinstance(kind, type) else " or ".join(k.__name__ for k in kind)
        raise FieldError(path, f"expected {names}, got {type(value).__name__}")
    return value


def _row_id(row: dict, fallback_text: str, keys: tuple[str, ...] = ("id",)) -> str:
    for key in keys:
        if row.get(key) is not None:
            return str(_require(row, key, (str, int), key))
    return stable_id(fallback_text)


def _number(value: Any, path: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise FieldError(path, f"expected a finite number, got {value!r}")
    return float(value)


def _rating(value: Any, path: str) -> float | None:
    """An aspect rating: a numeric string (as UltraFeedback stores them), a number, or "N/A" (None)."""
    if isinstance(value, str):
        text = value.strip()
        if text == NA:
            return None
        try:
            number = float(text)
        except ValueError:
            raise FieldError(path, f"expected a number or {NA!r}, got {value!r}") from None
        return _number(number, path)
    if value is None:
        raise FieldError(path, "missing")
    return _number(value, path)


def parse_raw(row: dict, recipe: str) -> RawExample:
    """Check and parse a raw row; `recipe` says which scores must be present (h4: overall_score,
    argilla_clean: the four aspect ratings)."""
    instruction = _require(row, "instruction", str, "instruction")
    source = _require(row, "source", str, "source")
    completions = _require(row, "completions", list, "completions")
    parsed = []
    for i, comp in enumerate(completions):
        at = f"completions[{i}]"
        if not isinstance(comp, dict):
            raise FieldError(at, f"expected an object, got {type(comp).__name__}")
        response = _require(comp, "response", str, f"{at}.response")
        model = comp.get("model")
        if model is not None and not isinstance(model, str):
            raise FieldError(f"{at}.model", f"expected str, got {type(model).__name__}")
        overall = None
        if recipe == "h4":
            overall = _number(
                _require(comp, "overall_score", (int, float), f"{at}.overall_score"), f"{at}.overall_score"
            )
        ratings: dict[str, float | None] = {}
        if recipe == "argilla_clean":
            annotations = _require(comp, "annotations", dict, f"{at}.annotations")
            for aspect in ASPECTS:
                a = _require(annotations, aspect, dict, f"{at}.annotations.{aspect}")
                if "Rating" not in a:
                    raise FieldError(f"{at}.annotations.{aspect}.Rating", "missing")
                ratings[aspect] = _rating(a["Rating"], f"{at}.annotations.{aspect}.Rating")
        parsed.append(Completion(response, model or "", overall, ratings))
    return RawExample(_row_id(row, instruction), source, instruction, tuple(parsed))


def _messages(value: Any, path: str) -> list[tuple[str, str]]:
    if not isinstance(value, list):
        raise FieldError(path, f"expected a string or a list of messages, got {type(value).__name__}")
    turns = []
    for i, m in enumerate(value):
        if not isinstance(m, dict):
            raise FieldError(f"{path}[{i}]", f"expected a message object, got {type(m).__name__}")
        turns.append(
            (_require(m, "role", str, f"{path}[{i}].role"), _require(m, "content", str, f"{path}[{i}].content"))
        )
    return turns


def _optional_score(row: dict, keys: tuple[str, ...]) -> float | None:
    for key in keys:
        if row.get(key) is not None:
            return _number(row[key], key)
    return None


def parse_binarized(row: dict, default_source: str) -> Pair:
    """Check and parse an already-binarized row, taken as it is.

    `chosen`/`rejected` are either response strings (then `prompt` is a string or a message list) or
    whole conversations ending in the assistant turn (then the prompt is every turn before it, which
    must be the same in both; a string `prompt` stands in when the conversation has no earlier turn).
    """
    chosen, rejected = row["chosen"], row["rejected"]
    if isinstance(chosen, str) != isinstance(rejected, str):
        raise FieldError("rejected", "chosen and rejected must both be strings or both be message lists")
    prompt_value = row.get("prompt")
    if isinstance(chosen, str):
        if prompt_value is None:
            raise FieldError("prompt", "missing (chosen and rejected are plain responses)")
        prompt = [("user", prompt_value)] if isinstance(prompt_value, str) else _messages(prompt_value, "prompt")
        chosen_text, rejected_text = chosen, rejected
    else:
        c, r = _messages(chosen, "chosen"), _messages(rejected, "rejected")
        for name, conv in (("chosen", c), ("rejected", r)):
            if not conv or conv[-1][0] != "assistant":
                raise FieldError(name, "a conversation must end with the assistant turn")
        if c[:-1] != r[:-1]:
            raise FieldError("rejected", "the turns before the response differ from chosen's")
        prompt = c[:-1]
        if not prompt and isinstance(prompt_value, str):
            prompt = [("user", prompt_value)]
        chosen_text, rejected_text = c[-1][1], r[-1][1]
    if not prompt:
        raise FieldError("prompt", "no turn before the response")
    source = row.get("source")
    if source is not None and not isinstance(source, str):
        raise FieldError("source", f"expected str, got {type(source).__name__}")
    key_text = prompt_value if isinstance(prompt_value, str) else json.dumps(prompt, ensure_ascii=False)
    return Pair(
        id=_row_id(row, key_text, ("id", "prompt_id")),
        prompt=tuple(prompt),
        chosen=chosen_text,
        rejected=rejected_text,
        source=source if source is not None else default_source,
        score_chosen=_optional_score(row, ("score_chosen", "chosen-rating")),
        score_rejected=_optional_score(row, ("score_rejected", "rejected-rating")),
    )
