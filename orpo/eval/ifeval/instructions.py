"""The 25 IFEval instruction checkers and their registry.

Each checker is a function `(response, **kwargs) -> bool` with the semantics of Google's reference
(`instruction_following_eval/instructions.py`), registered under the reference's instruction id
with a validator per reference kwarg name. Quirks of the reference are kept on purpose, since
parity is the point: keywords and section splitters are regular expressions (not escaped), and a
response whose language cannot be detected passes the language checks.
"""

from __future__ import annotations

import collections
import functools
import json
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from . import args as a
from .lang import detect_language
from .text import count_sentences, count_words, word_tokenize

Checker = Callable[[str], bool]


@dataclass(frozen=True)
class Instruction:
    """A registered instruction: its id, check function and kwargs validators."""

    id: str
    check: Callable[..., bool]
    spec: dict[str, a.Validator]
    cross: Callable[[dict[str, Any]], None] | None = None

    @property
    def category(self) -> str:
        """The part of the id before the colon, e.g. `keywords`."""
        return self.id.split(":", 1)[0]


REGISTRY: dict[str, Instruction] = {}


def _register(instruction_id: str, cross: Callable[[dict[str, Any]], None] | None = None, **spec: a.Validator):
    def wrap(fn: Callable[..., bool]) -> Callable[..., bool]:
        REGISTRY[instruction_id] = Instruction(instruction_id, fn, spec, cross)
        return fn

    return wrap


def build_checker(instruction_id: str, kwargs: Any, where: str = "kwargs") -> Checker:
    """A `response -> bool` checker for one instruction; raises ArgumentError on bad kwargs."""
    if instruction_id not in REGISTRY:
        raise a.ArgumentError("instruction_id_list", f"unknown instruction id {instruction_id!r}")
    inst = REGISTRY[instruction_id]
    parsed = a.parse(instruction_id, inst.spec, kwargs, where)
    if inst.cross is not None:
        try:
            inst.cross(parsed)
        except a.ArgumentError as e:
            raise a.ArgumentError(f"{where}.{e.field}", e.reason) from None
    return functools.partial(inst.check, **parsed)


def _compare(actual: int, relation: str, threshold: int) -> bool:
    return actual < threshold if relation == "less than" else actual >= threshold


# keywords


@_register("keywords:existence", keywords=a.patterns)
def keywords_existence(value: str, *, keywords: list[str]) -> bool:
    """Every keyword (a regex) occurs, ignoring case."""
    return all(re.search(k, value, flags=re.IGNORECASE) for k in keywords)


@_register("keywords:frequency", keyword=a.pattern, frequency=a.count, relation=a.relation)
def keywords_frequency(value: str, *, keyword: str, frequency: int, relation: str) -> bool:
    """The keyword (a regex) occurs less than / at least `frequency` times, ignoring case."""
    return _compare(len(re.findall(keyword, value, flags=re.IGNORECASE)), relation, frequency)


@_register("keywords:forbidden_words", forbidden_words=a.patterns)
def keywords_forbidden_words(value: str, *, forbidden_words: list[str]) -> bool:
    """No forbidden word occurs as a whole word, ignoring case."""
    return not any(re.search(r"\b" + w + r"\b", value, flags=re.IGNORECASE) for w in forbidden_words)


@_register("keywords:letter_frequency", letter=a.letter, let_frequency=a.count, let_relation=a.relation)
def keywords_letter_frequency(value: str, *, letter: str, let_frequency: int, let_relation: str) -> bool:
    """The letter occurs less than / at least `let_frequency` times, ignoring case."""
    return _compare(collections.Counter(value.lower())[letter], let_relation, let_frequency)


# language and case


@_register("language:response_language", language=a.language)
def response_language(value: str, *, language: str) -> bool:
    """langdetect finds `language` (undetectable text passes, as in the reference)."""
    detected = detect_language(value)
    return detected is None or detected == language


@_register("change_case:english_capital")
def english_capital(value: str) -> bool:
    """All cased characters are upper case and the text is English."""
    if not value.isupper():
        return False
    detected = detect_language(value)
    return detected is None or detected == "en"


@_register("change_case:english_lowercase")
def english_lowercase(value: str) -> bool:
    """All cased characters are lower case and the text is English."""
    if not value.islower():
        return False
    detected = detect_language(value)
    return detected is None or detected == "en"


@_register("change_case:capital_word_frequency", capital_frequency=a.count, capital_relation=a.relation)
def capital_word_frequency(value: str, *, capital_frequency: int, capital_relation: str) -> bool:
    """Fully upper-case `word_tokenize` tokens number less than / at least `capital_frequency`."""
    capitals = sum(1 for word in word_tokenize(value) if word.isupper())
    return _compare(capitals, capital_relation, capital_frequency)


# length


@_register("length_constraints:number_sentences", num_sentences=a.count, relation=a.relation)
def number_sentences(value: str, *, num_sentences: int, relation: str) -> bool:
    """Punkt sentences number less than / at least `num_sentences`."""
    return _compare(count_sentences(value), relation, num_sentences)


@_register("length_constraints:number_words", num_words=a.count, relation=a.relation)
def number_words(value: str, *, num_words: int, relation: str) -> bool:
    """`\\w+` words number less than / at least `num_words`."""
    return _compare(count_words(value), relation, num_words)


@_register("length_constraints:number_paragraphs", num_paragraphs=a.count)
def number_paragraphs(value: str, *, num_paragraphs: int) -> bool:
    """Exactly `num_paragraphs` paragraphs separated by `***`; an empty one inside fails."""
    parts = re.split(r"\s?\*\*\*\s?", value)
    found = len(parts)
    for i, part in enumerate(parts):
        if not part.strip():
            if i in (0, len(parts) - 1):
                found -= 1  # a divider at the very start or end is tolerated
            else:
                return False
    return found == num_paragraphs


def _nth_within(parsed: dict[str, Any]) -> None:
    if not 1 <= parsed["nth_paragraph"] <= parsed["num_paragraphs"]:
        raise a.ArgumentError("nth_paragraph", f"must be between 1 and num_paragraphs ({parsed['num_paragraphs']})")


@_register(
    "length_constraints:nth_paragraph_first_word",
    cross=_nth_within,
    num_paragraphs=a.count,
    nth_paragraph=a.positive,
    first_word=a.lowered,
)
def nth_paragraph_first_word(value: str, *, num_paragraphs: int, nth_paragraph: int, first_word: str) -> bool:
    """Exactly `num_paragraphs` non-empty `\\n\\n` paragraphs, the nth starting with `first_word`."""
    parts = value.split("\n\n")
    found = sum(1 for p in parts if p.strip())
    # As in the reference, the nth part is indexed among all parts, empty ones included.
    if nth_paragraph > found:
        return False
    paragraph = parts[nth_paragraph - 1].strip()
    if not paragraph:
        return False
    word = paragraph.split()[0].strip().lstrip("'").lstrip('"')
    first = []
    for ch in word:
        if ch in ".,?!'\"":
            break
        first.append(ch.lower())
    return found == num_paragraphs and "".join(first) == first_word


# detectable content


@_register("detectable_content:number_placeholders", num_placeholders=a.count)
def number_placeholders(value: str, *, num_placeholders: int) -> bool:
    """At least `num_placeholders` `[...]` placeholders."""
    return len(re.findall(r"\[.*?\]", value)) >= num_placeholders


@_register("detectable_content:postscript", postscript_marker=a.stripped)
def postscript(value: str, *, postscript_marker: str) -> bool:
    """A line contains the postscript marker (P.S., P.P.S tolerate spaces after the dots)."""
    if postscript_marker == "P.P.S":
        marker = r"\s*p\.\s?p\.\s?s.*$"
    elif postscript_marker == "P.S.":
        marker = r"\s*p\.\s?s\..*$"
    else:
        marker = r"\s*" + postscript_marker.lower() + r".*$"  # a regex, as in the reference
    return bool(re.findall(marker, value.lower(), flags=re.MULTILINE))


# detectable format


@_register("detectable_format:number_bullet_lists", num_bullets=a.count)
def number_bullet_lists(value: str, *, num_bullets: int) -> bool:
    """Exactly `num_bullets` lines starting with `* ` (not `**`) or `-`."""
    stars = re.findall(r"^\s*\*[^\*].*$", value, flags=re.MULTILINE)
    dashes = re.findall(r"^\s*-.*$", value, flags=re.MULTILINE)
    return len(stars) + len(dashes) == num_bullets


_CONSTRAINED = ("My answer is yes.", "My answer is no.", "My answer is maybe.")


@_register("detectable_format:constrained_response")
def constrained_response(value: str) -> bool:
    """Contains one of the three 'My answer is ...' options."""
    value = value.strip()
    return any(option in value for option in _CONSTRAINED)


@_register("detectable_format:number_highlighted_sections", num_highlights=a.count)
def number_highlighted_sections(value: str, *, num_highlights: int) -> bool:
    """At least `num_highlights` non-empty `*...*` spans; a `**...**` span counts as well."""
    found = sum(1 for h in re.findall(r"\*[^\n\*]*\*", value) if h.strip("*").strip())
    found += sum(1 for h in re.findall(r"\*\*[^\n\*]*\*\*", value) if h[2:-2].strip())
    return found >= num_highlights


@_register("detectable_format:multiple_sections", section_spliter=a.pattern, num_sections=a.count)
def multiple_sections(value: str, *, section_spliter: str, num_sections: int) -> bool:
    """At least `num_sections` sections marked `<spliter> <number>`."""
    parts = re.split(r"\s?" + section_spliter + r"\s?\d+\s?", value)
    return len(parts) - 1 >= num_sections


@_register("detectable_format:json_format")
def json_format(value: str) -> bool:
    """The response, without a surrounding ``` / ```json fence, parses as JSON."""
    value = value.strip()
    for fence in ("```json", "```Json", "```JSON", "```"):
        value = value.removeprefix(fence)
    value = value.removesuffix("```").strip()
    try:
        json.loads(value)
    except ValueError:
        return False
    return True


@_register("detectable_format:title")
def title(value: str) -> bool:
    """Contains a non-blank `<<title>>` on one line."""
    return any(t.lstrip("<").rstrip(">").strip() for t in re.findall(r"<<[^\n]+>>", value))


# combination


@_register("combination:two_responses")
def two_responses(value: str) -> bool:
    """Exactly two different responses separated by `******`."""
    parts = value.split("******")
    kept = []
    for i, part in enumerate(parts):
        if part.strip():
            kept.append(part)
        elif i not in (0, len(parts) - 1):
            return False
    return len(kept) == 2 and kept[0].strip() != kept[1].strip()


@_register("combination:repeat_prompt", prompt_to_repeat=a.text)
def repeat_prompt(value: str, *, prompt_to_repeat: str) -> bool:
    """Starts with the request, ignoring case and surrounding whitespace."""
    return value.strip().lower().startswith(prompt_to_repeat.strip().lower())


# start/end and punctuation


@_register("startend:end_checker", end_phrase=a.stripped)
def end_checker(value: str, *, end_phrase: str) -> bool:
    """Ends with the phrase, ignoring case, outer whitespace and outer double quotes."""
    return value.strip().strip('"').lower().endswith(end_phrase.lower())


@_register("startend:quotation")
def quotation(value: str) -> bool:
    """Wrapped in double quotes."""
    value = value.strip()
    return len(value) > 1 and value[0] == '"' and value[-1] == '"'


@_register("punctuation:no_comma")
def no_comma(value: str) -> bool:
    """No ASCII comma."""
    return "," not in value
