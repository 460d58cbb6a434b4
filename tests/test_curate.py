"""The curate stage on hand-written rows in the openbmb/UltraFeedback raw schema (and binarized ones)."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import polars as pl
import pytest

from orpo.curate import curate
from orpo.curate.drops import REASONS
from orpo.io import InputError

# ---------------------------------------------------------------- fixture rows (raw schema)

NA = "N/A"


def completion(
    model: str,
    response: str,
    overall: float,
    ratings=("4", "4", "4", "4"),
    system: str = "You are a helpful assistant.",
) -> dict:
    """One completion as UltraFeedback stores it: ratings are strings, in the order
    instruction_following, honesty, truthfulness, helpfulness."""
    ins, hon, tru, hel = ratings
    return {
        "model": model,
        "principle": "helpfulness",
        "custom_system_prompt": system,
        "response": response,
        "annotations": {
            "instruction_following": {"Rating": ins, "Rationale": "Follows the task."},
            "honesty": {"Rating": hon, "Rationale": "Confident and correct."},
            "truthfulness": {
                "Type": ["0"],
                "Rationale": "No hallucination.",
                "Rating": tru,
                "Rationale For Rating": "Accurate.",
            },
            "helpfulness": {
                "Type": ["1", "2"],
                "Rationale": "Useful.",
                "Rating": hel,
                "Rationale For Rating": "Helpful.",
            },
        },
        "critique": "Fine answer.",
        "overall_score": overall,
        "fine-grained_score": 4.0,
    }


def raw_row(instruction: str, completions: list[dict], source: str = "evol_instruct", id: str | None = None) -> dict:
    row = {
        "source": source,
        "instruction": instruction,
        "models": [c["model"] for c in completions],
        "correct_answers": ["None"],
        "incorrect_answers": ["None"],
        "completions": completions,
    }
    if id is not None:
        row["id"] = id
    return row


def two(instruction: str, good: str, bad: str, id: str | None = None, source: str = "evol_instruct") -> dict:
    """A row whose pair is forced whatever the seed or recipe: 2 completions, distinct scores."""
    return raw_row(
        instruction,
        [completion("m-good", good, 8.0, ("5", "5", "5", "5")), completion("m-bad", bad, 3.0, ("2", "2", "2", "2"))],
        source=source,
        id=id,
    )


# h4 row: chosen = B (highest overall_score 8.5); rejected = a seeded pick among [A, C, D].
# pick = int(sha256("{seed}:rejected:uf-h4-1")[:8 bytes]) % 3 -> seed 0: 2 (D), seed 1: 0 (A).
H4_ROW = raw_row(
    "Explain photosynthesis in one sentence.",
    [
        completion("model-a", "Plants eat sunlight.", 6.0),
        completion("model-b", "Plants turn light, water and CO2 into sugar and oxygen.", 8.5),
        completion("model-c", "It is a process in plants.", 7.0),
        completion("model-d", "Photosynthesis is when animals breathe.", 3.0),
    ],
    id="uf-h4-1",
)
# h4 tie: A and B share the best score 9.0 -> chosen A (the first); rejected picked among [B, C]:
# pick(...) % 2 -> seed 0: 1 (C), seed 1: 0 (B, tied at 9.0: H4 keeps ties).
H4_TIE = raw_row(
    "Name a prime number.",
    [completion("model-a", "Seven.", 9.0), completion("model-b", "Eleven.", 9.0), completion("model-c", "Nine.", 5.0)],
    id="uf-h4-tie",
)
# argilla row: means ignoring N/A: A (5,NA,5,NA) = 5.0, B (4,5,5,5) = 4.75, C all N/A = no score,
# D (2,3,3,2) = 2.5. chosen = A although B and C have the higher overall_score; rejected picked among
# the strictly lower [B, D]: pick(...) % 2 -> seed 0: 0 (B), seed 1: 1 (D). Were N/A counted as 0, A
# would be 2.5 and B the chosen one.
ARG_ROW = raw_row(
    "Give a synonym for happy.",
    [
        completion("model-a", "Joyful.", 4.0, ("5", NA, "5", NA)),
        completion("model-b", "Glad, or cheerful.", 9.0, ("4", "5", "5", "5")),
        completion("model-c", "Sad.", 10.0, (NA, NA, NA, NA)),
        completion("model-d", "Happy is happy.", 6.0, ("2", "3", "3", "2")),
    ],
    id="uf-arg-1",
)


def pick(seed: int, row_id: str, n: int) -> int:
    """The documented pick rule, restated."""
    return int.from_bytes(hashlib.sha256(f"{seed}:rejected:{row_id}".encode()).digest()[:8], "big") % n


def test_documented_pick_values():
    # The hand-derived indices the recipe tests below rely on.
    assert [pick(0, "uf-h4-1", 3), pick(1, "uf-h4-1", 3)] == [2, 0]
    assert [pick(0, "uf-h4-tie", 2), pick(1, "uf-h4-tie", 2)] == [1, 0]
    assert [pick(0, "uf-arg-1", 2), pick(1, "uf-arg-1", 2)] == [0, 1]


# ---------------------------------------------------------------- helpers


def write_jsonl(path: Path, rows: list) -> str:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows), encoding="utf-8")
    return str(path)


def run(
    tmp_path: Path, rows: list, name: str = "run", tokenizer=None, eval_prompts=None, **settings
) -> tuple[dict, list[dict], list[dict]]:
    src = write_jsonl(tmp_path / f"{name}.jsonl", rows)
    m = curate([src], str(tmp_path / name), settings, tokenizer=tokenizer, eval_prompts=eval_prompts)
    train = pl.read_parquet(tmp_path / name / "train.parquet").to_dicts()
    val = pl.read_parquet(tmp_path / name / "validation.parquet").to_dicts()
    assert m["input_rows"] == m["output_rows"]["total"] + sum(d["count"] for d in m["dropped"].values())
    assert json.loads((tmp_path / name / "manifest.json").read_text()) == m
    return m, train, val


def all_rows(train, val) -> dict[str, dict]:
    return {r["id"]: r for r in train + val}


def counts(m: dict) -> dict[str, int]:
    return {k: v["count"] for k, v in m["dropped"].items() if v["count"]}


# ---------------------------------------------------------------- recipes


@pytest.mark.parametrize(
    "seed,rejected,score", [(0, "Photosynthesis is when animals breathe.", 3.0), (1, "Plants eat sunlight.", 6.0)]
)
def test_h4_chosen_is_best_overall_rejected_is_seeded_other(tmp_path, seed, rejected, score):
    m, train, val = run(tmp_path, [H4_ROW], seed=seed)
    (r,) = train + val
    assert r["chosen"] == "Plants turn light, water and CO2 into sugar and oxygen."
    assert r["rejected"] == rejected
    assert (r["score_chosen"], r["score_rejected"]) == (8.5, score)
    assert r["prompt"] == [{"role": "user", "content": "Explain photosynthesis in one sentence."}]
    assert r["id"] == "uf-h4-1" and r["source"] == "evol_instruct"
    assert m["recipe"] == "h4" and m["seed"] == seed


@pytest.mark.parametrize("seed,rejected,score", [(0, "Nine.", 5.0), (1, "Eleven.", 9.0)])
def test_h4_ties_first_best_is_chosen_and_tied_rejected_is_kept(tmp_path, seed, rejected, score):
    m, train, val = run(tmp_path, [H4_TIE], seed=seed)
    (r,) = train + val
    assert (r["chosen"], r["rejected"], r["score_chosen"], r["score_rejected"]) == ("Seven.", rejected, 9.0, score)
    assert counts(m) == {}


def test_h4_rows_with_fewer_than_two_completions_are_dropped(tmp_path):
    rows = [
        raw_row("Only one answer here.", [completion("m", "Just me.", 9.0)], id="one"),
        raw_row("No answers at all.", [], id="none"),
        two("A fine question?", "Good.", "Bad.", id="ok"),
    ]
    m, train, val = run(tmp_path, rows)
    assert counts(m) == {"too_few_completions": 2}
    assert m["dropped"]["too_few_completions"]["examples"] == ["one", "none"]
    assert set(all_rows(train, val)) == {"ok"}


@pytest.mark.parametrize("seed,rejected,score", [(0, "Glad, or cheerful.", 4.75), (1, "Happy is happy.", 2.5)])
def test_argilla_mean_rating_ignores_na_and_picks_strictly_lower(tmp_path, seed, rejected, score):
    _, train, val = run(tmp_path, [ARG_ROW], recipe="argilla_clean", seed=seed)
    (r,) = train + val
    assert (r["chosen"], r["rejected"]) == ("Joyful.", rejected)
    assert (r["score_chosen"], r["score_rejected"]) == (5.0, score)


def test_argilla_all_na_completion_never_chosen_or_rejected(tmp_path):
    # C is all N/A (and has the best overall_score): over 8 seeds it is never picked; only B or D are.
    rejected = set()
    for seed in range(8):
        _, train, val = run(tmp_path, [ARG_ROW], name=f"s{seed}", recipe="argilla_clean", seed=seed)
        (r,) = train + val
        assert r["chosen"] == "Joyful."
        rejected.add(r["rejected"])
    assert rejected == {"Glad, or cheerful.", "Happy is happy."}


def test_argilla_ties_and_too_few(tmp_path):
    rows = [
        # every scored completion shares the best mean 4.0 (B: (5+3+4+4)/4): a tie, dropped
        raw_row(
            "Tie row.",
            [
                completion("a", "One.", 9.0, ("4", "4", "4", "4")),
                completion("b", "Two.", 2.0, ("5", "3", "4", "4")),
                completion("c", "Three.", 1.0, (NA, NA, NA, NA)),
            ],
            id="tie",
        ),
        # best mean 4.5 shared by A and B, C lower: kept; chosen = A (first best), rejected = C (only lower)
        raw_row(
            "Shared best row.",
            [
                completion("a", "Alpha.", 1.0, ("5", "4", NA, NA)),
                completion("b", "Beta.", 1.0, ("4", "5", "5", "4")),
                completion("c", "Gamma.", 9.0, ("1", "1", "1", "1")),
            ],
            id="shared",
        ),
        # only one completion has a score: too few
        raw_row(
            "Lonely row.",
            [
                completion("a", "Scored.", 5.0, ("3", "3", "3", "3")),
                completion("b", "Unscored.", 9.0, (NA, NA, NA, NA)),
            ],
            id="few",
        ),
    ]
    m, train, val = run(tmp_path, rows, recipe="argilla_clean")
    assert counts(m) == {"tie": 1, "too_few_completions": 1}
    assert m["dropped"]["tie"]["examples"] == ["tie"]
    (r,) = train + val
    assert (r["id"], r["chosen"], r["rejected"], r["score_chosen"], r["score_rejected"]) == (
        "shared",
        "Alpha.",
        "Gamma.",
        4.5,
        1.0,
    )


def test_h4_does_not_read_annotations_and_argilla_does_not_read_overall_score(tmp_path):
    no_ann = two("Q1?", "Good.", "Bad.", id="no-ann")
    for c in no_ann["completions"]:
        del c["annotations"]
    no_overall = raw_row(
        "Q2?",
        [completion("a", "Up.", 0, ("5", "5", "5", "5")), completion("b", "Down.", 0, ("1", "1", "1", "1"))],
        id="no-overall",
    )
    for c in no_overall["completions"]:
        del c["overall_score"]
    _, train, val = run(tmp_path, [no_ann], name="h4")
    assert [r["id"] for r in train + val] == ["no-ann"]
    _, train, val = run(tmp_path, [no_overall], name="arg", recipe="argilla_clean")
    assert [(r["chosen"], r["rejected"]) for r in train + val] == [("Up.", "Down.")]


# ---------------------------------------------------------------- TruthfulQA


def tqa_rows():
    return [
        two(
            "What happens if you crack your knuckles a lot?",
            "Nothing much.",
            "Arthritis.",
            id="tqa-src",
            source="truthful_qa",
        ),
        two(
            "What is the capital of France?", "Paris.", "Lyon.", id="tqa-q", source="sharegpt"
        ),  # a TruthfulQA question
        two("Write a haiku about rain.", "Soft rain on the roof.", "Rain.", id="clean"),
    ]


def test_h4_keeps_truthfulqa_unless_asked(tmp_path):
    m, train, val = run(tmp_path, tqa_rows(), name="keep")
    assert set(all_rows(train, val)) == {"tqa-src", "tqa-q", "clean"}
    assert m["truthfulqa"]["drop_source"] is False
    m, train, val = run(tmp_path, tqa_rows(), name="drop", drop_truthfulqa=True)
    assert counts(m) == {"truthfulqa_source": 1} and set(all_rows(train, val)) == {"tqa-q", "clean"}


def test_argilla_drops_truthfulqa_source_and_questions(tmp_path):
    questions = tmp_path / "tqa.jsonl"
    write_jsonl(questions, [{"question": "What is the capital of France?  "}, {"question": "Can pigs fly?"}])
    m, train, val = run(tmp_path, tqa_rows(), name="with", recipe="argilla_clean", truthfulqa_questions=str(questions))
    assert counts(m) == {"truthfulqa_source": 1, "truthfulqa_question": 1}
    assert m["dropped"]["truthfulqa_question"]["examples"] == ["tqa-q"]
    assert m["truthfulqa"] == {
        "drop_source": True,
        "questions": str(questions),
        "question_count": 2,
        "question_filter": "applied",
    }
    assert set(all_rows(train, val)) == {"clean"}
    # no question list: the second filter is skipped, and the manifest says so
    m, train, val = run(tmp_path, tqa_rows(), name="without", recipe="argilla_clean")
    assert counts(m) == {"truthfulqa_source": 1}
    assert m["truthfulqa"]["question_filter"].startswith("skipped")
    assert set(all_rows(train, val)) == {"tqa-q", "clean"}


def test_truthfulqa_question_list_as_text_file(tmp_path):
    questions = tmp_path / "tqa.txt"
    questions.write_text("Can pigs fly?\nWhat is the capital of France?\n", encoding="utf-8")
    m, _, _ = run(tmp_path, tqa_rows(), truthfulqa_questions=str(questions))
    assert counts(m) == {"truthfulqa_question": 1}


# ---------------------------------------------------------------- common filters


def test_empty_identical_and_duplicate_filters(tmp_path):
    rows = [
        two("Empty chosen?", "   \n", "Bad.", id="empty-c"),
        two("Empty rejected?", "Good.", "", id="empty-r"),
        two("Same twice?", "Same text.", "Same text.", id="ident"),
        two("Repeated prompt.", "First good.", "First bad.", id="dup-1"),
        two("Repeated prompt.", "Second good.", "Second bad.", id="dup-2"),
        two("Repeated prompt.", "Third good.", "Third bad.", id="dup-3"),
        two("Repeated prompt ", "Trailing space differs.", "So not a duplicate.", id="near"),
    ]
    m, train, val = run(tmp_path, rows)
    assert counts(m) == {"empty_response": 2, "identical": 1, "duplicate_prompt": 2}
    assert m["dropped"]["empty_response"]["examples"] == ["empty-c", "empty-r"]
    assert m["dropped"]["duplicate_prompt"]["examples"] == ["dup-2", "dup-3"]
    kept = all_rows(train, val)
    assert set(kept) == {"dup-1", "near"} and kept["dup-1"]["chosen"] == "First good."


def test_duplicate_keeps_first_surviving_row(tmp_path):
    # the first copy is dropped as empty, so the second copy is the first kept one
    rows = [
        two("Dup?", " ", "Bad.", id="a"),
        two("Dup?", "Good.", "Bad.", id="b"),
        two("Dup?", "Good 2.", "Bad 2.", id="c"),
    ]
    m, train, val = run(tmp_path, rows)
    assert counts(m) == {"empty_response": 1, "duplicate_prompt": 1}
    assert set(all_rows(train, val)) == {"b"}


def length_rows():
    return [
        two("one two three four five six", "ok", "fine", id="long-prompt"),  # 6 prompt words
        two("one two three", "a b c d e f g h i j", "k", id="long-pair"),  # 3 + 10 = 13
        two("one two three", "a b c d e f g h i", "k", id="fits"),  # 3 + 9 = 12
        two("Hi, you, there!", "Yes.", "No.", id="punct"),  # 3 words; 6 tokens when punctuation splits
    ]


def test_length_filters_with_whitespace_words(tmp_path):
    m, train, val = run(tmp_path, length_rows(), max_prompt_tokens=5, max_pair_tokens=12)
    assert counts(m) == {"prompt_too_long": 1, "pair_too_long": 1}
    assert m["dropped"]["prompt_too_long"]["examples"] == ["long-prompt"]
    assert m["dropped"]["pair_too_long"]["examples"] == ["long-pair"]
    assert set(all_rows(train, val)) == {"fits", "punct"}
    assert m["token_counter"]["kind"] == "whitespace"


def test_length_filters_with_a_tokenizer(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel({"[UNK]": 0}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()  # splits punctuation off words
    path = tmp_path / "tokenizer.json"
    tok.save(str(path))
    m, _, _ = run(tmp_path, length_rows(), tokenizer=str(path), max_prompt_tokens=5, max_pair_tokens=12)
    # "Hi, you, there!" is 6 tokens now (Hi , you , there !): over the prompt limit too
    assert counts(m) == {"prompt_too_long": 2, "pair_too_long": 1}
    assert m["dropped"]["prompt_too_long"]["examples"] == ["long-prompt", "punct"]
    assert m["token_counter"]["kind"] == "tokenizer" and m["token_counter"]["path"] == str(path)
    assert m["token_counter"]["sha256"] == hashlib.sha256(path.read_bytes()).hexdigest()


def test_decontamination_by_word_ngrams(tmp_path):
    evals = write_jsonl(
        tmp_path / "eval.jsonl",
        [
            {
                "key": 1,
                "prompt": "Write a short poem about the sea and the wind at night.",
                "instruction_id_list": [],
                "kwargs": [],
            },
            {"key": 2, "prompt": "Name three colors", "instruction_id_list": [], "kwargs": []},
            {"key": 3, "prompt": "List five fruits that are red in color", "instruction_id_list": [], "kwargs": []},
        ],
    )
    rows = [
        # 4-grams: write a short poem / a short poem about / short poem about the / poem about the sea /
        # about the sea please -> 4 of 5 in eval 1 (0.8 >= 0.5): dropped
        two("Write a short poem about the sea, please.", "Waves.", "Sea.", id="high"),
        # 4 grams, 2 shared with eval 1 (write a short poem, a short poem about): exactly 0.5, dropped
        two("Write a short poem about my dogs", "Woof.", "Dog.", id="half"),
        # 7 grams, 1 shared (a short poem about): 1/7, kept
        two("Tell me a short poem about cats and dogs today", "Meow.", "Cat.", id="low"),
        # 6 grams: short poem about the / poem about the sea / about the sea list / the sea list five /
        # sea list five fruits / list five fruits that -> 2 in eval 1, 1 in eval 3: 2/6 with either
        # one prompt, kept (the union of eval prompts would reach 3/6 = 0.5)
        two("short poem about the sea list five fruits that", "Mixed.", "Mix.", id="split"),
        # shorter than n = 4 words: only an exact word match counts
        two("NAME three colors!", "Red.", "Blue.", id="short-exact"),
        two("the sea", "Blue.", "Wet.", id="short-other"),
    ]
    m, train, val = run(tmp_path, rows, eval_prompts=evals, decontam_ngram=4, decontam_threshold=0.5)
    assert counts(m) == {"contaminated": 3}
    assert m["dropped"]["contaminated"]["examples"] == ["high", "half", "short-exact"]
    assert set(all_rows(train, val)) == {"low", "split", "short-other"}
    d = m["decontamination"]
    assert (d["applied"], d["ngram"], d["threshold"], d["eval_prompt_count"], d["dropped"]) == (True, 4, 0.5, 3, 3)


def test_decontamination_skipped_without_eval_prompts(tmp_path):
    m, _, _ = run(tmp_path, [H4_ROW])
    assert m["decontamination"]["applied"] is False and m["decontamination"]["ngram"] == 8


# ---------------------------------------------------------------- split


def test_split_sizes_and_seeded_membership(tmp_path):
    rows = [two(f"Question number {i}?", f"Good {i}.", f"Bad {i}.", id=f"q{i:02d}") for i in range(20)]
    m, train, val = run(tmp_path, rows, validation_fraction=0.25, seed=3)
    assert m["output_rows"] == {"train": 15, "validation": 5, "total": 20}
    ranked = sorted(range(20), key=lambda i: hashlib.sha256(f"3:split:q{i:02d}".encode()).hexdigest())
    assert [r["id"] for r in val] == [f"q{i:02d}" for i in sorted(ranked[:5])]  # input order kept
    assert [r["id"] for r in train] == [f"q{i:02d}" for i in sorted(ranked[5:])]


@pytest.mark.parametrize("n,expected", [(1, (1, 0)), (2, (1, 1)), (3, (2, 1))])
def test_at_least_one_validation_row_from_two_rows(tmp_path, n, expected):
    rows = [two(f"Q{i}?", "Good.", "Bad.", id=f"r{i}") for i in range(n)]
    m, _, _ = run(tmp_path, rows)  # default fraction 0.05
    assert (m["output_rows"]["train"], m["output_rows"]["validation"]) == expected


def test_output_schema_and_empty_output(tmp_path, capsys):
    src = write_jsonl(tmp_path / "in.jsonl", [raw_row("Nothing usable.", [], id="x")])
    with pytest.raises(InputError, match=r"in.jsonl: no training pair left of 1 rows \(dropped: too_few_completions 1\)"):
        curate([src], str(tmp_path / "out"), {})
    assert not (tmp_path / "out").exists()  # no empty folder for render and train to find later
    assert "orpo curate: warning: dropped 1 of 1 rows: too_few_completions 1" in capsys.readouterr().err
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    with pytest.raises(InputError, match="empty.jsonl: no training pair left of 0 rows"):
        curate([str(empty)], str(tmp_path / "out"), {})
    src = write_jsonl(tmp_path / "one.jsonl", [two("Tell me a joke.", "Why did the chicken cross the road?", "No.")])
    m = curate([src], str(tmp_path / "out"), {"validation_fraction": 0.0})
    assert m["output_rows"]["total"] == 1
    for name in ("train", "validation"):
        schema = pl.read_parquet(tmp_path / "out" / f"{name}.parquet").schema
        assert dict(schema) == {
            "id": pl.String,
            "prompt": pl.List(pl.Struct({"role": pl.String, "content": pl.String})),
            "chosen": pl.String,
            "rejected": pl.String,
            "source": pl.String,
            "score_chosen": pl.Float64,
            "score_rejected": pl.Float64,
        }
    assert set(m["dropped"]) == set(REASONS)


def test_custom_system_prompt_is_not_injected_and_ids_are_derived(tmp_path):
    row = two("Tell me a joke.", "Why did the chicken cross the road?", "No.")
    row["completions"][0]["custom_system_prompt"] = "You are a comedian."
    _, train, val = run(tmp_path, [row])
    (r,) = train + val
    assert r["prompt"] == [{"role": "user", "content": "Tell me a joke."}]
    assert r["id"] == hashlib.sha256(b"Tell me a joke.").hexdigest()


# ---------------------------------------------------------------- errors


def bad_file(tmp_path: Path) -> str:
    missing_instruction = two("x", "Good.", "Bad.", id="no-instr")
    del missing_instruction["instruction"]
    wrong_type = two("Wrong type?", "Good.", "Bad.", id="wrong")
    wrong_type["completions"][1]["response"] = 42
    path = tmp_path / "bad.jsonl"
    lines = [
        json.dumps(two("Fine one?", "Good.", "Bad.", id="fine-1")).encode(),
        b'{"source": "evol_instruct", "instruction": ',  # line 2: bad JSON
        json.dumps(missing_instruction).encode(),  # line 3: missing field
        b'{"instruction": "caf\xe9"}',  # line 4: not UTF-8
        json.dumps(wrong_type).encode(),  # line 5: wrong type
        b"",  # blank: not a row
        json.dumps(two("Fine two?", "Good.", "Bad.", id="fine-2")).encode(),
    ]
    path.write_bytes(b"\n".join(lines) + b"\n")
    return str(path)


def test_on_error_raise_names_file_line_and_field(tmp_path):
    src = bad_file(tmp_path)
    with pytest.raises(InputError) as e:
        curate([src], str(tmp_path / "out"), {})
    assert (e.value.path, e.value.line) == (src, 2) and "not valid JSON" in str(e.value)
    assert not (tmp_path / "out").exists()

    lines = Path(src).read_bytes().split(b"\n")
    for bad_line, field in ((3, "instruction"), (4, None), (5, "completions[1].response")):
        only = tmp_path / f"only{bad_line}.jsonl"  # a good row, then the bad one as line 2
        only.write_bytes(b"\n".join([lines[0], lines[bad_line - 1]]) + b"\n")
        with pytest.raises(InputError) as e:
            curate([str(only)], str(tmp_path / "out"), {})
        assert (e.value.path, e.value.line, e.value.field) == (str(only), 2, field)
        assert f"{only}, line 2" in str(e.value)
        if field:
            assert f"field '{field}'" in str(e.value)


def test_bad_rating_is_a_located_field_error(tmp_path):
    row = two("Rated?", "Good.", "Bad.")
    row["completions"][0]["annotations"]["honesty"]["Rating"] = "five"
    src = write_jsonl(tmp_path / "r.jsonl", [row])
    with pytest.raises(InputError, match=r"line 1, field 'completions\[0\]\.annotations\.honesty\.Rating'"):
        curate([src], str(tmp_path / "out"), {"recipe": "argilla_clean"})


def test_on_error_skip_counts_malformed_rows(tmp_path):
    src = bad_file(tmp_path)
    m = curate([src], str(tmp_path / "out"), {"on_error": "skip"})
    assert m["input_rows"] == 6  # the blank line is not a row
    assert counts(m) == {"malformed": 4}
    assert m["dropped"]["malformed"]["examples"] == [f"{src}:2", f"{src}:3", f"{src}:4", f"{src}:5"]
    assert m["output_rows"]["total"] == 2


def test_hub_id_offline_is_a_clear_error(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))  # an empty cache
    with pytest.raises(InputError) as e:
        curate(["openbmb/UltraFeedback"], str(tmp_path / "out"), {})
    assert "openbmb/UltraFeedback" in str(e.value) and "offline" in str(e.value)


def test_missing_local_input_is_an_error(tmp_path):
    with pytest.raises(InputError, match="no such file"):
        curate([str(tmp_path / "data" / "missing.jsonl")], str(tmp_path / "out"), {})


def test_bad_settings_are_refused(tmp_path):
    src = write_jsonl(tmp_path / "in.jsonl", [H4_ROW])
    with pytest.raises(ValueError, match=r"unknown key curate.recpie \(allowed here: "):
        curate([src], str(tmp_path / "out"), {"recpie": "h4"})
    with pytest.raises(ValueError, match="curate.recipe: 'best' is not one of"):
        curate([src], str(tmp_path / "out"), {"recipe": "best"})


# ---------------------------------------------------------------- binarized passthrough


def test_binarized_string_and_message_forms(tmp_path):
    rows = [
        {
            "prompt": "What is 2+2?",
            "chosen": "4",
            "rejected": "5",
            "score_chosen": 9,
            "score_rejected": 2,
            "source": "math",
            "id": "s1",
        },
        {  # HuggingFaceH4/ultrafeedback_binarized: chosen/rejected are the whole conversation
            "prompt": "Say hello.",
            "prompt_id": "h4-1",
            "chosen": [{"role": "user", "content": "Say hello."}, {"role": "assistant", "content": "Hello!"}],
            "rejected": [{"role": "user", "content": "Say hello."}, {"role": "assistant", "content": "Bye."}],
            "messages": [{"role": "user", "content": "Say hello."}, {"role": "assistant", "content": "Hello!"}],
            "score_chosen": 8.0,
            "score_rejected": 4.0,
        },
        {  # multi-turn: the prompt is every turn before the last assistant turn
            "prompt": "And now?",
            "prompt_id": "h4-2",
            "chosen": [
                {"role": "system", "content": "Be brief."},
                {"role": "user", "content": "Hi"},
                {"role": "assistant", "content": "Hi."},
                {"role": "user", "content": "And now?"},
                {"role": "assistant", "content": "Now this."},
            ],
            "rejected": [
                {"role": "system", "content": "Be brief."},
                {"role": "user", "content": "Hi"},
                {"role": "assistant", "content": "Hi."},
                {"role": "user", "content": "And now?"},
                {"role": "assistant", "content": "Whatever."},
            ],
        },
        {
            "prompt": [{"role": "user", "content": "Pick one."}],
            "chosen": "A",
            "rejected": "B",
        },  # message-list prompt, no id
    ]
    src = write_jsonl(tmp_path / "bin.jsonl", rows)
    m = curate([src], str(tmp_path / "out"), {"recipe": "binarized"})
    got = {
        r["id"]: r
        for name in ("train", "validation")
        for r in pl.read_parquet(tmp_path / "out" / f"{name}.parquet").to_dicts()
    }
    assert got["s1"] == {
        "id": "s1",
        "prompt": [{"role": "user", "content": "What is 2+2?"}],
        "chosen": "4",
        "rejected": "5",
        "source": "math",
        "score_chosen": 9.0,
        "score_rejected": 2.0,
    }
    assert got["h4-1"] == {
        "id": "h4-1",
        "prompt": [{"role": "user", "content": "Say hello."}],
        "chosen": "Hello!",
        "rejected": "Bye.",
        "source": src,
        "score_chosen": 8.0,
        "score_rejected": 4.0,
    }
    assert got["h4-2"]["prompt"] == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hi."},
        {"role": "user", "content": "And now?"},
    ]
    assert (got["h4-2"]["chosen"], got["h4-2"]["rejected"], got["h4-2"]["score_chosen"]) == (
        "Now this.",
        "Whatever.",
        None,
    )
    derived = hashlib.sha256(json.dumps([["user", "Pick one."]]).encode()).hexdigest()
    assert got[derived]["prompt"] == [{"role": "user", "content": "Pick one."}]
    assert m["forms"] == {"raw": 0, "binarized": 4} and m["output_rows"]["total"] == 4


def test_binarized_rows_are_auto_detected_next_to_raw_rows(tmp_path):
    rows = [H4_ROW, {"prompt": "Binarized?", "chosen": "Yes.", "rejected": "No.", "id": "b1"}]
    m, train, val = run(tmp_path, rows)
    assert m["forms"] == {"raw": 1, "binarized": 1}
    assert all_rows(train, val)["b1"]["chosen"] == "Yes."


def test_binarized_recipe_refuses_raw_rows_and_checks_conversations(tmp_path):
    src = write_jsonl(tmp_path / "raw.jsonl", [H4_ROW])
    with pytest.raises(InputError, match="field 'completions'"):
        curate([src], str(tmp_path / "out"), {"recipe": "binarized"})
    bad = {
        "chosen": [{"role": "user", "content": "A"}, {"role": "assistant", "content": "x"}],
        "rejected": [{"role": "user", "content": "B"}, {"role": "assistant", "content": "y"}],
    }
    src = write_jsonl(tmp_path / "bad.jsonl", [bad])
    with pytest.raises(InputError, match="field 'rejected'.*differ"):
        curate([src], str(tmp_path / "out"), {})


# ---------------------------------------------------------------- inputs and determinism


def test_folder_of_json_and_parquet(tmp_path):
    folder = tmp_path / "raw"
    folder.mkdir()
    (folder / "a.json").write_text(json.dumps([H4_ROW, "not an object"]), encoding="utf-8")
    pl.DataFrame([H4_TIE]).write_parquet(folder / "b.parquet")
    (folder / ".hidden.jsonl").write_text("garbage\n", encoding="utf-8")
    m = curate([str(folder)], str(tmp_path / "out"), {"on_error": "skip", "seed": 1})
    assert m["input_rows"] == 3 and counts(m) == {"malformed": 1}
    assert m["dropped"]["malformed"]["examples"] == [f"{folder / 'a.json'}#2"]
    assert [f["path"] for f in m["source"][0]["files"]] == [str(folder / "a.json"), str(folder / "b.parquet")]
    got = {
        r["id"]: r
        for n in ("train", "validation")
        for r in pl.read_parquet(tmp_path / "out" / f"{n}.parquet").to_dicts()
    }
    assert got["uf-h4-tie"]["rejected"] == "Eleven." and got["uf-h4-1"]["rejected"] == "Plants eat sunlight."


def test_same_seed_same_bytes_other_seed_differs(tmp_path):
    rows = [H4_ROW, H4_TIE, ARG_ROW] + [two(f"Filler {i}?", "Good.", "Bad.", id=f"f{i}") for i in range(5)]
    src = write_jsonl(tmp_path / "in.jsonl", rows)
    files = ("train.parquet", "validation.parquet", "manifest.json")

    def output(name: str, seed: int) -> list[bytes]:
        curate([src], str(tmp_path / name), {"seed": seed, "validation_fraction": 0.25})
        return [(tmp_path / name / f).read_bytes() for f in files]

    first, again, other = output("a", 0), output("b", 0), output("c", 1)
    assert first == again
    assert first[0] != other[0] or first[1] != other[1]  # H4_ROW's rejected differs between seeds 0 and 1
    assert first[2] != other[2]
