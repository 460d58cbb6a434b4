"""The verifiable instructions the synthetic data uses: IFEval ids, kwargs, phrasings, conflicts, checks.

The checks reproduce Google's IFEval reference (`instructions.py`) for these ids, langdetect included
(seeded 0, as the reference run is), so a label the generator writes is the reference's verdict.
"""

from __future__ import annotations

import json
import random
import re
from collections.abc import Callable
from functools import lru_cache
from typing import Any

from orpo.data import lexicon

LOWERCASE = "change_case:english_lowercase"
CAPITAL = "change_case:english_capital"
NO_COMMA = "punctuation:no_comma"
TITLE = "detectable_format:title"
BULLETS = "detectable_format:number_bullet_lists"
JSON_FORMAT = "detectable_format:json_format"
END_CHECKER = "startend:end_checker"
QUOTATION = "startend:quotation"
POSTSCRIPT = "detectable_content:postscript"
KEYWORDS = "keywords:existence"
FORBIDDEN = "keywords:forbidden_words"
NUM_WORDS = "length_constraints:number_words"
HIGHLIGHTS = "detectable_format:number_highlighted_sections"

INSTRUCTION_IDS: tuple[str, ...] = (
    LOWERCASE, CAPITAL, NO_COMMA, TITLE, BULLETS, JSON_FORMAT, END_CHECKER,
    QUOTATION, POSTSCRIPT, KEYWORDS, FORBIDDEN, NUM_WORDS, HIGHLIGHTS,
)

# The kwargs names Google's reference takes for each id (in the order its input_data.jsonl writes them).
KWARG_NAMES: dict[str, tuple[str, ...]] = {
    LOWERCASE: (), CAPITAL: (), NO_COMMA: (), TITLE: (), JSON_FORMAT: (), QUOTATION: (),
    BULLETS: ("num_bullets",),
    END_CHECKER: ("end_phrase",),
    POSTSCRIPT: ("postscript_marker",),
    KEYWORDS: ("keywords",),
    FORBIDDEN: ("forbidden_words",),
    NUM_WORDS: ("relation", "num_words"),
    HIGHLIGHTS: ("num_highlights",),
}

# Pairs never asked together. Some contradict outright (lowercase + capital; JSON + bullets, since a
# JSON string cannot hold bullet lines); the rest could be satisfied only by odd tricks a tiny model
# should not learn (a title, highlights, a postscript or an end phrase inside a JSON string; a JSON
# string literal that is also a quotation; an end phrase after a postscript line; highlights that a
# bullet line's leading "*" would pair with).
CONFLICTS: frozenset[frozenset[str]] = frozenset(
    frozenset(p)
    for p in (
        (LOWERCASE, CAPITAL),
        (JSON_FORMAT, BULLETS), (JSON_FORMAT, TITLE), (JSON_FORMAT, QUOTATION),
        (JSON_FORMAT, END_CHECKER), (JSON_FORMAT, POSTSCRIPT), (JSON_FORMAT, HIGHLIGHTS),
        (BULLETS, HIGHLIGHTS),
        (END_CHECKER, POSTSCRIPT),
    )
)


def compatible(a: str, b: str) -> bool:
    """Whether instructions `a` and `b` may appear in one prompt."""
    return a != b and frozenset((a, b)) not in CONFLICTS


# ---- phrasings (IFEval's own wording and close variants) ----
PHRASINGS: dict[str, tuple[str, ...]] = {
    LOWERCASE: (
        "Your entire response should be in English, and in all lowercase letters. No capital letters are allowed.",
        "Your answer should use all lowercase letters.",
        "Please make sure your entire response is in English and in all lowercase letters.",
        "Write in all lowercase letters, with no capital letters at all.",
    ),
    CAPITAL: (
        "Your entire response should be in English, and in all capital letters.",
        "Make sure to only use capital letters in your entire response.",
        "Your answer must be in English and in all capital letters.",
        "Please write your whole response in capital letters.",
    ),
    NO_COMMA: (
        "Do not use any commas in your response.",
        "In your entire response, refrain from the use of any commas.",
        "You are not allowed to use any commas in your response.",
        "Make sure you don't use any commas.",
    ),
    TITLE: (
        "Your answer must contain a title, wrapped in double angular brackets, such as <<poem of joy>>.",
        "Your response must contain a title wrapped in double angular brackets, i.e. <<title>>.",
        "Give your answer a title wrapped in double angular brackets, like <<my title>>.",
    ),
    BULLETS: (
        (
            "Your answer must contain exactly {n} {bullet_noun}. Use the markdown bullet points such as:\n"
            "* This is point 1.\n* This is point 2"
        ),
        (
            'Your answer must contain exactly {n} {bullet_noun} in the markdown format (use "* " to indicate '
            "each bullet) such as:\n* This is the first point.\n* This is the second point."
        ),
        "Write exactly {n} {bullet_noun} in markdown format. Use * to indicate bullets.",
    ),
    JSON_FORMAT: (
        "Entire output should be wrapped in JSON format. You can use markdown ticks such as ```.",
        "Wrap your entire response in JSON format.",
        "Please provide your entire answer in JSON format.",
    ),
    END_CHECKER: (
        "Finish your response with this exact phrase {phrase}. No other words should follow this phrase.",
        'End your response with the exact phrase "{phrase}".',
        'The very last sentence of your response should be "{phrase}".',
    ),
    QUOTATION: (
        "Wrap your entire response with double quotation marks.",
        "Put double quotation marks around your whole response.",
        "Make sure to wrap your entire response with double quotes.",
    ),
    POSTSCRIPT: (
        "At the end of your response, please explicitly add a postscript starting with {marker}",
        "Please add a postscript starting with {marker} at the end of your response.",
        "End it with a post script starting with {marker}",
    ),
    KEYWORDS: (
        "Include the {kw_noun} {quoted} in the response.",
        "Make sure to mention {quoted} in your answer.",
        "Your response must contain the {word_noun} {quoted}.",
    ),
    FORBIDDEN: (
        "Do not include the {kw_noun} {quoted} in the response.",
        "Avoid using the following {word_noun}: {plain}.",
        "The {word_noun} {quoted} should not appear in your response.",
        "Do not mention {quoted}.",
    ),
    NUM_WORDS + ":less than": (
        "Answer with less than {n} words.",
        "Your response should contain less than {n} words.",
        "Respond with at most {n_minus_1} words.",
        "Use fewer than {n} words.",
    ),
    NUM_WORDS + ":at least": (
        "Answer with at least {n} words.",
        "Your response should contain at least {n} words.",
        "Write {n} or more words.",
        "Use at least {n} words in your answer.",
    ),
    HIGHLIGHTS: (
        "Highlight at least {n} {section_noun} in your answer with markdown, i.e. *highlighted section*.",
        "Highlight at least {n} text {section_noun}, i.e. *highlighted section*.",
        "Use markdown to highlight at least {n} {section_noun} of your answer (like this: *highlighted section*).",
    ),
}


def _plural(n: int, one: str, many: str) -> str:
    return one if n == 1 else many


def _phrase_fields(kwargs: dict[str, Any]) -> dict[str, Any]:
    """Every field a phrasing may use, from the instruction's kwargs."""
    words = kwargs.get("keywords") or kwargs.get("forbidden_words") or []
    n = kwargs.get("num_bullets") or kwargs.get("num_highlights") or kwargs.get("num_words") or 0
    return {
        "n": n,
        "n_minus_1": n - 1,
        "bullet_noun": _plural(n, "bullet point", "bullet points"),
        "section_noun": _plural(n, "section", "sections"),
        "phrase": kwargs.get("end_phrase", ""),
        "marker": kwargs.get("postscript_marker", ""),
        "quoted": " and ".join(f'"{w}"' for w in words),
        "plain": ", ".join(words),
        "kw_noun": _plural(len(words), "keyword", "keywords"),
        "word_noun": _plural(len(words), "word", "words"),
    }


def phrase(instruction_id: str, kwargs: dict[str, Any], rng: random.Random) -> str:
    """One IFEval-style sentence asking for `instruction_id` with these kwargs."""
    key = instruction_id + (":" + kwargs["relation"] if instruction_id == NUM_WORDS else "")
    return rng.choice(PHRASINGS[key]).format(**_phrase_fields(kwargs))


# ---- kwargs (num_words is left to the generator: it is fitted to a rendered answer) ----
def _some(rng: random.Random, words: tuple[str, ...]) -> list[str]:
    # one word twice as often as two: short lists are easier for a tiny model to keep track of
    return rng.sample(words, min(rng.choice((1, 1, 2)), len(words)))


_KWARGS: dict[str, Callable[[random.Random, lexicon.Topic], dict[str, Any]]] = {
    BULLETS: lambda rng, topic: {"num_bullets": rng.randint(2, 5)},
    END_CHECKER: lambda rng, topic: {"end_phrase": rng.choice(lexicon.END_PHRASES)},
    POSTSCRIPT: lambda rng, topic: {"postscript_marker": rng.choice(lexicon.POSTSCRIPT_MARKERS)},
    KEYWORDS: lambda rng, topic: {"keywords": _some(rng, lexicon.KEYWORDS)},
    FORBIDDEN: lambda rng, topic: {"forbidden_words": _some(rng, lexicon.forbidden_candidates(topic))},
    NUM_WORDS: lambda rng, topic: {"relation": rng.choice(("less than", "at least")), "num_words": 0},
    HIGHLIGHTS: lambda rng, topic: {"num_highlights": rng.randint(1, 3)},
}


def make_kwargs(instruction_id: str, topic: lexicon.Topic, rng: random.Random) -> dict[str, Any]:
    """Fresh kwargs for one instruction about `topic` (num_words gets a placeholder 0)."""
    build = _KWARGS.get(instruction_id)
    return build(rng, topic) if build else {}


# ---- checks: the reference semantics ----
_BULLET_STAR = re.compile(r"^\s*\*[^\*].*$", re.MULTILINE)
_BULLET_DASH = re.compile(r"^\s*-.*$", re.MULTILINE)
_HIGHLIGHT = re.compile(r"\*[^\n\*]*\*")
_DOUBLE_HIGHLIGHT = re.compile(r"\*\*[^\n\*]*\*\*")
_TITLE = re.compile(r"<<[^\n]+>>")
_WORD = re.compile(r"\w+")
_POSTSCRIPT_PATTERNS = {"P.P.S": r"\s*p\.\s?p\.\s?s.*$", "P.S.": r"\s*p\.\s?s\..*$"}


@lru_cache(maxsize=1)
def _language_factory() -> Any:
    # A factory of our own, seeded 0: langdetect's module-level one is left as we found it.
    from langdetect.detector_factory import PROFILES_DIRECTORY, DetectorFactory

    factory = DetectorFactory()
    factory.load_profile(PROFILES_DIRECTORY)
    factory.seed = 0
    return factory


def is_english(text: str) -> bool:
    """`langdetect.detect(text) == "en"` with `DetectorFactory.seed = 0`; undetectable counts as yes."""
    from langdetect.lang_detect_exception import LangDetectException

    detector = _language_factory().create()
    detector.append(text)
    try:
        return detector.detect() == "en"
    except LangDetectException:
        return True  # the reference counts an undetectable response as following


def count_words(text: str) -> int:
    """Words as IFEval counts them (nltk's RegexpTokenizer(r"\\w+"))."""
    return len(_WORD.findall(text))


def _json_ok(text: str) -> bool:
    text = text.strip()
    for prefix in ("```json", "```Json", "```JSON", "```"):
        text = text.removeprefix(prefix)
    try:
        json.loads(text.removesuffix("```").strip())
    except ValueError:
        return False
    return True


def _postscript_ok(text: str, marker: str) -> bool:
    pattern = _POSTSCRIPT_PATTERNS.get(marker, r"\s*" + marker.lower() + r".*$")
    return bool(re.findall(pattern, text.lower(), flags=re.MULTILINE))


def _highlights(text: str) -> int:
    single = sum(1 for h in _HIGHLIGHT.findall(text) if h.strip("*").strip())
    double = sum(1 for h in _DOUBLE_HIGHLIGHT.findall(text) if h.removeprefix("**").removesuffix("**").strip())
    return single + double


def _end_ok(text: str, end_phrase: str) -> bool:
    return text.strip().strip('"').lower().endswith(end_phrase.strip().lower())


def _quoted(text: str) -> bool:
    text = text.strip()
    return len(text) > 1 and text[0] == '"' and text[-1] == '"'


def _num_words_ok(text: str, relation: str, num_words: int) -> bool:
    n = count_words(text)
    return n < num_words if relation == "less than" else n >= num_words


# The letter half of the two case checks; the other half is is_english (slow, so callers may defer it).
CASE_LETTERS: dict[str, Callable[[str], bool]] = {LOWERCASE: str.islower, CAPITAL: str.isupper}

CHECKS: dict[str, Callable[..., bool]] = {
    LOWERCASE: lambda t: t.islower() and is_english(t),
    CAPITAL: lambda t: t.isupper() and is_english(t),
    NO_COMMA: lambda t: "," not in t,
    TITLE: lambda t: any(m.lstrip("<").rstrip(">").strip() for m in _TITLE.findall(t)),
    BULLETS: lambda t, num_bullets: len(_BULLET_STAR.findall(t)) + len(_BULLET_DASH.findall(t)) == num_bullets,
    JSON_FORMAT: _json_ok,
    END_CHECKER: _end_ok,
    QUOTATION: _quoted,
    POSTSCRIPT: lambda t, postscript_marker: _postscript_ok(t, postscript_marker),
    KEYWORDS: lambda t, keywords: all(re.search(k, t, flags=re.IGNORECASE) for k in keywords),
    FORBIDDEN: lambda t, forbidden_words: not any(
        re.search(r"\b" + w + r"\b", t, flags=re.IGNORECASE) for w in forbidden_words
    ),
    NUM_WORDS: _num_words_ok,
    HIGHLIGHTS: lambda t, num_highlights: _highlights(t) >= num_highlights,
}


def follows(instruction_id: str, response: str, kwargs: dict[str, Any]) -> bool:
    """Whether `response` follows the instruction, as IFEval's strict reference judges it."""
    return bool(response.strip()) and CHECKS[instruction_id](response, **kwargs)
