"""The synthetic preference data: determinism, schema, true compliance labels, held-out eval topics.

The compliance checks below are written here, from Google's IFEval reference (`instructions.py`),
independently of `orpo.data.instructions`, so a generator bug cannot hide behind its own checker.
"""

from __future__ import annotations

import json
import re
import time
from pathlib import Path

import pytest
from langdetect import DetectorFactory, detect

from orpo.data import (
    generate_eval_prompts,
    generate_labeled_rows,
    generate_rows,
    lexicon,
    write_eval_prompts,
    write_rows,
)
from orpo.io import read_jsonl

N_ROWS = 3000
IFEVAL_INPUT = Path("/work/shared/data/ifeval/input_data.jsonl")

LOWER, CAPITAL = "change_case:english_lowercase", "change_case:english_capital"
REQUIRED_IDS = {
    LOWER, CAPITAL, "punctuation:no_comma", "detectable_format:title", "detectable_format:number_bullet_lists",
    "detectable_format:json_format", "startend:end_checker", "startend:quotation", "detectable_content:postscript",
    "keywords:existence", "keywords:forbidden_words", "length_constraints:number_words",
    "detectable_format:number_highlighted_sections",
}
# kwargs names of Google's reference, per id
REFERENCE_KWARGS = {
    LOWER: set(), CAPITAL: set(), "punctuation:no_comma": set(), "detectable_format:title": set(),
    "detectable_format:json_format": set(), "startend:quotation": set(),
    "detectable_format:number_bullet_lists": {"num_bullets"},
    "startend:end_checker": {"end_phrase"},
    "detectable_content:postscript": {"postscript_marker"},
    "keywords:existence": {"keywords"},
    "keywords:forbidden_words": {"forbidden_words"},
    "length_constraints:number_words": {"relation", "num_words"},
    "detectable_format:number_highlighted_sections": {"num_highlights"},
}


# ---------------------------------------------------------------- reference semantics, re-derived
def _json_ok(text: str) -> bool:
    text = text.strip()
    for fence in ("```json", "```Json", "```JSON", "```"):
        if text.startswith(fence):
            text = text[len(fence):]
            break
    text = text.removesuffix("```")
    try:
        json.loads(text.strip())
        return True
    except ValueError:
        return False


def _postscript_ok(text: str, marker: str) -> bool:
    pattern = {"P.P.S": r"\s*p\.\s?p\.\s?s.*$", "P.S.": r"\s*p\.\s?s\..*$"}[marker]
    return re.search(pattern, text.lower(), flags=re.MULTILINE) is not None


def _highlights(text: str) -> int:
    n = sum(1 for h in re.findall(r"\*[^\n\*]*\*", text) if h.strip("*").strip())
    return n + sum(1 for h in re.findall(r"\*\*[^\n\*]*\*\*", text) if h[2:-2].strip())


def _bullets(text: str) -> int:
    star = re.findall(r"^\s*\*[^\*].*$", text, flags=re.MULTILINE)
    return len(star) + len(re.findall(r"^\s*-.*$", text, flags=re.MULTILINE))


def _title_ok(text: str) -> bool:
    return any(m.lstrip("<").rstrip(">").strip() for m in re.findall(r"<<[^\n]+>>", text))


# Letters only for the case ids: langdetect has its own test below (it is slow).
REFERENCE = {
    LOWER: lambda t, kw: t.islower(),
    CAPITAL: lambda t, kw: t.isupper(),
    "punctuation:no_comma": lambda t, kw: "," not in t,
    "detectable_format:title": lambda t, kw: _title_ok(t),
    "detectable_format:number_bullet_lists": lambda t, kw: _bullets(t) == kw["num_bullets"],
    "detectable_format:json_format": lambda t, kw: _json_ok(t),
    "startend:end_checker": lambda t, kw: t.strip().strip('"').lower().endswith(kw["end_phrase"].strip().lower()),
    "startend:quotation": lambda t, kw: len(t.strip()) > 1 and t.strip()[0] == t.strip()[-1] == '"',
    "detectable_content:postscript": lambda t, kw: _postscript_ok(t, kw["postscript_marker"]),
    "keywords:existence": lambda t, kw: all(re.search(k, t, flags=re.IGNORECASE) for k in kw["keywords"]),
    "keywords:forbidden_words": lambda t, kw: not any(
        re.search(rf"\b{w}\b", t, flags=re.IGNORECASE) for w in kw["forbidden_words"]
    ),
    "length_constraints:number_words": lambda t, kw: (
        len(re.findall(r"\w+", t)) < kw["num_words"]
        if kw["relation"] == "less than"
        else len(re.findall(r"\w+", t)) >= kw["num_words"]
    ),
    "detectable_format:number_highlighted_sections": lambda t, kw: _highlights(t) >= kw["num_highlights"],
}


def reference_follows(instruction_id: str, text: str, kwargs: dict) -> bool:
    return bool(text.strip()) and REFERENCE[instruction_id](text, kwargs)


# Hand cases: the re-derived checks can say no, so the label test below can fail.
HAND_CASES = [
    (LOWER, {}, "all lower here.", True),
    (LOWER, {}, "Not all lower.", False),
    (CAPITAL, {}, "ALL CAPS.", True),
    (CAPITAL, {}, "ALL CAPS except this.", False),
    ("punctuation:no_comma", {}, "No comma here.", True),
    ("punctuation:no_comma", {}, "A comma, here.", False),
    ("detectable_format:title", {}, "<<A Title>>\nText.", True),
    ("detectable_format:title", {}, "<A Title>\nText.", False),
    ("detectable_format:title", {}, "<< >>\nText.", False),
    ("detectable_format:number_bullet_lists", {"num_bullets": 2}, "Intro:\n* one\n* two", True),
    ("detectable_format:number_bullet_lists", {"num_bullets": 2}, "Intro:\n* one\n* two\n- three", False),
    ("detectable_format:number_bullet_lists", {"num_bullets": 1}, "**bold** line\n* one", True),
    ("detectable_format:json_format", {}, '```json\n{"a": "b"}\n```', True),
    ("detectable_format:json_format", {}, 'Here:\n```json\n{"a": "b"}\n```', False),
    ("detectable_format:json_format", {}, '{"a": "b"', False),
    ("startend:end_checker", {"end_phrase": "Any other questions?"}, '"Text. ANY OTHER QUESTIONS?"', True),
    ("startend:end_checker", {"end_phrase": "Any other questions?"}, "Any other questions? Bye.", False),
    ("startend:quotation", {}, '"quoted"', True),
    ("startend:quotation", {}, '"half quoted', False),
    ("detectable_content:postscript", {"postscript_marker": "P.S."}, "Text.\n\np.s. more", True),
    ("detectable_content:postscript", {"postscript_marker": "P.P.S"}, "Text.\n\nP.S. more", False),
    ("keywords:existence", {"keywords": ["song"]}, "Many SONGS.", True),
    ("keywords:existence", {"keywords": ["song", "poem"]}, "A song.", False),
    ("keywords:forbidden_words", {"forbidden_words": ["red"]}, "A reddish fox.", True),
    ("keywords:forbidden_words", {"forbidden_words": ["red"]}, "A Red fox.", False),
    ("length_constraints:number_words", {"relation": "less than", "num_words": 3}, "one two", True),
    ("length_constraints:number_words", {"relation": "less than", "num_words": 3}, "one two, P.S.", False),
    ("length_constraints:number_words", {"relation": "at least", "num_words": 3}, "one two", False),
    ("detectable_format:number_highlighted_sections", {"num_highlights": 2}, "*a* and **b**", True),
    ("detectable_format:number_highlighted_sections", {"num_highlights": 2}, "*a* and ** **", False),
]


@pytest.mark.parametrize("instruction_id, kwargs, text, expected", HAND_CASES)
def test_reference_checks_on_hand_cases(instruction_id: str, kwargs: dict, text: str, expected: bool) -> None:
    assert reference_follows(instruction_id, text, kwargs) is expected


# ---------------------------------------------------------------- fixtures
@pytest.fixture(scope="module")
def generated() -> tuple[list, float]:
    # CPU time, not wall time: the bound is on the work, whatever else the machine runs
    start = time.process_time()
    labeled = generate_labeled_rows(N_ROWS, seed=0)
    return labeled, time.process_time() - start


@pytest.fixture(scope="module")
def labeled(generated: tuple[list, float]) -> list:
    return generated[0]


@pytest.fixture(scope="module")
def eval_prompts() -> list[dict]:
    return generate_eval_prompts(300, seed=0)


# ---------------------------------------------------------------- determinism
def test_same_seed_gives_identical_bytes(tmp_path: Path) -> None:
    assert write_rows(tmp_path / "a.jsonl", 200, seed=7) == 200
    assert write_rows(tmp_path / "b.jsonl", 200, seed=7) == 200
    assert (tmp_path / "a.jsonl").read_bytes() == (tmp_path / "b.jsonl").read_bytes()
    assert write_eval_prompts(tmp_path / "e1.jsonl", 100, seed=7) == 100
    assert write_eval_prompts(tmp_path / "e2.jsonl", 100, seed=7) == 100
    assert (tmp_path / "e1.jsonl").read_bytes() == (tmp_path / "e2.jsonl").read_bytes()
    # the files hold exactly what the generators return
    assert [row for _, row in read_jsonl(tmp_path / "a.jsonl")] == generate_rows(200, seed=7)
    assert [row for _, row in read_jsonl(tmp_path / "e1.jsonl")] == generate_eval_prompts(100, seed=7)


def test_different_seeds_give_different_rows() -> None:
    a, b = generate_rows(50, seed=1), generate_rows(50, seed=2)
    assert [r["instruction"] for r in a] != [r["instruction"] for r in b]
    assert generate_eval_prompts(50, seed=1) != generate_eval_prompts(50, seed=2)


def test_generation_is_fast(generated: tuple[list, float]) -> None:
    # A guard against a quadratic slip (about 5 s on 2 cores), not a benchmark: twice that fails.
    assert generated[1] < 10.0, f"{N_ROWS} rows took {generated[1]:.2f} s"


# ---------------------------------------------------------------- schema
def _check_annotation(name: str, a: dict) -> None:
    assert isinstance(a["Rating"], str)
    if name in ("honesty", "truthfulness"):
        assert a["Rating"] in {"1", "2", "3", "4", "5", "N/A"}
    else:
        assert a["Rating"] in {"1", "2", "3", "4", "5"}
    assert isinstance(a["Rationale"], str) and a["Rationale"]
    if name in ("truthfulness", "helpfulness"):
        assert isinstance(a["Type"], list) and a["Type"] and all(isinstance(t, str) for t in a["Type"])
        assert isinstance(a["Rationale For Rating"], str)
        assert set(a) == {"Type", "Rationale", "Rating", "Rationale For Rating"}
    else:
        assert set(a) == {"Rating", "Rationale"}


def test_rows_have_the_ultrafeedback_raw_schema(labeled: list) -> None:
    ids = set()
    for item in labeled:
        row = item.row
        assert set(row) == {"id", "source", "instruction", "models", "completions", "correct_answers", "incorrect_answers"}
        assert isinstance(row["id"], str) and row["id"] not in ids
        ids.add(row["id"])
        assert row["source"] == "orpo-synth" and isinstance(row["instruction"], str) and row["instruction"]
        assert row["correct_answers"] == [] and row["incorrect_answers"] == []
        assert len(row["models"]) == 4 and len(set(row["models"])) == 4
        assert len(row["completions"]) == 4
        for model, c in zip(row["models"], row["completions"]):
            assert set(c) == {
                "model", "principle", "custom_system_prompt", "response", "annotations",
                "critique", "overall_score", "fine-grained_score",
            }
            assert c["model"] == model
            assert all(isinstance(c[k], str) and c[k] for k in ("principle", "custom_system_prompt", "response", "critique"))
            assert isinstance(c["overall_score"], float) and 1.0 <= c["overall_score"] <= 10.0
            assert isinstance(c["fine-grained_score"], float)
            annotations = c["annotations"]
            assert set(annotations) == {"instruction_following", "honesty", "truthfulness", "helpfulness"}
            for name, a in annotations.items():
                _check_annotation(name, a)
            numeric = [int(a["Rating"]) for a in annotations.values() if a["Rating"] != "N/A"]
            assert c["fine-grained_score"] == pytest.approx(sum(numeric) / len(numeric))


def test_na_ratings_occur_but_rarely(labeled: list) -> None:
    ratings = [
        c["annotations"][a]["Rating"]
        for item in labeled
        for c in item.row["completions"]
        for a in ("honesty", "truthfulness")
    ]
    assert 0 < ratings.count("N/A") < 0.1 * len(ratings)


def test_labels_are_not_written_into_rows(labeled: list) -> None:
    text = json.dumps([item.row for item in labeled[:200]])
    for leak in ("instruction_id_list", "kwargs", "num_words", "off_topic", "change_case:", "startend:", "keywords:"):
        assert leak not in text


# ---------------------------------------------------------------- compliance
def test_every_label_matches_the_reference(labeled: list) -> None:
    checked = 0
    for item in labeled:
        for c, follows in zip(item.row["completions"], item.follows):
            assert len(follows) == len(item.instruction_id_list)
            for instruction_id, kwargs, claim in zip(item.instruction_id_list, item.kwargs, follows):
                actual = reference_follows(instruction_id, c["response"], kwargs)
                assert actual == claim, (item.row["id"], instruction_id, kwargs, claim, c["response"])
                checked += 1
    assert checked > 4 * N_ROWS


def test_case_compliant_responses_read_as_english(labeled: list) -> None:
    DetectorFactory.seed = 0  # as the IFEval reference run does
    texts = [
        c["response"]
        for item in labeled
        for c, follows in zip(item.row["completions"], item.follows)
        for instruction_id, ok in zip(item.instruction_id_list, follows)
        if ok and instruction_id in (LOWER, CAPITAL)
    ]
    assert len(texts) > 200
    not_english = [t for t in texts if detect(t) != "en"]
    assert not not_english, not_english[:3]


def test_every_row_has_one_best_completion_that_follows_everything(labeled: list) -> None:
    for item in labeled:
        completions = item.row["completions"]
        scores = [c["overall_score"] for c in completions]
        best = max(range(4), key=scores.__getitem__)
        assert scores.count(scores[best]) == 1, item.row["id"]
        assert all(item.follows[best]) and item.flaws[best] is None
        assert completions[best]["annotations"]["instruction_following"]["Rating"] == "5"
        for j, c in enumerate(completions):
            if j != best and item.instruction_id_list and not all(item.follows[j]):
                # breaking an instruction costs instruction-following points
                assert int(c["annotations"]["instruction_following"]["Rating"]) < 5


def test_completions_of_a_row_differ(labeled: list) -> None:
    for item in labeled:
        assert len({c["response"] for c in item.row["completions"]}) == 4, item.row["id"]


def test_completion_order_is_shuffled(labeled: list) -> None:
    positions = [max(range(4), key=lambda j: item.row["completions"][j]["overall_score"]) for item in labeled]
    for j in range(4):
        assert positions.count(j) > N_ROWS / 8


def test_losers_vary_in_compliance(labeled: list) -> None:
    broken = [len(f) - sum(f) for item in labeled if len(item.instruction_id_list) == 2 for f in item.follows]
    assert broken.count(1) > 0 and broken.count(2) > 0
    # and some losers follow the format but wander off the topic
    assert any(flaw == "off_topic" and all(f) for item in labeled for f, flaw in zip(item.follows, item.flaws))


def test_response_lengths(labeled: list) -> None:
    for item in labeled:
        for c, flaw in zip(item.row["completions"], item.flaws):
            if flaw not in ("short", "repetitive"):
                assert 15 <= len(re.findall(r"\w+", c["response"])) <= 80, c["response"]


# ---------------------------------------------------------------- coverage and conflicts
def test_every_instruction_id_appears(labeled: list, eval_prompts: list[dict]) -> None:
    train_ids = {i for item in labeled for i in item.instruction_id_list}
    assert REQUIRED_IDS <= train_ids
    assert REQUIRED_IDS <= {i for p in eval_prompts for i in p["instruction_id_list"]}
    assert any(not item.instruction_id_list for item in labeled)  # some plain prompts too
    assert max(len(item.instruction_id_list) for item in labeled) == 2


CONTRADICTIONS = [
    {LOWER, CAPITAL},
    {"detectable_format:json_format", "detectable_format:number_bullet_lists"},
    {"detectable_format:json_format", "startend:end_checker"},
    {"detectable_format:json_format", "startend:quotation"},
]


def test_no_contradictory_instructions(labeled: list, eval_prompts: list[dict]) -> None:
    lists = [item.instruction_id_list for item in labeled] + [p["instruction_id_list"] for p in eval_prompts]
    for ids in lists:
        assert len(set(ids)) == len(ids)
        assert not any(pair <= set(ids) for pair in CONTRADICTIONS), ids
    for item in labeled:
        kw = dict(zip(item.instruction_id_list, item.kwargs))
        if "keywords:existence" in kw and "keywords:forbidden_words" in kw:
            assert not set(kw["keywords:existence"]["keywords"]) & set(kw["keywords:forbidden_words"]["forbidden_words"])


# ---------------------------------------------------------------- eval prompts
def _check_kwargs(instruction_id: str, kwargs: dict) -> None:
    assert set(kwargs) == REFERENCE_KWARGS[instruction_id], (instruction_id, kwargs)
    for name, value in kwargs.items():
        if name in ("num_bullets", "num_words", "num_highlights"):
            assert isinstance(value, int) and value > 0
        elif name in ("keywords", "forbidden_words"):
            assert isinstance(value, list) and value and all(isinstance(w, str) and w for w in value)
        elif name == "relation":
            assert value in ("less than", "at least")
        elif name == "postscript_marker":
            assert value in ("P.S.", "P.P.S")
        else:
            assert isinstance(value, str) and value


def test_eval_prompts_have_the_ifeval_input_format(eval_prompts: list[dict]) -> None:
    assert [p["key"] for p in eval_prompts] == sorted({p["key"] for p in eval_prompts})
    assert len({p["prompt"] for p in eval_prompts}) == len(eval_prompts)
    for p in eval_prompts:
        assert set(p) == {"key", "prompt", "instruction_id_list", "kwargs"}
        assert isinstance(p["key"], int) and isinstance(p["prompt"], str)
        assert 1 <= len(p["instruction_id_list"]) == len(p["kwargs"]) <= 2
        for instruction_id, kwargs in zip(p["instruction_id_list"], p["kwargs"]):
            _check_kwargs(instruction_id, kwargs)
    for item in generate_labeled_rows(300, seed=3):
        for instruction_id, kwargs in zip(item.instruction_id_list, item.kwargs):
            _check_kwargs(instruction_id, kwargs)


@pytest.mark.skipif(not IFEVAL_INPUT.exists(), reason="IFEval reference input not present")
def test_kwargs_names_match_the_ifeval_reference_input() -> None:
    reference: dict[str, set[str]] = {}
    for _, row in read_jsonl(IFEVAL_INPUT):
        for instruction_id, kwargs in zip(row["instruction_id_list"], row["kwargs"]):
            reference.setdefault(instruction_id, set()).update(kwargs)
    for instruction_id in REQUIRED_IDS:
        assert reference[instruction_id] == REFERENCE_KWARGS[instruction_id]


def _mentions(text: str, names: set[str]) -> set[str]:
    return {n for n in names if re.search(rf"\b{n}\b", text, flags=re.IGNORECASE)}


def test_eval_topics_are_held_out(labeled: list, eval_prompts: list[dict]) -> None:
    train_names = {t.name for t in lexicon.TRAIN_TOPICS}
    eval_names = {t.name for t in lexicon.EVAL_TOPICS}
    assert train_names.isdisjoint(eval_names)
    for item in labeled:
        text = item.row["instruction"] + "\n".join(c["response"] for c in item.row["completions"])
        assert not _mentions(text, eval_names), item.row["id"]
    for p in eval_prompts:
        assert _mentions(p["prompt"], eval_names) and not _mentions(p["prompt"], train_names), p["prompt"]
    assert {n for p in eval_prompts for n in _mentions(p["prompt"], eval_names)} == eval_names


def _task_and_block(prompt: str, kwargs: list[dict], names: set[str]) -> tuple[str, str]:
    """The prompt's task sentence and its instruction block, with topic, kwargs words and numbers blanked."""
    words = [w for kw in kwargs for w in kw.get("keywords", []) + kw.get("forbidden_words", [])]
    for w in sorted(names | set(words), key=len, reverse=True):
        prompt = re.sub(rf"\b{w}\b", "<w>", prompt)
    m = re.fullmatch(r"(.+?[.?])(?: (.*))?", re.sub(r"\d+", "<n>", prompt), flags=re.DOTALL)
    assert m, prompt
    return m.group(1), m.group(2) or ""


def test_eval_prompts_use_the_training_phrasings(labeled: list, eval_prompts: list[dict]) -> None:
    train_names = {t.name for t in lexicon.TRAIN_TOPICS}
    tasks, singles = set(), set()
    for item in labeled:
        task, block = _task_and_block(item.row["instruction"], item.kwargs, train_names)
        tasks.add(task)
        if len(item.instruction_id_list) == 1:
            singles.add(block)
    eval_names = {t.name for t in lexicon.EVAL_TOPICS}
    for p in eval_prompts:
        task, block = _task_and_block(p["prompt"], p["kwargs"], eval_names)
        assert task in tasks, p["prompt"]
        if len(p["instruction_id_list"]) == 1:
            assert block in singles, p["prompt"]
        else:  # two phrasings joined by a space, each seen alone in training
            cuts = [i for i, ch in enumerate(block) if ch == " "]
            assert any(block[:i] in singles and block[i + 1:] in singles for i in cuts), p["prompt"]


# ---------------------------------------------------------------- the vocabulary
def test_vocabulary_supports_the_labels() -> None:
    texts = [s for t in lexicon.TRAIN_TOPICS + lexicon.EVAL_TOPICS for s in lexicon.fact_pool(t)]
    texts += list(lexicon.KEYWORD_FRAMES + lexicon.END_PHRASES + lexicon.END_TAILS + lexicon.POSTSCRIPT_TEXTS)
    texts += list(lexicon.TITLE_FRAMES + lexicon.BULLET_INTROS) + [lexicon.BULLET_INTRO_ONE, lexicon.JSON_PREFACE]
    texts += [lexicon.JSON_KEY] + [t.name for t in lexicon.TRAIN_TOPICS]
    for keyword in lexicon.KEYWORDS:  # else leaving a keyword out would not break keywords:existence
        assert not any(keyword in s.lower() for s in texts), keyword
    for phrase in lexicon.END_PHRASES:
        assert "," not in phrase
    for topic in lexicon.TRAIN_TOPICS + lexicon.EVAL_TOPICS:
        assert lexicon.forbidden_candidates(topic), topic.name
    words = {w.lower() for s in texts for w in re.findall(r"[A-Za-z]+", s)}
    assert 150 < len(words) < 600  # a small, regular English
