"""SPIN pairs on the tiny embedded stack: contract, the model's own answers as rejected, drops, forms, errors,
determinism, the iteration loop (pairs -> render -> train -> next iteration's generator)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import polars as pl
import pytest

from orpo.curate.write import SCHEMA
from orpo.generation import generate_batched, load_generator
from orpo.io import InputError, sha256_file
from orpo.render.pairs import render_pairs
from orpo.spin import DEFAULTS, spin_pairs
from orpo.spin.drops import REASONS
from orpo.train.settings import train_settings
from orpo.train.trainer import train

from conftest import TINY_TRAIN

GEN = {"max_tokens": 24, "batch_size": 8}
FILES = ["complete.json", "manifest.json", "train.parquet", "validation.parquet"]


def write_jsonl(path: Path, rows: list) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def read_pairs(out: Path) -> pl.DataFrame:
    frames = [pl.read_parquet(out / f"{split}.parquet") for split in ("train", "validation")]
    assert all(f.schema == pl.Schema(SCHEMA) for f in frames)
    return pl.concat(frames)


def greedy(base: Path, prompts: list[list[dict]], adapter: Path | None = None, render: dict | None = None) -> list[str]:
    """An independent orpo.generation call with the stage's default generation settings."""
    gen = load_generator(base, adapter, render)
    texts, _ = generate_batched(gen, [gen.prompt_ids(p) for p in prompts], {**DEFAULTS, **GEN})
    return texts


def dropped(manifest: dict) -> dict[str, int]:
    return {r: d["count"] for r, d in manifest["dropped"].items() if d["count"]}


@pytest.fixture(scope="module")
def curated_train(tiny_rendered) -> Path:
    """The curate stage's train split: the embedded default's SFT set."""
    return tiny_rendered.parent / "curated" / "train.parquet"


@pytest.fixture(scope="module")
def sft_rows(curated_train) -> list[dict]:
    """The first 12 curated pairs as SFT conversations (messages form, gold = chosen)."""
    return [{"id": r["id"], "messages": r["prompt"] + [{"role": "assistant", "content": r["chosen"]}]}
            for r in pl.read_parquet(curated_train).head(12).to_dicts()]


def test_pairs_follow_the_contract_and_rejected_is_the_models_generation(tiny_base, sft_rows, tmp_path):
    src = write_jsonl(tmp_path / "sft.jsonl", sft_rows)
    out = tmp_path / "out"
    m = spin_pairs([str(src)], tiny_base, None, out, GEN, 1)

    assert sorted(p.name for p in out.iterdir()) == FILES
    assert json.loads((out / "manifest.json").read_text()) == m
    pairs = read_pairs(out)
    assert m["input_rows"] == 12 == m["output_rows"]["total"] + sum(dropped(m).values())
    assert m["output_rows"]["validation"] == 1 and len(pairs) == m["output_rows"]["total"] >= 10
    assert m["iteration"] == 1 and m["generator"]["adapter"] is None and m["forms"]["messages"] == 12
    assert pairs["score_chosen"].null_count() == pairs["score_rejected"].null_count() == len(pairs)
    assert set(pairs["source"]) == {str(src)}

    texts = greedy(tiny_base, [r["messages"][:-1] for r in sft_rows])
    expected = {r["id"]: (r["messages"][:-1], r["messages"][-1]["content"], t) for r, t in zip(sft_rows, texts)}
    for row in pairs.iter_rows(named=True):
        assert (row["prompt"], row["chosen"], row["rejected"]) == expected[row["id"]]
    # The rows not written are exactly those the model answers with the gold (or nothing).
    missing = set(expected) - set(pairs["id"])
    assert missing == {i for i, (_, gold, t) in expected.items() if not t.strip() or t.strip() == gold.strip()}


def test_a_gold_the_model_already_gives_is_dropped(tiny_base, sft_rows, tmp_path):
    prompt = sft_rows[0]["messages"][:-1]
    [answer] = greedy(tiny_base, [prompt])
    assert answer.strip()
    rows = [{"id": "learned", "messages": prompt + [{"role": "assistant", "content": f"  {answer}\n"}]}, sft_rows[1]]
    out = tmp_path / "out"
    m = spin_pairs([str(write_jsonl(tmp_path / "sft.jsonl", rows))], tiny_base, None, out, GEN, 1)
    assert m["dropped"]["generation_equals_gold"] == {"count": 1, "examples": ["learned"]}
    assert dropped(m) == {"generation_equals_gold": 1}
    assert read_pairs(out)["id"].to_list() == [sft_rows[1]["id"]]
    # With nothing left to learn the stage stops and says why, instead of writing empty splits.
    with pytest.raises(ValueError, match=r"left no pairs from 1 input rows; dropped: \{'generation_equals_gold': 1\}"):
        spin_pairs([str(write_jsonl(tmp_path / "one.jsonl", rows[:1]))], tiny_base, None, tmp_path / "none", GEN, 1)
    assert not (tmp_path / "none").exists()


def test_messages_prompt_response_and_curated_pair_forms(tiny_base, sft_rows, curated_train, tmp_path):
    messages = write_jsonl(tmp_path / "chat.jsonl", [{**sft_rows[0], "source": "chat"}, sft_rows[1]])
    pr = [{"prompt": sft_rows[2]["messages"][0]["content"], "response": sft_rows[2]["messages"][1]["content"]},
          {"id": "pr-list", "prompt": sft_rows[3]["messages"][:-1], "response": sft_rows[3]["messages"][-1]["content"]}]
    (tmp_path / "pr.json").write_text(json.dumps(pr))
    curated = pl.read_parquet(curated_train).slice(20, 3)
    curated.write_parquet(tmp_path / "pairs.parquet")
    inputs = [str(messages), str(tmp_path / "pr.json"), str(tmp_path / "pairs.parquet")]
    m = spin_pairs(inputs, tiny_base, None, tmp_path / "out", GEN, 1)

    assert m["forms"] == {"messages": 2, "prompt_response": 2, "pairs": 3}
    assert [s["kind"] for s in m["source"]] == ["jsonl", "json", "parquet"]
    pairs = read_pairs(tmp_path / "out")
    assert m["output_rows"] == {"train": 6, "validation": 1, "total": 7} and len(pairs) == 7
    from orpo.curate.schema import stable_id

    want = [
        (sft_rows[0]["id"], sft_rows[0]["messages"][:-1], sft_rows[0]["messages"][-1]["content"], "chat"),
        (sft_rows[1]["id"], sft_rows[1]["messages"][:-1], sft_rows[1]["messages"][-1]["content"], inputs[0]),
        (stable_id(pr[0]["prompt"]), [{"role": "user", "content": pr[0]["prompt"]}], pr[0]["response"], inputs[1]),
        ("pr-list", pr[1]["prompt"], pr[1]["response"], inputs[1]),
    ] + [(r["id"], r["prompt"], r["chosen"], r["source"]) for r in curated.to_dicts()]
    by_id = {r[0]: r for r in pairs.select("id", "prompt", "chosen", "source", "rejected").rows()}
    assert [by_id[w[0]][:4] for w in want] == want
    # The curated rows' old rejected answers and scores are not carried over: rejected is the model's answer.
    assert [by_id[i][4] for i in curated["id"]] == greedy(tiny_base, curated["prompt"].to_list())
    assert pairs["score_chosen"].null_count() == 7


def test_prompts_render_with_the_render_stages_template(tiny_base, sft_rows, tmp_path):
    chatml = json.loads((tiny_base / "tokenizer_config.json").read_text())["chat_template"]
    override = tmp_path / "system.jinja"
    override.write_text("{{ '<|im_start|>system\\nAnswer in one short sentence.<|im_end|>\\n' }}" + chatml)
    render = {"template": str(override), "template_kwargs": {}}
    src = write_jsonl(tmp_path / "sft.jsonl", sft_rows[:6])
    m = spin_pairs([str(src)], tiny_base, None, tmp_path / "out", GEN, 1, render=render)
    assert m["generator"]["template"]["source"] == f"{override} (override)"
    prompts = [r["messages"][:-1] for r in sft_rows[:6]]
    rejected = dict(read_pairs(tmp_path / "out").select("id", "rejected").rows())
    with_override = dict(zip([r["id"] for r in sft_rows[:6]], greedy(tiny_base, prompts, render=render)))
    assert rejected == {i: with_override[i] for i in rejected} and len(rejected) == 6
    assert list(with_override.values()) != greedy(tiny_base, prompts)


def test_every_drop_is_counted_with_examples(tiny_base, sft_rows, tmp_path):
    a, b = sft_rows[0], sft_rows[1]
    long_words = " ".join(["word"] * 300)
    lines = [
        a,
        '{"messages": [',
        {"id": "bad-field", "messages": [{"role": "user", "content": 5}, {"role": "assistant", "content": "x"}]},
        {"id": "blank", "prompt": "Say something.", "response": "   "},
        {"id": "again", "messages": a["messages"][:-1] + [{"role": "assistant", "content": "Another gold answer."}]},
        {"id": "long-prompt", "prompt": long_words, "response": "Fine."},
        {"id": "long-answer", "prompt": "Write a lot.", "response": long_words},
        b,
        {"id": "third", "prompt": "Tell me about the moon.", "response": "The moon is bright."},
    ]
    src = write_jsonl(tmp_path / "sft.jsonl", lines)
    settings = {**GEN, "on_error": "skip", "max_prompt_tokens": 100, "max_answer_tokens": 150, "limit": 2}
    m = spin_pairs([str(src)], tiny_base, None, tmp_path / "out", settings, 1)

    assert list(m["dropped"]) == list(REASONS)
    assert dropped(m) == {"malformed": 2, "empty_gold": 1, "duplicate_prompt": 1, "prompt_too_long": 1,
                          "answer_too_long": 1, "over_limit": 1}
    assert m["dropped"]["malformed"]["examples"] == [f"{src}:2", f"{src}:3"]
    for reason, example in [("empty_gold", "blank"), ("duplicate_prompt", "again"),
                            ("prompt_too_long", "long-prompt"), ("answer_too_long", "long-answer")]:
        assert m["dropped"][reason]["examples"] == [example]
    kept = set(read_pairs(tmp_path / "out")["id"])
    assert len(kept) == 2 and kept | set(m["dropped"]["over_limit"]["examples"]) == {a["id"], b["id"], "third"}
    assert m["input_rows"] == 9 == m["output_rows"]["total"] + sum(dropped(m).values())
    assert m["generation"]["prompts"] == 2


@pytest.mark.parametrize(
    "bad, line, field, message",
    [
        ('{"messages": [}', 2, None, "not valid JSON"),
        ({"messages": [{"role": "user", "content": "Hi."}, {"role": "assistant", "content": 5}]}, 2,
         "messages[1].content", "expected str, got int"),
        ({"messages": [{"role": "assistant", "content": "Hi."}, {"role": "user", "content": "Hi."}]}, 2,
         "messages", "must end with the assistant turn"),
        ({"prompt": "Hi.", "response": 3}, 2, "response", "expected str"),
        ({"prompt": "Hi."}, 2, "messages", "a row needs"),
        ({"prompt": [{"role": "user"}], "chosen": "a", "rejected": "b"}, 2, "prompt[0].content", "missing"),
    ],
)
def test_malformed_rows_name_file_line_and_field(tiny_base, sft_rows, tmp_path, bad, line, field, message):
    src = write_jsonl(tmp_path / "sft.jsonl", [sft_rows[0], bad])
    with pytest.raises(InputError, match=message) as err:
        spin_pairs([str(src)], tiny_base, None, tmp_path / "out", GEN, 1)
    assert (err.value.path, err.value.line, err.value.field) == (str(src), line, field)
    assert str(err.value).startswith(f"{src}, line {line}")
    assert not (tmp_path / "out").exists()


def test_json_list_rows_are_named_by_row_number(tiny_base, tmp_path):
    src = tmp_path / "sft.json"
    src.write_text(json.dumps([{"prompt": "Hi.", "response": "Hello."}, {"prompt": "Hi.", "response": None}]))
    with pytest.raises(InputError, match=r"sft\.json, field 'response': row 2: missing"):
        spin_pairs([str(src)], tiny_base, None, tmp_path / "out", GEN, 1)


def test_bad_settings_and_iterations_are_refused(tiny_base, sft_rows, tmp_path):
    src = str(write_jsonl(tmp_path / "sft.jsonl", sft_rows[:2]))
    with pytest.raises(ValueError, match=r"unknown key spin.max_token \(allowed here: "):
        spin_pairs([src], tiny_base, None, tmp_path / "out", {"max_token": 3}, 1)
    with pytest.raises(ValueError, match="spin.top_p: 0 is less than or equal to the minimum of 0"):
        spin_pairs([src], tiny_base, None, tmp_path / "out", {"top_p": 0}, 1)
    with pytest.raises(ValueError, match="iteration 2 needs the adapter trained in iteration 1"):
        spin_pairs([src], tiny_base, None, tmp_path / "out", GEN, 2)
    with pytest.raises(ValueError, match="iteration must be an integer >= 1"):
        spin_pairs([src], tiny_base, None, tmp_path / "out", GEN, 0)
    assert not (tmp_path / "out").exists()


def test_same_seed_and_generator_give_identical_bytes(tiny_base, sft_rows, tmp_path):
    src = [str(write_jsonl(tmp_path / "sft.jsonl", sft_rows))]

    def run(name: str, **settings) -> tuple[dict[str, bytes], dict[str, str]]:
        spin_pairs(src, tiny_base, None, tmp_path / name, {**GEN, **settings}, 1)
        files = {f: (tmp_path / name / f).read_bytes() for f in FILES}
        return files, dict(read_pairs(tmp_path / name).select("id", "rejected").rows())

    assert run("greedy-a")[0] == run("greedy-b")[0]
    sampled, rejected = run("sample-a", temperature=1.0, seed=3)
    assert sampled == run("sample-b", temperature=1.0, seed=3)[0]
    _, other = run("sample-c", temperature=1.0, seed=4)
    common = set(rejected) & set(other)
    assert len(common) >= 8 and any(rejected[i] != other[i] for i in common)


def test_spin_pairs_train_and_the_next_iteration_uses_the_adapter(tiny_base, curated_train, tmp_path):
    """The SPIN loop on the embedded default's SFT set: iteration 1 pairs -> render -> ORPO -> iteration 2."""
    settings = {**GEN, "limit": 64}
    m1 = spin_pairs([str(curated_train)], tiny_base, None, tmp_path / "iter1", settings, 1)
    assert m1["output_rows"]["total"] >= 56 and m1["dropped"]["over_limit"]["count"] == m1["input_rows"] - 64

    rendered = render_pairs(tiny_base, tmp_path / "iter1", tmp_path / "rendered",
                            {"max_length": 256, "max_prompt_length": 96})
    assert rendered["output_rows"] == m1["output_rows"]["total"]
    run = tmp_path / "run"
    index = train(tiny_base, tmp_path / "rendered", run, train_settings(TINY_TRAIN))
    assert index["final_step"] == TINY_TRAIN["max_steps"]
    lines = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    losses = [x["loss"] for x in lines if x["split"] == "train"]
    assert len(losses) == TINY_TRAIN["max_steps"] and all(math.isfinite(v) for v in losses)
    val = [x for x in lines if x["split"] == "validation"]
    # ORPO on (gold, own answer) pairs pushes the gold answers' odds up against the model's own.
    assert val[-1]["log_odds"] > val[0]["log_odds"]

    m2 = spin_pairs([str(curated_train)], tiny_base, run, tmp_path / "iter2", settings, 2)
    assert m2["iteration"] == 2 and m2["generator"]["adapter"] == str(run)
    assert m2["generator"]["adapter_sha256"] == sha256_file(run / "adapters.safetensors")
    first = dict(read_pairs(tmp_path / "iter1").select("id", "rejected").rows())
    second = dict(read_pairs(tmp_path / "iter2").select("id", "rejected").rows())
    common = set(first) & set(second)
    # Same prompts (the limit subset does not depend on the iteration), a different generator.
    assert len(common) >= 56
    changed = sum(first[i] != second[i] for i in common)
    assert changed >= len(common) // 2, (changed, len(common))
