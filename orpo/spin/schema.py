"""SFT row forms the spin stage accepts, parsed into a Pair whose `chosen` is the gold answer.

- messages: `messages` is a conversation ending in the assistant turn (the gold answer); every turn
  before it is the prompt.
- pairs: curated or binarized preference rows (`prompt`, `chosen`, `rejected`); `chosen` is the gold,
  `rejected` and the scores are ignored. This is how the curate stage's train split becomes an SFT set.
- prompt_response: `prompt` (a string: one user turn; or a message list) and `response` (the gold).
Recognised by key, in that order. `rejected` of the parsed Pair is empty until generation fills it.
"""

from __future__ import annotations

import json
from dataclasses import replace
from typing import Literal

# The same field checks (and field paths in errors) as curate's binarized rows.
from orpo.curate.schema import FieldError, Pair, _messages, _require, _row_id, parse_binarized

Form = Literal["messages", "prompt_response", "pairs"]
FORMS: tuple[Form, ...] = ("messages", "prompt_response", "pairs")


def detect_form(row: dict) -> Form:
    """Which SFT form a row is in, by its keys."""
    if "messages" in row:
        return "messages"
    if "chosen" in row and "rejected" in row:
        return "pairs"
    if "prompt" in row and "response" in row:
        return "prompt_response"
    raise FieldError(
        "messages", "missing: a row needs `messages`, `prompt` and `response`, or `prompt`, `chosen` and `rejected`")


def _source(row: dict, default: str) -> str:
    source = row.get("source")
    if source is not None and not isinstance(source, str):
        raise FieldError("source", f"expected str, got {type(source).__name__}")
    return source if source is not None else default


def _example(row: dict, prompt: list[tuple[str, str]], gold: str, key_text: str, default_source: str) -> Pair:
    if not prompt:
        raise FieldError("prompt", "no turn before the answer")
    return Pair(_row_id(row, key_text, ("id", "prompt_id")), tuple(prompt), gold, "", _source(row, default_source),
                None, None)


def parse_messages(row: dict, default_source: str) -> Pair:
    """A `messages` conversation: the prompt is every turn before the final assistant turn."""
    turns = _messages(_require(row, "messages", list, "messages"), "messages")
    if not turns or turns[-1][0] != "assistant":
        raise FieldError("messages", "the conversation must end with the assistant turn (the gold answer)")
    if len(turns) < 2:
        raise FieldError("messages", "no turn before the assistant answer")
    prompt = turns[:-1]
    return _example(row, prompt, turns[-1][1], json.dumps(prompt, ensure_ascii=False), default_source)


def parse_prompt_response(row: dict, default_source: str) -> Pair:
    """`prompt` (string -> one user turn, or messages) and the gold `response`."""
    value = row.get("prompt")
    if isinstance(value, str):
        prompt, key_text = [("user", value)], value
    else:
        prompt = _messages(_require(row, "prompt", list, "prompt"), "prompt")
        key_text = json.dumps(prompt, ensure_ascii=False)
    gold = _require(row, "response", str, "response")
    return _example(row, prompt, gold, key_text, default_source)


def parse_pair(row: dict, default_source: str) -> Pair:
    """A curated/binarized row: its prompt and `chosen` as the gold; scores and `rejected` are dropped."""
    pair = parse_binarized(row, default_source)
    return replace(pair, rejected="", score_chosen=None, score_rejected=None)


PARSERS = {"messages": parse_messages, "prompt_response": parse_prompt_response, "pairs": parse_pair}


def parse_sft(row: dict, default_source: str) -> tuple[Form, Pair]:
    """(form, example) for a row; FieldError naming the field when it fits no form."""
    form = detect_form(row)
    return form, PARSERS[form](row, default_source)
