"""Bad generate inputs: prompts beyond the model's context, blank prompts and repeated keys, each seen by the user."""

import json

import pytest
from mlx_lm import generate as mlx_generate
from mlx_lm import load

from orpo.eval.generate import generate
from orpo.eval.ifeval.score import evaluate, read_inputs, read_responses
from orpo.generation import load_generator
from orpo.io import InputError

LOWERCASE = {"instruction_id_list": ["change_case:english_lowercase"], "kwargs": [{}]}


def write_prompts(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def prompt_tokens(model, text):
    gen = load_generator(model)
    return len(gen.prompt_ids([{"role": "user", "content": text}]))


def test_a_prompt_longer_than_the_context_is_not_generated_but_counted_and_scored_as_failed(tiny_base, tmp_path,
                                                                                             capfd):
    context = json.loads((tiny_base / "config.json").read_text())["max_position_embeddings"]
    assert context == 96
    long = "Tell me about the dog and the river. " * 40
    assert prompt_tokens(tiny_base, long) > context
    src = write_prompts(tmp_path / "prompts.jsonl", [
        {"key": 1, "prompt": "Tell me about the dog.", **LOWERCASE},
        {"key": 2, "prompt": long, **LOWERCASE},
    ])
    out = tmp_path / "gen.jsonl"
    stats = generate(tiny_base, src, out, {"max_tokens": 8}, label="base")

    rows = [json.loads(x) for x in out.read_text().splitlines()]
    assert [r["key"] for r in rows] == [1, 2]  # the dropped prompt keeps its row: scoring still sees it
    assert rows[0]["dropped"] is None and rows[0]["response"]
    assert rows[1]["response"] == "" and rows[1]["dropped"].startswith("prompt_too_long: ")
    assert "96 positions" in rows[1]["dropped"] and rows[1]["generated_tokens"] == 0
    assert stats["prompts"] == 2 and stats["generated_prompts"] == 1
    assert stats["dropped"]["prompt_too_long"]["count"] == 1
    assert stats["dropped"]["prompt_too_long"]["examples"][0].startswith("key 2 (line 2, ")
    assert stats["context"] == {"positions": 96, "source": "config.json max_position_embeddings"}
    err = capfd.readouterr().err
    assert "generate[base]: warning: 1 of 2 prompts fill the model's context (96 positions" in err
    assert "key 2 (line 2, " in err

    # IFEval keeps it in the denominator, as not followed.
    results = evaluate(read_inputs(src), read_responses(out), "loose")
    assert len(results) == 2 and results[1]["follow_all_instructions"] is False


def test_when_no_prompt_fits_the_context_the_stage_fails_and_writes_nothing(tiny_base, tmp_path):
    long = "Write a short note about the river. " * 40
    src = write_prompts(tmp_path / "prompts.jsonl", [{"key": 1, "prompt": long}, {"key": 2, "prompt": long + "!"}])
    out = tmp_path / "gen.jsonl"
    with pytest.raises(InputError, match=r"none of the 2 prompts fits the model's context \(96 positions"):
        generate(tiny_base, src, out, {"max_tokens": 8}, label="base")
    assert not out.exists()


def test_a_prompt_that_leaves_less_than_max_tokens_generates_only_what_fits(tiny_base, tmp_path, capfd):
    text = "Describe the apple in a few sentences. Do not use any commas in your answer."
    while (n := prompt_tokens(tiny_base, text)) < 88:  # a few positions left: the answer runs into the end
        text += " Please."
    assert n < 96
    src = write_prompts(tmp_path / "prompts.jsonl", [{"key": 7, "prompt": text}])
    out = tmp_path / "gen.jsonl"
    stats = generate(tiny_base, src, out, {"max_tokens": 96}, label="base")

    row = json.loads(out.read_text())
    assert row["prompt_tokens"] == n and row["max_tokens"] == 96 - n and row["dropped"] is None
    assert row["generated_tokens"] <= 96 - n and row["settings"]["max_tokens"] == 96
    assert stats["budget_cut"]["reached"] == int(row["generated_tokens"] == 96 - n)
    assert stats["budget_cut"]["count"] == 1
    assert stats["budget_cut"]["examples"] == [f"key 7 (line 1, {n} tokens -> {96 - n})"]
    assert "1 of 1 prompts leave less than max_tokens 96 in the model's context (96 positions" in capfd.readouterr().err
    model, tok = load(str(tiny_base))  # the same as asking for only what fits
    ids = load_generator(tiny_base).prompt_ids([{"role": "user", "content": text}])
    assert row["response"] == mlx_generate(model, tok, ids, max_tokens=96 - n)


@pytest.mark.parametrize("blank", ["", "   \n\t"])
def test_a_blank_prompt_is_refused_naming_file_line_and_field(tiny_base, tmp_path, blank):
    src = write_prompts(tmp_path / "prompts.jsonl", [{"key": 1, "prompt": "Tell me about the dog."},
                                                     {"key": 2, "prompt": blank}])
    out = tmp_path / "gen.jsonl"
    with pytest.raises(InputError) as e:
        generate(tiny_base, src, out, {"max_tokens": 8}, label="base")
    assert (e.value.path, e.value.line, e.value.field) == (str(src), 2, "prompt")
    assert str(e.value) == f"{src}, line 2, field 'prompt': empty or whitespace only"
    assert not out.exists()


def test_a_repeated_key_is_refused_before_generating_naming_file_line_and_key(tiny_base, tmp_path, capfd):
    src = write_prompts(tmp_path / "prompts.jsonl", [{"key": 1, "prompt": "Tell me about the dog."},
                                                     {"key": 2, "prompt": "Tell me about the cat."},
                                                     {"key": 1, "prompt": "Tell me about the river."}])
    out = tmp_path / "gen.jsonl"
    with pytest.raises(InputError) as e:
        generate(tiny_base, src, out, {"max_tokens": 8}, label="base", limit=2)  # the whole file is checked
    assert (e.value.path, e.value.line, e.value.field) == (str(src), 3, "key")
    assert str(e.value) == f"{src}, line 3, field 'key': duplicate key 1 (first on line 1)"
    assert not out.exists() and "generate[base]:" not in capfd.readouterr().err  # nothing was generated


def test_a_model_that_states_no_context_is_left_unchecked(tiny_base, tmp_path):
    import shutil

    from orpo.generation import context_length

    model = tmp_path / "model"
    shutil.copytree(tiny_base, model)
    config = json.loads((model / "config.json").read_text())
    del config["max_position_embeddings"]
    (model / "config.json").write_text(json.dumps(config))
    assert context_length(model) is None
    config["text_config"] = {"max_position_embeddings": 4096}  # where multimodal configs keep it
    (model / "config.json").write_text(json.dumps(config))
    assert context_length(model) == (4096, "config.json text_config.max_position_embeddings")
    del config["text_config"]
    (model / "config.json").write_text(json.dumps(config))

    src = write_prompts(tmp_path / "prompts.jsonl", [{"key": 1, "prompt": "Tell me about the dog. " * 30}])
    stats = generate(model, src, tmp_path / "gen.jsonl", {"max_tokens": 4}, label="base")
    row = json.loads((tmp_path / "gen.jsonl").read_text())
    assert row["dropped"] is None and row["max_tokens"] == 4 and row["prompt_tokens"] > 96
    assert stats["context"] == {"positions": None, "source": None} and stats["generated_prompts"] == 1


def test_an_empty_prompts_file_is_refused(tiny_base, tmp_path):
    src = tmp_path / "prompts.jsonl"
    src.write_text("\n")
    with pytest.raises(InputError, match="no prompts"):
        generate(tiny_base, src, tmp_path / "gen.jsonl", {"max_tokens": 4}, label="base")
