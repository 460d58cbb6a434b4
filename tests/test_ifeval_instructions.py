"""Hand-made cases for each IFEval instruction, loose mode, input validation and the bootstrap."""

from __future__ import annotations

import json

import pytest

from orpo.eval.ifeval import (
    ArgumentError,
    MissingResponseError,
    bootstrap_ci,
    bootstrap_diff,
    build_checker,
    evaluate,
    loose_variants,
    read_inputs,
    read_responses,
    summarize,
)
from orpo.eval.ifeval.text import count_sentences, count_words, punkt_english_parameters, word_tokenize
from orpo.io import InputError

AT_LEAST, LESS = "at least", "less than"

CASES = [
    # keywords
    ("keywords:existence", {"keywords": ["apple", "Banana"]}, "I like APPLE and banana.", True),
    ("keywords:existence", {"keywords": ["apple", "Banana"]}, "I like apple.", False),
    ("keywords:frequency", {"keyword": "cat", "frequency": 2, "relation": AT_LEAST}, "Cat and cat.", True),
    ("keywords:frequency", {"keyword": "cat", "frequency": 2, "relation": AT_LEAST}, "One cat.", False),
    # substrings count, as in the reference (it searches a regex, not a word)
    ("keywords:frequency", {"keyword": "cat", "frequency": 2, "relation": AT_LEAST}, "concatenate cat", True),
    ("keywords:frequency", {"keyword": "cat", "frequency": 2, "relation": LESS}, "One cat.", True),
    ("keywords:frequency", {"keyword": "cat", "frequency": 2, "relation": LESS}, "cat cat", False),
    ("keywords:forbidden_words", {"forbidden_words": ["war"]}, "A warm day.", True),
    ("keywords:forbidden_words", {"forbidden_words": ["war", "peace"]}, "The War ended.", False),
    ("keywords:letter_frequency", {"letter": "a", "let_frequency": 3, "let_relation": AT_LEAST}, "bAnana", True),
    ("keywords:letter_frequency", {"letter": "a", "let_frequency": 3, "let_relation": AT_LEAST}, "band", False),
    ("keywords:letter_frequency", {"letter": "A", "let_frequency": 3, "let_relation": LESS}, "Aa", True),
    ("keywords:letter_frequency", {"letter": "a", "let_frequency": 3, "let_relation": LESS}, "aaa", False),
    ("keywords:letter_frequency", {"letter": "#", "let_frequency": 3, "let_relation": AT_LEAST}, "## #", True),
    # language and case
    (
        "language:response_language",
        {"language": "de"},
        "Das ist ein kurzer deutscher Satz über das Wetter in Berlin und München.",
        True,
    ),
    (
        "language:response_language",
        {"language": "de"},
        "This is a short English sentence about the weather in London today.",
        False,
    ),
    ("language:response_language", {"language": "de"}, "12345 !!! 678", True),  # undetectable passes
    ("change_case:english_capital", {}, "THIS IS AN ENGLISH SENTENCE ABOUT THE WEATHER TODAY.", True),
    ("change_case:english_capital", {}, "THIS IS AN ENGLISH SENTENCE ABOUT THE Weather TODAY.", False),
    ("change_case:english_capital", {}, "DAS IST EIN DEUTSCHER SATZ ÜBER DAS WETTER IN BERLIN HEUTE.", False),
    ("change_case:english_lowercase", {}, "this is an english sentence about the weather today.", True),
    ("change_case:english_lowercase", {}, "This is an english sentence about the weather today.", False),
    ("change_case:english_lowercase", {}, "das ist ein deutscher satz über das wetter in berlin heute.", False),
    (
        "change_case:capital_word_frequency",
        {"capital_frequency": 3, "capital_relation": AT_LEAST},
        "The USA and the UK are NOT small.",
        True,
    ),
    (
        "change_case:capital_word_frequency",
        {"capital_frequency": 3, "capital_relation": AT_LEAST},
        "Only NASA and the EU.",
        False,
    ),
    (
        "change_case:capital_word_frequency",
        {"capital_frequency": 3, "capital_relation": LESS},
        "Only NASA and the EU.",
        True,
    ),
    # length
    (
        "length_constraints:number_sentences",
        {"num_sentences": 3, "relation": AT_LEAST},
        "Dr. Smith arrived. He sat. It rained.",
        True,
    ),
    (
        "length_constraints:number_sentences",
        {"num_sentences": 3, "relation": LESS},
        "Dr. Smith arrived. He sat. It rained.",
        False,
    ),
    ("length_constraints:number_sentences", {"num_sentences": 3, "relation": LESS}, "Dr. Smith arrived. He sat.", True),
    ("length_constraints:number_words", {"num_words": 5, "relation": LESS}, "one two three four", True),
    ("length_constraints:number_words", {"num_words": 4, "relation": LESS}, "one two three four", False),
    ("length_constraints:number_words", {"num_words": 3, "relation": AT_LEAST}, "don't stop", True),
    ("length_constraints:number_paragraphs", {"num_paragraphs": 2}, "A\n***\nB", True),
    ("length_constraints:number_paragraphs", {"num_paragraphs": 2}, "***\nA\n***\nB\n***", True),
    ("length_constraints:number_paragraphs", {"num_paragraphs": 2}, "A\n***\n\n***\nB", False),
    ("length_constraints:number_paragraphs", {"num_paragraphs": 2}, "A\n\nB", False),
    (
        "length_constraints:nth_paragraph_first_word",
        {"num_paragraphs": 2, "nth_paragraph": 2, "first_word": "However"},
        'Intro.\n\n"However, it works."',
        True,
    ),
    (
        "length_constraints:nth_paragraph_first_word",
        {"num_paragraphs": 2, "nth_paragraph": 2, "first_word": "however"},
        "Intro.\n\nBut no.",
        False,
    ),
    (
        "length_constraints:nth_paragraph_first_word",
        {"num_paragraphs": 2, "nth_paragraph": 2, "first_word": "however"},
        "Intro.\n\nHowever.\n\nExtra.",
        False,
    ),
    # detectable content
    ("detectable_content:number_placeholders", {"num_placeholders": 2}, "Dear [name], at [address].", True),
    ("detectable_content:number_placeholders", {"num_placeholders": 2}, "Dear [name].", False),
    ("detectable_content:postscript", {"postscript_marker": "P.S."}, "Hi.\n\np.s. see you", True),
    ("detectable_content:postscript", {"postscript_marker": "P.S."}, "Hi.\n\nPS see you", False),
    ("detectable_content:postscript", {"postscript_marker": "P.P.S"}, "Hi.\nP. P. S bye", True),
    ("detectable_content:postscript", {"postscript_marker": "P.P.S"}, "Hi.\nP.S. bye", False),
    # detectable format
    ("detectable_format:number_bullet_lists", {"num_bullets": 2}, "* a\n- b", True),
    ("detectable_format:number_bullet_lists", {"num_bullets": 2}, "* a\n- b\n  - c", False),
    ("detectable_format:number_bullet_lists", {"num_bullets": 2}, "**bold**\n* a", False),
    ("detectable_format:constrained_response", {}, "Well... My answer is maybe.", True),
    ("detectable_format:constrained_response", {}, "My answer is yes", False),
    ("detectable_format:number_highlighted_sections", {"num_highlights": 2}, "*one* and *two*", True),
    ("detectable_format:number_highlighted_sections", {"num_highlights": 2}, "*one* and * *", False),
    ("detectable_format:number_highlighted_sections", {"num_highlights": 2}, "**bold** and *x*", True),
    (
        "detectable_format:multiple_sections",
        {"section_spliter": "Section", "num_sections": 2},
        "Section 1\nA\nSection 2\nB",
        True,
    ),
    ("detectable_format:multiple_sections", {"section_spliter": "Section", "num_sections": 2}, "Section 1\nA", False),
    (
        "detectable_format:multiple_sections",
        {"section_spliter": "Section", "num_sections": 2},
        "SECTION 1\nA\nSECTION 2\nB",
        False,
    ),
    ("detectable_format:json_format", {}, '```json\n{"a": 1}\n```', True),
    ("detectable_format:json_format", {}, "```JSON\n[1, 2]\n```", True),
    ("detectable_format:json_format", {}, '{"a": 1', False),
    ("detectable_format:json_format", {}, 'Here it is: {"a": 1}', False),
    ("detectable_format:title", {}, "<<My Title>>\nBody", True),
    ("detectable_format:title", {}, "<< >>\nBody", False),
    ("detectable_format:title", {}, "<<My\nTitle>>", False),
    # combination
    ("combination:two_responses", {}, "First.\n******\nSecond.", True),
    ("combination:two_responses", {}, "Same.\n******\nSame.", False),
    ("combination:two_responses", {}, "A\n******\n\n******\nB", False),
    ("combination:repeat_prompt", {"prompt_to_repeat": "Write a poem."}, "  write a poem. Roses are red.", True),
    ("combination:repeat_prompt", {"prompt_to_repeat": "Write a poem."}, "Sure! Write a poem.", False),
    # start/end, punctuation
    ("startend:end_checker", {"end_phrase": "Any other questions?"}, '"Done. any other questions?"\n', True),
    ("startend:end_checker", {"end_phrase": "Any other questions?"}, "Any other questions? Thanks.", False),
    ("startend:quotation", {}, ' "hello" ', True),
    ("startend:quotation", {}, "hello", False),
    ("startend:quotation", {}, '"', False),
    ("punctuation:no_comma", {}, "No commas here.", True),
    ("punctuation:no_comma", {}, "Yes, one.", False),
]


@pytest.mark.parametrize("instruction_id, kwargs, response, expected", CASES)
def test_instruction(instruction_id, kwargs, response, expected):
    assert build_checker(instruction_id, kwargs)(response) is expected


def test_every_instruction_has_a_passing_and_a_failing_case():
    from orpo.eval.ifeval import REGISTRY

    seen = {(i, e) for i, _, _, e in CASES}
    assert {i for i, _ in seen} == set(REGISTRY)
    assert all((i, True) in seen and (i, False) in seen for i in REGISTRY)


# text helpers


def test_punkt_parameters_are_nltks_english_punkt_tab():
    params = punkt_english_parameters()
    assert (
        len(params.abbrev_types),
        len(params.collocations),
        len(params.sent_starters),
        len(params.ortho_context),
    ) == (156, 37, 39, 20366)


def test_sentences_follow_punkt_abbreviations():
    assert count_sentences("Dr. Smith met Mr. Jones at 3 p.m. today. They talked.") == 2
    assert count_sentences("It rained. It poured! Did it stop?") == 3


def test_word_helpers():
    assert count_words("don't stop-now, ok?") == 5
    assert word_tokenize("The U.S. is big. It's true.") == ["The", "U.S.", "is", "big", ".", "It", "'s", "true", "."]


# strict and loose modes


def _run(instruction_id: str, kwargs: dict, response: str, mode: str) -> bool:
    inp = {"key": 1, "prompt": "p", "instruction_id_list": [instruction_id], "kwargs": [kwargs]}
    (result,) = evaluate([inp], {"p": response}, mode)
    assert result["follow_all_instructions"] == all(result["follow_instruction_list"])
    return result["follow_instruction_list"][0]


def test_loose_variants_are_the_reference_eight():
    assert loose_variants("*Hi*\nbody *x*\nbye*") == [
        "*Hi*\nbody *x*\nbye*",
        "Hi\nbody x\nbye",
        "body *x*\nbye*",
        "*Hi*\nbody *x*",
        "body *x*",
        "body x\nbye",
        "Hi\nbody x",
        "body x",
    ]


@pytest.mark.parametrize(
    "instruction_id, kwargs, response, loose",
    [
        ("startend:quotation", {}, 'Sure, here it is:\n"quoted text"', True),  # first line removed
        ("detectable_format:json_format", {}, '{"a": 1}\nHope this helps!', True),  # last line removed
        ("startend:quotation", {}, 'Sure:\n"quoted"\nEnjoy!', True),  # both removed
        (
            "startend:end_checker",
            {"end_phrase": "Is there anything else I can help with?"},
            "Done.\n**Is there anything else I can help with?**",
            True,
        ),  # asterisks removed
        ("punctuation:no_comma", {}, "Intro\nOne, two\nOutro", False),  # the comma is in every variant
    ],
)
def test_loose_tries_the_variants(instruction_id, kwargs, response, loose):
    assert _run(instruction_id, kwargs, response, "strict") is False
    assert _run(instruction_id, kwargs, response, "loose") is loose


def test_blank_variants_are_skipped():
    # Without the skip, the empty "first line removed" variant would pass no_comma.
    assert _run("punctuation:no_comma", {}, "one, two", "loose") is False
    assert _run("punctuation:no_comma", {}, "   \n ", "strict") is False
    assert _run("punctuation:no_comma", {}, "   \n ", "loose") is False


def test_evaluate_requires_every_response():
    inp = {"key": 7, "prompt": "where?", "instruction_id_list": ["punctuation:no_comma"], "kwargs": [{}]}
    with pytest.raises(MissingResponseError, match="prompt key 7"):
        evaluate([inp], {"other": "x"}, "strict")
    with pytest.raises(ValueError, match="mode"):
        evaluate([inp], {"where?": "x"}, "lenient")


# input validation


def _write(tmp_path, rows: list) -> str:
    path = tmp_path / "in.jsonl"
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows), encoding="utf-8")
    return str(path)


GOOD = {
    "key": 1,
    "prompt": "Say hi",
    "instruction_id_list": ["length_constraints:number_words"],
    "kwargs": [{"num_words": 3, "relation": AT_LEAST}],
}


def test_read_inputs_accepts_good_rows_and_ignores_null_kwargs(tmp_path):
    hf_style = dict(GOOD, key=2, kwargs=[{"num_words": 3, "relation": AT_LEAST, "keywords": None, "letter": None}])
    rows = read_inputs(_write(tmp_path, [GOOD, hf_style]))
    assert [r["key"] for r in rows] == [1, 2]
    assert set(rows[0]) == {"key", "prompt", "instruction_id_list", "kwargs"}


@pytest.mark.parametrize(
    "row, field",
    [
        ({k: v for k, v in GOOD.items() if k != "prompt"}, "prompt"),
        (dict(GOOD, key="1"), "key"),
        (dict(GOOD, instruction_id_list="length_constraints:number_words"), "instruction_id_list"),
        (dict(GOOD, instruction_id_list=["length_constraints:word_count"]), "instruction_id_list[0]"),
        (dict(GOOD, kwargs=[]), "kwargs"),
        (dict(GOOD, kwargs=[{"relation": AT_LEAST}]), "kwargs[0].num_words"),
        (dict(GOOD, kwargs=[{"num_words": 3, "relation": "at most"}]), "kwargs[0].relation"),
        (dict(GOOD, kwargs=[{"num_words": -1, "relation": AT_LEAST}]), "kwargs[0].num_words"),
        (dict(GOOD, kwargs=[{"num_words": 3, "relation": AT_LEAST, "extra": 1}]), "kwargs[0].extra"),
        (
            dict(
                GOOD,
                instruction_id_list=["keywords:letter_frequency"],
                kwargs=[{"letter": "ab", "let_frequency": 2, "let_relation": AT_LEAST}],
            ),
            "kwargs[0].letter",
        ),
        (
            dict(GOOD, instruction_id_list=["language:response_language"], kwargs=[{"language": "xx"}]),
            "kwargs[0].language",
        ),
        (
            dict(
                GOOD,
                instruction_id_list=["length_constraints:nth_paragraph_first_word"],
                kwargs=[{"num_paragraphs": 2, "nth_paragraph": 3, "first_word": "so"}],
            ),
            "kwargs[0].nth_paragraph",
        ),
        (
            dict(GOOD, instruction_id_list=["keywords:existence"], kwargs=[{"keywords": ["(unclosed"]}]),
            "kwargs[0].keywords",
        ),
        (dict(GOOD, key=0), "key"),  # the same key twice
    ],
)
def test_read_inputs_names_file_line_and_field(tmp_path, row, field):
    path = _write(tmp_path, [dict(GOOD, key=0), row])
    with pytest.raises(InputError) as err:
        read_inputs(path)
    assert (err.value.path, err.value.line, err.value.field) == (path, 2, field)
    assert f"{path}, line 2, field '{field}'" in str(err.value)


def test_build_checker_refuses_missing_arguments_instead_of_drawing_random_ones():
    with pytest.raises(ArgumentError, match="num_highlights"):
        build_checker("detectable_format:number_highlighted_sections", {})


def test_read_responses(tmp_path):
    path = _write(tmp_path, [{"prompt": "a", "response": "x", "model": "m"}, {"prompt": "b", "response": "y"}])
    assert read_responses(path) == {"a": "x", "b": "y"}
    path = _write(tmp_path, [{"prompt": "a", "response": "x"}, {"prompt": "a", "response": "z"}])
    with pytest.raises(InputError, match="line 2, field 'prompt'"):
        read_responses(path)
    path = _write(tmp_path, [{"prompt": "a"}])
    with pytest.raises(InputError, match="line 1, field 'response'"):
        read_responses(path)


# summary and bootstrap


def _result(prompt: str, follows: list[bool], ids: list[str] | None = None) -> dict:
    ids = ids or ["punctuation:no_comma"] * len(follows)
    return {
        "follow_all_instructions": all(follows),
        "follow_instruction_list": follows,
        "instruction_id_list": ids,
        "prompt": prompt,
        "response": "r",
    }


def test_summarize_counts_and_breakdowns():
    strict = [
        _result("a", [True, False], ["keywords:existence", "punctuation:no_comma"]),
        _result("b", [True], ["keywords:existence"]),
    ]
    loose = [
        _result("a", [True, True], ["keywords:existence", "punctuation:no_comma"]),
        _result("b", [True], ["keywords:existence"]),
    ]
    s = summarize(strict, loose)
    assert (s["prompt_level_strict_acc"], s["inst_level_strict_acc"]) == (0.5, 2 / 3)
    assert (s["prompt_level_loose_acc"], s["inst_level_loose_acc"]) == (1.0, 1.0)
    assert (s["prompts"], s["instructions"]) == (2, 3)
    assert s["strict"]["by_instruction"]["punctuation:no_comma"] == {"correct": 0, "total": 1, "accuracy": 0.0}
    assert s["strict"]["by_category"]["keywords"] == {"correct": 2, "total": 2, "accuracy": 1.0}
    with pytest.raises(ValueError):
        summarize(strict, loose[:1])


def _mixed(n: int, offset: int = 0) -> list[dict]:
    return [_result(f"p{i}", [(i + offset) % 3 != 0, (i + offset) % 2 == 0]) for i in range(n)]


def test_bootstrap_ci_brackets_the_estimate_and_is_seeded():
    strict, loose = _mixed(60), _mixed(60, 1)
    ci = bootstrap_ci(strict, loose, n_resamples=500, seed=3)
    assert ci == bootstrap_ci(strict, loose, n_resamples=500, seed=3)
    assert ci != bootstrap_ci(strict, loose, n_resamples=500, seed=4)
    summary = summarize(strict, loose)
    for metric, band in ci.items():
        assert band["estimate"] == pytest.approx(summary[metric])
        assert band["lo"] < band["estimate"] < band["hi"]
    narrow = bootstrap_ci(strict, loose, n_resamples=500, seed=3, level=0.5)
    assert narrow["inst_level_strict_acc"]["hi"] - narrow["inst_level_strict_acc"]["lo"] < (
        ci["inst_level_strict_acc"]["hi"] - ci["inst_level_strict_acc"]["lo"]
    )
    perfect = [_result(f"p{i}", [True]) for i in range(10)]
    assert bootstrap_ci(perfect, perfect)["prompt_level_loose_acc"] == {"estimate": 1.0, "lo": 1.0, "hi": 1.0}


def test_bootstrap_diff_is_paired():
    a_strict, a_loose = _mixed(60), _mixed(60, 1)
    zero = bootstrap_diff(a_strict, a_loose, a_strict, a_loose, n_resamples=200)
    assert all(band == {"estimate": 0.0, "lo": 0.0, "hi": 0.0} for band in zero.values())
    b_strict, b_loose = _mixed(60, 2), _mixed(60, 2)
    diff = bootstrap_diff(a_strict, a_loose, b_strict, b_loose, n_resamples=200, seed=1)
    shuffled = bootstrap_diff(a_strict, a_loose, b_strict[::-1], b_loose[::-1], n_resamples=200, seed=1)
    assert diff == shuffled  # b is matched to a by prompt, whatever its order
    summary_a, summary_b = summarize(a_strict, a_loose), summarize(b_strict, b_loose)
    for metric, band in diff.items():
        assert band["estimate"] == pytest.approx(summary_a[metric] - summary_b[metric])
        assert band["lo"] <= band["estimate"] <= band["hi"]
    all_pass = [_result(f"p{i}", [True]) for i in range(20)]
    all_fail = [_result(f"p{i}", [False]) for i in range(20)]
    assert bootstrap_diff(all_pass, all_pass, all_fail, all_fail)["inst_level_strict_acc"] == {
        "estimate": 1.0,
        "lo": 1.0,
        "hi": 1.0,
    }
    with pytest.raises(ValueError, match="same prompts"):
        bootstrap_diff(a_strict, a_loose, b_strict[:-1], b_loose[:-1])
