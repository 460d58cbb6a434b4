"""The project's own preference data, generated reproducibly from a seed.

Training rows follow the openbmb/UltraFeedback raw schema: a prompt (a base task about a topic plus
0-2 IFEval-style instructions) and four completions of varied compliance, rated as UltraFeedback
rates them (string ratings per aspect, an overall score). The one completion that follows every
instruction and stays on topic always has the strictly highest overall score. Eval prompts use
IFEval's input format, the same tasks and phrasings, and held-out topics.

Every response is built to a plan (which instructions it follows, which it breaks) and then checked
against the IFEval reference semantics; a draw that misses its plan is drawn again, so every label
is true by construction and by check. Only `random.Random(seed)` streams are used.
"""

from __future__ import annotations

import json
import os
import random
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from orpo.data import instructions as ins
from orpo.data import lexicon as lex
from orpo.io import write_jsonl

SOURCE = "orpo-synth"
# How many instructions a training prompt carries (weights for 0, 1, 2); eval prompts carry 1-2.
TRAIN_K_WEIGHTS = (0.1, 0.45, 0.45)
EVAL_K_WEIGHTS = (0.0, 0.5, 0.5)
# A draw that misses its plan is redrawn; a prompt whose plans keep missing is replaced.
MAX_ATTEMPTS = 200
OFF_TOPIC_RATE = 0.15  # share of instruction rows where one loser follows the format but not the topic
FLAWS = ("off_topic", "repetitive", "short")
MIN_WORDS, MAX_WORDS = 15, 80  # answers a tiny model can learn to write (flawed short ones aside)
MARGIN = 10  # least distance in words between a compliant answer's length and num_words
# The case checks' langdetect half costs ~2 ms a call, most of the generation time, so it runs only
# where it says no: all-capital answers here read as "vi" about once in 1,200, lowercase ones never
# did in 10,000+. Tests run langdetect on every case-following answer of their rows.
LANGDETECT_IDS = frozenset({ins.CAPITAL})


class _Redraw(Exception):
    """This draw cannot meet its plan; draw again."""


class _Unbuildable(Exception):
    """No draw met a plan in MAX_ATTEMPTS: the prompt is dropped and another one drawn."""


@dataclass
class _Row:
    """What one prompt asks for, before any response is written."""

    topic: lex.Topic
    task: str
    ids: list[str]
    kwargs: list[dict[str, Any]]
    counts: dict[str, int]  # body sentences for short / normal / long answers
    other_topics: tuple[lex.Topic, ...]  # where off-topic answers wander to


@dataclass(frozen=True)
class _Plan:
    """One completion's target: follow or break each instruction (row order), plus a quality flaw."""

    follow: tuple[bool, ...]
    flaw: str | None = None


@dataclass
class _Draft:
    """A response before rendering."""

    topic: lex.Topic
    body: list[str]
    body_idx: tuple[int, ...] = ()  # pool indices of the facts, reused by minimal-pair losers
    layout: str = "prose"  # prose | bullets | json
    n_bullets: int = 0
    bullet_intro: str = lex.BULLET_INTROS[0]
    json_mode: str = "plain"  # plain | fenced | unclosed | preface
    title: str | None = None
    highlight_at: tuple[int, ...] = ()
    postscript: str | None = None
    end: str | None = None
    tail: str | None = None
    quote: str = "none"  # none | double | open | single
    case: str = "natural"  # natural | lower | upper | lower_but_first | upper_first_sentence
    commas: bool = True


@dataclass(frozen=True)
class LabeledRow:
    """A training row plus the labels the generator knows but never writes: for tests and analysis."""

    row: dict[str, Any]
    topic: str
    instruction_id_list: list[str]
    kwargs: list[dict[str, Any]]
    follows: list[list[bool]]  # per completion (in the row's order), per instruction
    flaws: list[str | None] = field(default_factory=list)


# ---------------------------------------------------------------- responses
def _hits(sentence: str, words: list[str]) -> bool:
    return any(re.search(rf"\b{w}\b", sentence, re.IGNORECASE) for w in words)


def _pick_body(
    topic: lex.Topic,
    count: int,
    rng: random.Random,
    forbid: list[str],
    forbid_mode: str | None,
    need_comma: bool,
    base: tuple[int, ...] | None,
) -> tuple[list[str], tuple[int, ...]]:
    """Choose `count` facts (in pool order, defining one first) meeting the word and comma needs."""
    pool = lex.fact_pool(topic)
    allowed = [i for i, s in enumerate(pool) if not (forbid_mode == "avoid" and _hits(s, forbid))]
    if count > len(allowed):
        raise _Redraw
    if base is not None and len(base) == count and all(i in allowed for i in base):
        chosen = list(base)
    else:
        chosen = [allowed[0]] + rng.sample(allowed[1:], count - 1)
    # Swap in a fact that carries what the plan needs, if none does yet (never the opening fact).
    needs: list[Callable[[str], bool]] = []
    if forbid_mode == "include":
        needs.append(lambda s: _hits(s, forbid))
    if need_comma:
        needs.append(lambda s: ", " in s)
    for need in needs:
        if any(need(pool[i]) for i in chosen):
            continue
        options = [i for i in allowed if need(pool[i]) and i not in chosen]
        if not options or count < 2:
            raise _Redraw
        chosen[rng.randrange(1, count)] = rng.choice(options)
    chosen = [chosen[0]] + sorted(chosen[1:])
    return [pool[i] for i in chosen], tuple(chosen)


def _lowercase(d: _Draft, kw: dict, ok: bool, rng: random.Random) -> None:
    d.case = "lower" if ok else rng.choice(("natural", "lower_but_first"))


def _capital(d: _Draft, kw: dict, ok: bool, rng: random.Random) -> None:
    d.case = "upper" if ok else rng.choice(("natural", "upper_first_sentence"))


def _title(d: _Draft, kw: dict, ok: bool, rng: random.Random) -> None:
    text = rng.choice(lex.TITLE_FRAMES).format(N=d.topic.name.capitalize())
    # breaking: no title, a bare title line, or single brackets
    d.title = f"<<{text}>>" if ok else rng.choice((None, text, f"<{text}>"))


def _json(d: _Draft, kw: dict, ok: bool, rng: random.Random) -> None:
    mode = rng.choice(("plain", "fenced")) if ok else rng.choice(("prose", "unclosed", "preface"))
    d.layout, d.json_mode = ("prose", "plain") if mode == "prose" else ("json", mode)


def _end(d: _Draft, kw: dict, ok: bool, rng: random.Random) -> None:
    # breaking: leave the phrase out, or keep talking after it
    d.end = kw["end_phrase"] if ok or rng.random() < 0.5 else None
    d.tail = rng.choice(lex.END_TAILS) if d.end and not ok else None


def _quotation(d: _Draft, kw: dict, ok: bool, rng: random.Random) -> None:
    d.quote = "double" if ok else rng.choice(("none", "open", "single"))


def _postscript(d: _Draft, kw: dict, ok: bool, rng: random.Random) -> None:
    marker, text = kw["postscript_marker"], rng.choice(lex.POSTSCRIPT_TEXTS).format(n=d.topic.name)
    if ok:
        d.postscript = f"{marker} {text}"
    elif marker == "P.P.S" and rng.random() < 0.5:
        # the wrong marker; no mirror case, since "P.P.S" matches the reference's "P.S." pattern
        d.postscript = f"P.S. {text}"
    else:
        d.postscript = None


# Instructions that only decorate the body. no_comma, bullets, highlights, keywords, forbidden
# words and number_words shape the body itself, so _draft handles them before these run.
_DECORATE: dict[str, Callable[[_Draft, dict, bool, random.Random], None]] = {
    ins.LOWERCASE: _lowercase,
    ins.CAPITAL: _capital,
    ins.TITLE: _title,
    ins.JSON_FORMAT: _json,
    ins.END_CHECKER: _end,
    ins.QUOTATION: _quotation,
    ins.POSTSCRIPT: _postscript,
}


def _draft(row: _Row, plan: _Plan, rng: random.Random, base: tuple[int, ...] | None) -> _Draft:
    """Draw one response draft that, once rendered, should meet `plan`."""
    want = dict(zip(row.ids, plan.follow))
    kw = dict(zip(row.ids, row.kwargs))
    topic = rng.choice(row.other_topics) if plan.flaw == "off_topic" else row.topic

    variant = "normal"
    if ins.NUM_WORDS in want:  # a short answer for "less than", a long one for "at least"
        short_ok = kw[ins.NUM_WORDS]["relation"] == "less than"
        variant = "short" if short_ok == want[ins.NUM_WORDS] else "long"
    count = row.counts[variant]

    n_bullets = 0
    if ins.BULLETS in want:
        n = kw[ins.BULLETS]["num_bullets"]
        n_bullets = n if want[ins.BULLETS] else rng.choice((0, n - 1, n + 1, n + 2))
        count = max(count, n_bullets)
    n_highlights = 0
    if ins.HIGHLIGHTS in want:
        h = kw[ins.HIGHLIGHTS]["num_highlights"]
        n_highlights = rng.choice((h, h, h + 1)) if want[ins.HIGHLIGHTS] else rng.randrange(h)
        count = max(count, n_highlights + 1)  # the opening fact is never highlighted

    forbid = kw[ins.FORBIDDEN]["forbidden_words"] if ins.FORBIDDEN in want else []
    forbid_mode = None if not forbid else ("avoid" if want[ins.FORBIDDEN] else "include")
    commas = not want.get(ins.NO_COMMA, False)
    need_comma = want.get(ins.NO_COMMA) is False

    if plan.flaw in ("repetitive", "short"):
        first = lex.fact_pool(topic)[0]
        body, idx = [first] * (3 if plan.flaw == "repetitive" else 1), (0,)
    else:
        body, idx = _pick_body(topic, count, rng, forbid, forbid_mode, need_comma, base)

    if ins.KEYWORDS in want:
        words = kw[ins.KEYWORDS]["keywords"]
        present = words if want[ins.KEYWORDS] else rng.sample(words, rng.randrange(len(words)))
        for word in present:
            body.insert(rng.randint(1, len(body)), rng.choice(lex.KEYWORD_FRAMES).format(n=topic.name, kw=word))

    d = _Draft(topic=topic, body=body, body_idx=idx, commas=commas)
    if n_bullets:
        d.layout, d.n_bullets, d.bullet_intro = "bullets", n_bullets, rng.choice(lex.BULLET_INTROS)
    if n_highlights:
        if n_highlights > len(body) - 1:
            raise _Redraw
        # never the first sentence of a line: a line that opens with "*" reads as a bullet
        d.highlight_at = tuple(sorted(rng.sample(range(1, len(body)), n_highlights)))
    for instruction_id, ok in want.items():
        if instruction_id in _DECORATE:
            _DECORATE[instruction_id](d, kw[instruction_id], ok, rng)
    return d


def _render(d: _Draft) -> str:
    """The response text of a draft."""
    sents = list(d.body)
    if d.case == "upper_first_sentence":
        sents[0] = sents[0].upper()
    blocks = [d.title] if d.title else []
    if d.layout == "json":
        obj = json.dumps({lex.JSON_KEY: " ".join(sents)}, indent=2, ensure_ascii=False)
        blocks.append(
            {
                "plain": obj,
                "fenced": f"```json\n{obj}\n```",
                "unclosed": obj[:-1].rstrip(),
                "preface": f"{lex.JSON_PREFACE}\n```json\n{obj}\n```",
            }[d.json_mode]
        )
    elif d.layout == "bullets":
        k = d.n_bullets
        intro = (lex.BULLET_INTRO_ONE if k == 1 else d.bullet_intro).format(k=k, n=d.topic.name)
        blocks.append("\n".join([intro] + [f"* {s}" for s in sents[:k]]))
        if sents[k:]:
            blocks.append(" ".join(sents[k:]))
    else:
        blocks.append(" ".join(f"*{s}*" if i in d.highlight_at else s for i, s in enumerate(sents)))
    if d.end:
        end = d.end + (" " + d.tail if d.tail else "")
        if d.layout == "prose":
            blocks[-1] += " " + end
        else:
            blocks.append(end)
    if d.postscript:
        blocks.append(d.postscript)
    text = "\n\n".join(blocks)
    if not d.commas:
        text = text.replace(", ", " ").replace(",", "")
    if d.case == "lower":
        text = text.lower()
    elif d.case == "upper":
        text = text.upper()
    elif d.case == "lower_but_first":
        text = re.sub(r"[a-z]", lambda m: m.group().upper(), text.lower(), count=1)
    return {"none": text, "double": f'"{text}"', "open": f'"{text}', "single": f"'{text}'"}[d.quote]


def _meets(row: _Row, plan: _Plan, text: str) -> bool:
    """Whether `text` follows exactly the instructions `plan` says it follows (and is a fair length)."""
    if plan.flaw not in ("short", "repetitive") and not MIN_WORDS <= ins.count_words(text) <= MAX_WORDS:
        return False
    needs_english = False
    for instruction_id, kwargs, ok in zip(row.ids, row.kwargs, plan.follow):
        if instruction_id == ins.NUM_WORDS and not kwargs["num_words"]:
            continue  # not fitted yet (the first, compliant answer sets it)
        if instruction_id in ins.CASE_LETTERS:
            # letters first; langdetect, the slow half, only once everything else holds
            if ins.CASE_LETTERS[instruction_id](text) != ok:
                return False
            needs_english = needs_english or (ok and instruction_id in LANGDETECT_IDS)
        elif ins.follows(instruction_id, text, kwargs) != ok:
            return False
    return not needs_english or ins.is_english(text)


def _respond(
    row: _Row, plan: _Plan, rng: random.Random, base: tuple[int, ...] | None, taken: list[str]
) -> tuple[str, tuple[int, ...]]:
    """A response meeting `plan`, unlike those `taken` by the row already, and the facts it used."""
    for _ in range(MAX_ATTEMPTS):
        try:
            d = _draft(row, plan, rng, base)
        except _Redraw:
            base = None
            continue
        text = _render(d)
        if text not in taken and _meets(row, plan, text):
            return text, d.body_idx
        base = None  # the reused facts did not fit this plan: draw fresh ones
    raise _Unbuildable(f"no response meets plan {plan} for {row.ids} {row.kwargs} about {row.topic.name}")


# ---------------------------------------------------------------- prompts
class _Deck:
    """Instruction ids dealt from reshuffled decks, so every id is asked about equally often."""

    def __init__(self, rng: random.Random):
        self.rng, self.cards = rng, []

    def draw(self) -> str:
        if not self.cards:
            self.cards = list(ins.INSTRUCTION_IDS)
            self.rng.shuffle(self.cards)
        return self.cards.pop()


def _new_row(topics: tuple[lex.Topic, ...], weights: tuple[float, ...], rng: random.Random, deck: _Deck) -> _Row:
    topic = rng.choice(topics)
    k = rng.choices((0, 1, 2), weights=weights)[0]
    ids = [deck.draw()] if k else []
    if k == 2:
        ids.append(rng.choice([i for i in ins.INSTRUCTION_IDS if ins.compatible(ids[0], i)]))
    kwargs = [ins.make_kwargs(i, topic, rng) for i in ids]
    need = 0  # facts a compliant answer must have room for
    for i, kw in zip(ids, kwargs):
        if i == ins.BULLETS:
            need = max(need, kw["num_bullets"])
        elif i == ins.HIGHLIGHTS:
            need = max(need, kw["num_highlights"] + 2)
    short = max(3, need)
    counts = {"short": short, "normal": max(rng.randint(3, 5), need), "long": short + rng.randint(3, 4)}
    others = tuple(t for t in topics if t != topic)  # off-topic answers stay inside the topic split
    return _Row(topic, rng.choice(lex.TASKS), ids, kwargs, counts, others)


def _fit_num_words(row: _Row, compliant: str) -> None:
    """Set num_words 10-14 words beyond the compliant answer's length, on a multiple of 5.

    The margin lets other answers that follow it add or drop a line (an end phrase, a postscript,
    a bullet) and still follow it; answers that break it differ by 4+ sentences.
    """
    for i, kw in zip(row.ids, row.kwargs):
        if i == ins.NUM_WORDS:
            n = ins.count_words(compliant)
            less = kw["relation"] == "less than"
            kw["num_words"] = -(-(n + MARGIN) // 5) * 5 if less else max(5, (n - MARGIN) // 5 * 5)


def _prompt(row: _Row, rng: random.Random) -> str:
    parts = [row.task.format(n=row.topic.name)] + [ins.phrase(i, kw, rng) for i, kw in zip(row.ids, row.kwargs)]
    return " ".join(parts)


def _plans(row: _Row, rng: random.Random) -> list[_Plan]:
    """The compliant plan first, then three losers."""
    k = len(row.ids)
    best = _Plan((True,) * k)
    if k == 0:
        return [best] + [_Plan((), f) for f in rng.sample(FLAWS, 3)]
    if k == 1:
        losers = [_Plan((False,))] * 3
    else:
        losers = [_Plan(p) for p in rng.sample([(False, True), (True, False), (False, False)], 3)]
    if rng.random() < OFF_TOPIC_RATE:
        losers[rng.randrange(3)] = _Plan((True,) * k, "off_topic")
    return [best] + losers


# ---------------------------------------------------------------- ratings
_IF_RATIONALE = {
    "5": "The text fully aligns with the task goal and meets every stated restriction.",
    "4": "The text aligns with the task goal with only a minor deviation.",
    "3": "The text meets the task goal but neglects part of the requested format.",
    "2": "The text addresses the task only in part and misses the requested format.",
    "1": "The text is irrelevant to the task or ignores the requested format.",
}
_HONESTY_RATIONALE = {
    "5": "The text is correct and confident.",
    "4": "The text is correct but not fully confident.",
    "3": "The text is mostly correct but shows some doubt.",
    "N/A": "Honesty is not a concern for this simple descriptive task.",
}
_TRUTH_TYPE_RATIONALE = {
    "0": "The text contains no hallucinations.",
    "2": "The text talks about something the instruction did not ask about.",
    "None": "N/A",
}
_TRUTH_RATING_RATIONALE = {
    "5": "The text is free of hallucinations.",
    "4": "The text is mostly truthful with a slight issue.",
    "3": "The text is partly misleading.",
    "2": "The text deviates from the instruction in a severe way.",
    "N/A": "N/A",
}
_HELP_TYPE_RATIONALE = {
    ("1", "2", "3"): "The text is clear, relevant and gives useful facts without repetition.",
    ("1", "2"): "The text is clear and gives useful facts.",
    ("1",): "The text is clear but gives very little.",
    ("None",): "The text does not address the topic of the task.",
}
_HELP_RATING_RATIONALE = {
    "5": "The text is accurate and very informative.",
    "4": "The text is accurate and informative.",
    "3": "The text is correct but leaves parts of the request unmet.",
    "2": "The text has problems that may cause confusion.",
    "1": "The text is not helpful for this task.",
}
_CRITIQUES = (  # (lowest overall score, text)
    (7.0, "Your answer is clear and follows the request closely. Keep it up."),
    (4.0, "Your answer is on topic but misses part of the requested format. Read the instructions again."),
    (0.0, "Your answer does not match the request. Focus on the topic and on the requested format."),
)
_FLAW_PENALTY = {None: 0.0, "off_topic": 3.5, "repetitive": 2.5, "short": 2.0}


def _rate(plan: _Plan, best: float, rng: random.Random) -> tuple[dict[str, dict], float]:
    """UltraFeedback annotations and overall score for a completion with this plan."""
    k, followed = len(plan.follow), sum(plan.follow)
    frac = followed / k if k else 1.0
    flaw = plan.flaw
    if flaw == "off_topic":
        if_rating = rng.choice("12")
    elif flaw:
        if_rating = rng.choice("23")
    else:
        if_rating = {1.0: "5", 0.5: rng.choice("23"), 0.0: rng.choice("12")}[frac]
    if flaw is None:
        help_types = ("1", "2", "3") if frac == 1.0 else ("1", "2")
        help_rating = rng.choice("45") if frac == 1.0 else rng.choice("34")
    elif flaw == "off_topic":
        help_types, help_rating = ("None",), rng.choice("12")
    else:
        help_types, help_rating = ("1",), rng.choice("23")
    if rng.random() < 0.03:
        truth_type, truth_rating = "None", "N/A"
    elif flaw == "off_topic":
        truth_type, truth_rating = "2", rng.choice("23")
    else:
        truth_type, truth_rating = "0", rng.choice("554")
    honesty = "N/A" if rng.random() < 0.05 else rng.choice("5543")
    annotations = {
        "instruction_following": {"Rating": if_rating, "Rationale": _IF_RATIONALE[if_rating]},
        "honesty": {"Rating": honesty, "Rationale": _HONESTY_RATIONALE[honesty]},
        "truthfulness": {
            "Type": [truth_type],
            "Rationale": _TRUTH_TYPE_RATIONALE[truth_type],
            "Rating": truth_rating,
            "Rationale For Rating": _TRUTH_RATING_RATIONALE[truth_rating],
        },
        "helpfulness": {
            "Type": list(help_types),
            "Rationale": _HELP_TYPE_RATIONALE[help_types],
            "Rating": help_rating,
            "Rationale For Rating": _HELP_RATING_RATIONALE[help_rating],
        },
    }
    if frac == 1.0 and flaw is None:
        overall = best
    else:  # strictly below the compliant answer, on UltraFeedback's half-point 1-10 scale
        raw = 2.0 + 5.0 * frac - _FLAW_PENALTY[flaw] + rng.choice((-0.5, 0.0, 0.5))
        overall = min(max(raw, 1.0), best - 0.5)
    return annotations, overall


def _completion(response: str, plan: _Plan, best: float, rng: random.Random) -> dict[str, Any]:
    annotations, overall = _rate(plan, best, rng)
    ratings = [a["Rating"] for a in annotations.values() if a["Rating"] != "N/A"]
    principle = rng.choice(lex.PRINCIPLES)
    return {
        "annotations": annotations,
        "critique": next(text for low, text in _CRITIQUES if overall >= low),
        "custom_system_prompt": rng.choice(lex.SYSTEM_PROMPTS[principle]),
        "fine-grained_score": sum(int(r) for r in ratings) / len(ratings),
        "model": "",  # set once the completions are shuffled
        "overall_score": overall,
        "principle": principle,
        "response": response,
    }


# ---------------------------------------------------------------- public API
def _draw(
    topics: tuple[lex.Topic, ...],
    weights: tuple[float, ...],
    rng: random.Random,
    deck: _Deck,
    seen: set[str],
    with_losers: bool,
) -> tuple[_Row, str, list[_Plan], list[str]]:
    """A row with a prompt not drawn before, its plans and responses (just the compliant one if not `with_losers`)."""
    for _ in range(MAX_ATTEMPTS):
        row = _new_row(topics, weights, rng, deck)
        plans = _plans(row, rng)
        try:
            compliant, idx = _respond(row, plans[0], rng, None, [])
            _fit_num_words(row, compliant)
            prompt = _prompt(row, rng)
            if prompt in seen:
                continue
            responses = [compliant]
            for plan in plans[1:] if with_losers else ():
                # half the losers reuse the compliant answer's facts: pairs that differ in format only
                base = idx if rng.random() < 0.5 else None
                responses.append(_respond(row, plan, rng, base, responses)[0])
        except _Unbuildable:
            continue  # rare: a combination no draw could meet; another prompt takes its place
        seen.add(prompt)
        return row, prompt, plans, responses
    raise RuntimeError("could not draw a new prompt; ask for fewer rows")


def generate_labeled_rows(n_rows: int, seed: int) -> list[LabeledRow]:
    """Training rows with their hidden labels (which instructions each completion follows)."""
    rng = random.Random(seed)
    deck, seen, out = _Deck(rng), set(), []
    for index in range(n_rows):
        row, prompt, plans, responses = _draw(lex.TRAIN_TOPICS, TRAIN_K_WEIGHTS, rng, deck, seen, with_losers=True)
        best = rng.choice((7.5, 8.0, 8.5, 9.0))
        completions = [_completion(r, p, best, rng) for r, p in zip(responses, plans)]
        order = list(range(4))
        rng.shuffle(order)
        models = rng.sample(lex.MODEL_NAMES, 4)
        for position, j in enumerate(order):
            completions[j]["model"] = models[position]
        record = {
            "id": f"{SOURCE}-{seed}-{index:06d}",
            "source": SOURCE,
            "instruction": prompt,
            "models": models,
            "completions": [completions[j] for j in order],
            "correct_answers": [],
            "incorrect_answers": [],
        }
        out.append(
            LabeledRow(
                row=record,
                topic=row.topic.name,
                instruction_id_list=list(row.ids),
                kwargs=[dict(kw) for kw in row.kwargs],
                follows=[list(plans[j].follow) for j in order],
                flaws=[plans[j].flaw for j in order],
            )
        )
    return out


def generate_rows(n_rows: int, seed: int) -> list[dict]:
    """Training rows in the openbmb/UltraFeedback raw schema (plus a stable `id`)."""
    return [labeled.row for labeled in generate_labeled_rows(n_rows, seed)]


def generate_eval_prompts(n_prompts: int, seed: int) -> list[dict]:
    """Eval prompts in IFEval's input format, about held-out topics only."""
    # A stream of its own: the eval set does not shift when the training arguments change.
    rng = random.Random(f"{SOURCE}-eval-{seed}")
    deck, seen, out = _Deck(rng), set(), []
    for index in range(n_prompts):
        row, prompt, _, _ = _draw(lex.EVAL_TOPICS, EVAL_K_WEIGHTS, rng, deck, seen, with_losers=False)
        out.append({"key": index + 1, "prompt": prompt, "instruction_id_list": list(row.ids), "kwargs": row.kwargs})
    return out


def write_rows(path: str | os.PathLike, n_rows: int, seed: int) -> int:
    """Write `n_rows` training rows as jsonl (atomically); returns the row count."""
    return write_jsonl(path, generate_rows(n_rows, seed))


def write_eval_prompts(path: str | os.PathLike, n_prompts: int, seed: int) -> int:
    """Write `n_prompts` eval prompts as jsonl (atomically); returns the prompt count."""
    return write_jsonl(path, generate_eval_prompts(n_prompts, seed))
