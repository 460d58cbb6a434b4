"""orpo.render.pairs: preference rows -> token ids, seam, mask, length handling, the stage's artifact."""

from __future__ import annotations

import hashlib
import importlib.util
import json
from datetime import datetime
from pathlib import Path

import polars as pl
import pytest
from tokenizers import Tokenizer, processors

from orpo.io import InputError
from orpo.render.pairs import (
    OUTPUT_SCHEMA,
    EncodedPair,
    PairEncoder,
    Response,
    fit_length,
    render_pairs,
)
from orpo.render.settings import resolve_settings
from orpo.render.template import (
    ChatTemplate,
    ChatTemplateError,
    encode,
    encode_generation_prompt,
    load_template,
    load_tokenizer,
)

_spec = importlib.util.spec_from_file_location(
    "render_builders", Path(__file__).resolve().parent / "fixtures" / "templates" / "builders.py")
builders = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(builders)

DATE = {"date_string": "26 Jul 2024"}
CURATED_SCHEMA = {
    "id": pl.String, "prompt": pl.List(pl.Struct({"role": pl.String, "content": pl.String})), "chosen": pl.String,
    "rejected": pl.String, "source": pl.String, "score_chosen": pl.Float64, "score_rejected": pl.Float64,
}


def row(row_id: str, prompt: list | str, chosen: str, rejected: str) -> dict:
    """A curated row in the contract's shape."""
    if isinstance(prompt, str):
        prompt = [{"role": "user", "content": prompt}]
    return {"id": row_id, "prompt": prompt, "chosen": chosen, "rejected": rejected, "source": "test",
            "score_chosen": 9.0, "score_rejected": 2.0}


def write_curated(folder: Path, train: list[dict], validation: list[dict] | None = None) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    for split, rows in (("train", train), ("validation", validation or [])):
        pl.DataFrame(rows, schema=CURATED_SCHEMA).write_parquet(folder / f"{split}.parquet")
    return folder


ROWS = [
    row("r1", "Hi there! How are you today?", "I am fine, thank you.", "Go away."),
    row("r2", [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Tell me a joke about cats."}],
        "Why did the cat sit on the computer? To keep an eye on the mouse.", "No."),
    row("r3", [{"role": "user", "content": "What is the capital of France?"},
               {"role": "assistant", "content": "Paris."}, {"role": "user", "content": "And of Germany? 🙂"}],
        "Berlin is the capital of Germany.", "Köln, 你好."),
    row("r4", "List three colors.", "red, green, blue", "  spaces around  "),
]


def read(out: Path, split: str = "train") -> list[dict]:
    return pl.read_parquet(out / f"{split}.parquet").to_dicts()


def scored(ids: list[int], mask: list[int]) -> list[int]:
    return [i for i, m in zip(ids, mask) if m]


def text_of(tok: Tokenizer, ids: list[int]) -> str:
    """The text of some tokens (the tokens' own strings: decoders may strip a leading space of a slice)."""
    if type(tok.pre_tokenizer).__name__ == "Metaspace":
        return "".join(tok.id_to_token(i) for i in ids).replace("▁", " ")
    return tok.decode(ids, skip_special_tokens=False)


# ---------------------------------------------------------------------------------------------------
# The artifact


def test_render_pairs_end_to_end(tmp_path: Path) -> None:
    model = builders.family_model(tmp_path / "chatml", "chatml")
    curated = write_curated(tmp_path / "curated", ROWS[:3], ROWS[3:])
    out = tmp_path / "rendered"
    manifest = render_pairs(model, curated, out, {"samples": 2})

    assert manifest["input_rows"] == 4 == manifest["output_rows"] and manifest["dropped"] == {}
    assert manifest["splits"]["validation"] == {"input_rows": 1, "output_rows": 1, "dropped": {}}
    assert manifest["seam_merges"]["count"] == 0 and manifest["truncated_prompts"]["count"] == 0
    assert manifest["settings"] == {"max_length": 1024, "max_prompt_length": 512, "template": None, "samples": 2,
                                    "template_kwargs": {}, "date": "2024-07-26", "over_length": "drop",
                                    "add_bos": "auto"}
    assert manifest["resolved"] == {"leading_ids": [], "date": None}  # ChatML adds no BOS, prints no date
    assert manifest["truncated_responses"]["count"] == 0
    assert manifest["template"]["sha256"] == hashlib.sha256(
        (model / "chat_template.jinja").read_bytes()).hexdigest()
    assert json.loads((out / "manifest.json").read_text()) == manifest
    assert pl.read_parquet_schema(out / "train.parquet") == OUTPUT_SCHEMA

    template, tok = load_template(model), load_tokenizer(model)
    im_end = tok.token_to_id("<|im_end|>")
    for src, got in zip(ROWS, read(out) + read(out, "validation")):
        assert got["id"] == src["id"]
        # The prompt is exactly what generation feeds; prompt + response is the full render's own tokens.
        assert got["prompt_ids"] == encode_generation_prompt(template, tok, src["prompt"])
        for side in ("chosen", "rejected"):
            full = template.render(src["prompt"] + [{"role": "assistant", "content": src[side]}])
            ids, mask = got[f"{side}_ids"], got[f"{side}_mask"]
            assert got["prompt_ids"] + ids == encode(tok, full)
            # Mask: the response content and <|im_end|>, not the "\n" ChatML writes after it.
            assert mask == [1] * (len(ids) - 1) + [0] and ids[-2] == im_end
            assert tok.decode(scored(ids, mask), skip_special_tokens=False) == src[side] + "<|im_end|>"
            assert got[f"{side}_len"] == len(ids)
        assert got["prompt_len"] == len(got["prompt_ids"])

    samples = (out / "samples.txt").read_text()
    assert samples.count("#### ") == 2 and "⟦SEAM⟧" in samples and "id=r1" in samples and "id=r3" not in samples
    assert "«I am fine, thank you.<|im_end|>»" in samples
    # Same inputs, same bytes.
    again = render_pairs(model, curated, tmp_path / "again", {"samples": 2})
    assert again == manifest
    assert (tmp_path / "again" / "train.parquet").read_bytes() == (out / "train.parquet").read_bytes()


# ---------------------------------------------------------------------------------------------------
# The mask, per family


END_OF_TURN = {"chatml": ("<|im_end|>", "\n"), "llama3": ("<|eot_id|>", ""), "mistral": ("</s>", ""),
               "gemma": ("<end_of_turn>", "\n"), "zephyr": ("</s>", "\n")}


@pytest.mark.parametrize("family", sorted(builders.FAMILIES))
def test_mask_is_content_through_end_of_turn(tmp_path: Path, family: str) -> None:
    model = builders.family_model(tmp_path / family, family)
    template, tok = load_template(model), load_tokenizer(model)
    enc = PairEncoder(template, tok, DATE)
    end, trailing = END_OF_TURN[family]
    for src in ROWS[:3]:
        pair = enc.encode(src["id"], src["prompt"], src["chosen"], src["rejected"])
        for side, text in ((pair.chosen, src["chosen"]), (pair.rejected, src["rejected"])):
            k = side.ids.index(tok.token_to_id(end)) + 1
            assert side.mask == [1] * k + [0] * (len(side.ids) - k)
            assert text_of(tok, side.ids[k:]) == trailing
            assert text_of(tok, side.ids[:k]).strip() == text.strip() + end
            assert not side.seam_merged and side.located and side.ended


def test_template_text_after_the_end_of_turn_is_not_scored(tmp_path: Path) -> None:
    # Qwen3-like: the full render puts an empty think block before the last answer, which the model has to
    # generate after the generation prompt: scored. Llama-3-original-like: the template always appends an
    # assistant header after the end-of-turn token, which is never generated: not scored.
    tpl = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{% if m.role == 'assistant' and loop.last %}"
           "<think>\n\n</think>\n\n{% endif %}{{ m.content }}<|im_end|>\n{% endfor %}"
           "{{ '<|im_start|>assistant\\n' }}")
    fam = builders.FAMILIES["chatml"]
    tok = builders.train_bpe(fam["kind"], fam["specials"])
    enc = PairEncoder(ChatTemplate(tpl, "inline", fam["tokens"]), tok)
    pair = enc.encode("q", [{"role": "user", "content": "Hi"}], "Sure thing.", "No.")
    ids, mask = pair.chosen.ids, pair.chosen.mask
    k = sum(mask)
    assert mask == [1] * k + [0] * (len(ids) - k)
    assert tok.decode(ids[:k], skip_special_tokens=False) == "<think>\n\n</think>\n\nSure thing.<|im_end|>"
    assert tok.decode(ids[k:], skip_special_tokens=False) == "\n<|im_start|>assistant\n"


def test_list_of_parts_content_and_no_end_token(tmp_path: Path) -> None:
    model = builders.family_model(tmp_path / "chatml", "chatml")
    enc = PairEncoder(load_template(model), load_tokenizer(model))
    as_text = enc.encode("a", [{"role": "user", "content": "Why is the sky blue?"}], "Rayleigh.", "Magic.")
    as_parts = enc.encode("a", [{"role": "user", "content": [{"type": "text", "text": "Why is the sky blue?"}]}],
                          "Rayleigh.", "Magic.")
    assert as_parts.prompt_ids == as_text.prompt_ids and as_parts.chosen.ids == as_text.chosen.ids
    # A template with no end-of-turn token: score through the last non-whitespace character, and say so.
    tok = load_tokenizer(model)
    bare = PairEncoder(ChatTemplate("{% for m in messages %}{{ m.role }}: {{ m.content }}\n\n{% endfor %}"
                                    "{% if add_generation_prompt %}assistant: {% endif %}", "bare", {}), tok)
    pair = bare.encode("b", [{"role": "user", "content": "Hi"}], "Hello there", "No")
    assert not pair.chosen.ended and pair.chosen.mask[-1] == 0
    assert tok.decode(scored(pair.chosen.ids, pair.chosen.mask)).strip() == "Hello there"


# ---------------------------------------------------------------------------------------------------
# The seam


SEAM_ROWS = [row("merge-1", "Hi there", "Sure thing, here you go.", "42 is the answer."),
             row("merge-2", "Tell me a joke.", "Sure thing, here you go.", "Sure thing, here you go: no."),
             row("clean-3", "Hi there", "42 is the answer.", "No.")]


def _seam_case(tmp_path: Path, kind: str) -> tuple[Path, str]:
    if kind == "newline":  # SentencePiece-style BPE that learned "\nSure": ChatML's trailing "\n" merges
        corpus = ["<|im_start|>assistant\nSure thing, here you go.<|im_end|>\n"] * 30 + builders.CORPUS
        specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
        tok = builders.train_bpe("metaspace", specials, corpus=corpus, vocab_size=300)
        tokens, template = {"eos_token": "<|im_end|>"}, builders.family_template("chatml_clean")
    else:  # byte-level BPE: the generation prompt "ASSISTANT: " ends in a space that merges into "ĠSure"
        corpus = ["USER: hi\nASSISTANT: Sure thing, here you go.</s>"] * 30 + builders.CORPUS
        tok = builders.train_bpe("bytelevel", ["</s>"], corpus=corpus, vocab_size=400)
        tokens = {"eos_token": "</s>"}
        template = ("{% for m in messages %}{% if m.role == 'user' %}USER: {{ m.content }}\n{% else %}"
                    "ASSISTANT: {{ m.content }}{{ eos_token }}\n{% endif %}{% endfor %}"
                    "{% if add_generation_prompt %}ASSISTANT: {% endif %}")
    model = builders.write_model(tmp_path / kind, tok, tokens, template)
    return model, tokens["eos_token"]


@pytest.mark.parametrize("kind", ["newline", "space"])
def test_seam_merges_are_detected_fixed_and_counted(tmp_path: Path, kind: str) -> None:
    model, eos = _seam_case(tmp_path, kind)
    out = tmp_path / "out"
    manifest = render_pairs(model, write_curated(tmp_path / "cur", SEAM_ROWS), out, {})
    assert manifest["seam_merges"] == {"count": 2, "examples": ["merge-1", "merge-2"]}
    template, tok = load_template(model), load_tokenizer(model)
    for src, got in zip(SEAM_ROWS, read(out)):
        prompt_text = template.render(src["prompt"], add_generation_prompt=True)
        assert got["prompt_ids"] == encode(tok, prompt_text)  # exactly the generation prompt
        for side in ("chosen", "rejected"):
            full = template.render(src["prompt"] + [{"role": "assistant", "content": src[side]}])
            cont = full[len(prompt_text):]
            ids, mask = got[f"{side}_ids"], got[f"{side}_mask"]
            merged = encode(tok, full)[: len(got["prompt_ids"])] != got["prompt_ids"]
            assert merged == src[side].startswith("Sure")  # the tokenizer really merges across the seam here
            if merged:
                # Fixed: the response is the continuation tokenized as a fresh segment (no spurious prefix space)
                anchored = tok.encode(eos + cont, add_special_tokens=False).ids[1:]
                assert ids == anchored and text_of(tok, ids) == cont
            else:
                assert got["prompt_ids"] + ids == encode(tok, full)
            assert text_of(tok, scored(ids, mask)).strip() == src[side] + eos
            assert text_of(tok, ids[len(scored(ids, mask)):]) == "\n"


def test_prefix_mismatch_falls_back_to_longest_common_prefix(tmp_path: Path) -> None:
    # DeepSeek-R1-like: the generation prompt opens a think block the full render doesn't have.
    tpl = ("{% for m in messages %}{% if m.role == 'user' %}<|im_start|>user\n{{ m.content }}<|im_end|>\n"
           "{% else %}<|im_start|>assistant\n{{ m.content }}<|im_end|>\n{% endif %}{% endfor %}"
           "{% if add_generation_prompt %}<|im_start|>assistant\n<think>\n{% endif %}")
    fam = builders.FAMILIES["chatml"]
    tok = builders.train_bpe(fam["kind"], fam["specials"])
    enc = PairEncoder(ChatTemplate(tpl, "inline", fam["tokens"]), tok)
    prompt = [{"role": "user", "content": "Hi"}]
    # Both responses start like the think block ("<think..."): the cut must not reach into them.
    pair = enc.encode("m", prompt, "<thinking> is a tag.", "<thinker>, no.")
    assert pair.prefix_mismatch
    assert pair.prompt_text == "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    for side, text in ((pair.chosen, "<thinking> is a tag."), (pair.rejected, "<thinker>, no.")):
        full = enc.template.render(prompt + [{"role": "assistant", "content": text}])
        assert tok.decode(pair.prompt_ids + side.ids, skip_special_tokens=False) == full
        assert tok.decode(scored(side.ids, side.mask), skip_special_tokens=False) == text + "<|im_end|>"
    # A divergence inside a special token string moves the cut to that token's start.
    tpl2 = ("{% for m in messages %}{% if m.role == 'user' %}U:{{ m.content }}{% else %}<|im_end|>{{ m.content }}"
            "{% endif %}{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    pair = PairEncoder(ChatTemplate(tpl2, "inline", fam["tokens"]), tok).encode("s", prompt, "Yes.", "No.")
    assert pair.prefix_mismatch and pair.prompt_text == "U:Hi"
    # After a mismatch, template text between the cut and the content is not scored.
    assert pair.chosen.ids[0] == tok.token_to_id("<|im_end|>") and pair.chosen.mask[0] == 0
    assert tok.decode(scored(pair.chosen.ids, pair.chosen.mask)) == "Yes." and not pair.chosen.ended


def test_prefix_mismatch_is_counted_in_manifest(tmp_path: Path) -> None:
    tpl = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
           "{% if add_generation_prompt %}<|im_start|>assistant\n<think>\n{% endif %}")
    fam = builders.FAMILIES["chatml"]
    model = builders.write_model(tmp_path / "m", builders.train_bpe(fam["kind"], fam["specials"]), fam["tokens"], tpl)
    manifest = render_pairs(model, write_curated(tmp_path / "c", ROWS[:2]), tmp_path / "o", {})
    assert manifest["prompt_prefix_mismatch"] == {"count": 2, "examples": ["r1", "r2"]}


# ---------------------------------------------------------------------------------------------------
# Length


def _long_rows() -> list[dict]:
    history = []
    for i in range(12):
        history += [{"role": "user", "content": f"Question number {i}: what is the capital of France?"},
                    {"role": "assistant", "content": "Paris is the capital of France."}]
    return [row("long-prompt", history + [{"role": "user", "content": "And Germany?"}], "Berlin.", "Bonn, I think."),
            row("long-response", "Hi", "Sure! " * 200, "No."),
            row("short", "Hi", "Hello.", "Go away.")]


@pytest.mark.parametrize("family", ["llama3", "chatml"])
def test_left_truncation_keeps_bos_and_the_end_and_drops_long_responses(tmp_path: Path, family: str) -> None:
    model = builders.family_model(tmp_path / family, family)
    settings = {"max_length": 120, "max_prompt_length": 64, "template_kwargs": DATE}
    manifest = render_pairs(model, write_curated(tmp_path / "c", _long_rows()), tmp_path / "o", settings)
    assert manifest["dropped"] == {"response_too_long": {"count": 1, "examples": ["long-response"]}}
    assert manifest["truncated_prompts"] == {"count": 1, "examples": ["long-prompt"]}
    assert manifest["input_rows"] == 3 and manifest["output_rows"] == 2
    template, tok = load_template(model), load_tokenizer(model)
    got = {r["id"]: r for r in read(tmp_path / "o")}
    for src in _long_rows():
        if src["id"] not in got:
            continue
        r = got[src["id"]]
        full_prompt = encode_generation_prompt(template, tok, src["prompt"], **DATE)
        assert r["prompt_len"] <= 64 and r["prompt_len"] + max(r["chosen_len"], r["rejected_len"]) <= 120
        # Responses are never cut: they still end with the end-of-turn token and the template's tail.
        assert tok.decode(scored(r["chosen_ids"], r["chosen_mask"]), skip_special_tokens=False).startswith(
            src["chosen"])
        if src["id"] == "long-prompt":
            assert len(full_prompt) > 64 and r["prompt_len"] == 64
            bos = tok.token_to_id("<|begin_of_text|>")
            if family == "llama3":
                assert r["prompt_ids"][0] == bos and r["prompt_ids"][1:] == full_prompt[-63:]
            else:
                assert r["prompt_ids"] == full_prompt[-64:]
        else:
            assert r["prompt_ids"] == full_prompt


def test_both_responses_fit_with_one_prompt(tmp_path: Path) -> None:
    model = builders.family_model(tmp_path / "chatml", "chatml")
    rows = [row("x", [{"role": "user", "content": "What is the capital of France? " * 6}], "Paris.", "Sure! " * 20)]
    out = tmp_path / "o"
    render_pairs(model, write_curated(tmp_path / "c", rows), out, {"max_length": 70, "max_prompt_length": 60})
    r = read(out)[0]
    assert r["prompt_len"] + r["rejected_len"] == 70 and r["prompt_len"] + r["chosen_len"] < 70


# ---------------------------------------------------------------------------------------------------
# Errors and settings


def test_template_errors_name_the_row_and_the_template(tmp_path: Path) -> None:
    model = builders.family_model(tmp_path / "gemma", "gemma")
    bad = row("bad-row-7", [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}], "x", "y")
    with pytest.raises(ChatTemplateError) as info:
        render_pairs(model, write_curated(tmp_path / "c", [ROWS[0], bad]), tmp_path / "o", {})
    message = str(info.value)
    assert "bad-row-7" in message and str(model / "tokenizer_config.json") in message
    assert "Conversation roles must alternate" in message
    assert not (tmp_path / "o" / "manifest.json").exists()

    tool = row("tool-row", [{"role": "user", "content": "a"}, {"role": "tool", "content": "b"},
                            {"role": "user", "content": "c"}], "x", "y")
    mistral = builders.family_model(tmp_path / "mistral", "mistral")
    with pytest.raises(ChatTemplateError, match=r"row 'tool-row'.*Only user and assistant roles"):
        render_pairs(mistral, write_curated(tmp_path / "c2", [tool]), tmp_path / "o2", {})


def test_missing_special_token_names_row_and_token(tmp_path: Path) -> None:
    fam = builders.FAMILIES["chatml"]
    tok = builders.train_bpe(fam["kind"], fam["specials"])
    model = builders.write_model(tmp_path / "m", tok, {"eos_token": "<|im_end|>"},
                                 "{{ bos_token }}" + builders.family_template("chatml_clean"))
    with pytest.raises(ChatTemplateError, match=r"row 'r1'.*bos_token"):
        render_pairs(model, write_curated(tmp_path / "c", ROWS[:1]), tmp_path / "o", {})


def test_bad_input_and_settings(tmp_path: Path) -> None:
    model = builders.family_model(tmp_path / "chatml", "chatml")
    curated = tmp_path / "c"
    curated.mkdir()
    pl.DataFrame({"id": ["a"], "chosen": ["x"], "rejected": ["y"]}).write_parquet(curated / "train.parquet")
    with pytest.raises(InputError, match=r"missing columns \['prompt'\]"):
        render_pairs(model, curated, tmp_path / "o", {})
    write_curated(curated, [row("empty-prompt", [], "x", "y")])
    with pytest.raises(InputError, match="empty-prompt"):
        render_pairs(model, curated, tmp_path / "o", {})
    with pytest.raises(ValueError, match=r"unknown key render.max_len \(allowed here: "):
        resolve_settings({"max_len": 3})
    with pytest.raises(ValueError, match="render.max_prompt_length: 'many' is not of type 'integer'"):
        resolve_settings({"max_prompt_length": "many"})


def test_override_template_setting_and_vocab_check(tmp_path: Path) -> None:
    fam = builders.FAMILIES["chatml"]
    tok = builders.train_bpe(fam["kind"], fam["specials"])
    model = builders.write_model(tmp_path / "m", tok, fam["tokens"], "{{ raise_exception('model template') }}")
    override = builders.HERE / "chatml_clean.jinja"
    manifest = render_pairs(model, write_curated(tmp_path / "c", ROWS[:2]), tmp_path / "o",
                            {"template": str(override)})
    assert manifest["template"] == {"source": f"{override} (override)",
                                    "sha256": hashlib.sha256(override.read_bytes()).hexdigest(),
                                    "date": None, "calls_strftime_now": False}
    clean = ChatTemplate(override.read_text(), "clean", fam["tokens"])
    assert read(tmp_path / "o")[0]["prompt_ids"] == encode_generation_prompt(clean, tok, ROWS[0]["prompt"])
    # A template printing a token the model's embedding doesn't have is an error, not a silent index overflow.
    config = json.loads((model / "config.json").read_text())
    config["vocab_size"] = tok.token_to_id("<|im_end|>")
    (model / "config.json").write_text(json.dumps(config))
    with pytest.raises(ChatTemplateError, match="outside the model's vocabulary"):
        render_pairs(model, write_curated(tmp_path / "c", ROWS[:1]), tmp_path / "o3", {"template": str(override)})


def test_template_that_drops_the_response_is_counted_not_trained(tmp_path: Path) -> None:
    fam = builders.FAMILIES["chatml"]
    tok = builders.train_bpe(fam["kind"], fam["specials"])
    tpl = ("{% for m in messages if m.role != 'assistant' %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n"
           "{% endfor %}")
    model = builders.write_model(tmp_path / "m", tok, fam["tokens"], tpl)
    with pytest.raises(ValueError, match="no training pair left.*nothing_to_score"):
        render_pairs(model, write_curated(tmp_path / "c", ROWS[:2]), tmp_path / "o", {})
    assert not (tmp_path / "o").exists()  # nothing written: the folder is whole or absent


def test_template_that_omits_the_assistants_content_drops_identical_pairs(tmp_path: Path, capsys) -> None:
    """The assistant's turn rendered without its content: chosen and rejected become the same tokens (only
    the end-of-turn marker), a pair with nothing to prefer. Each is dropped and counted, the stage warns,
    and with no pair left it fails instead of training on or_loss = ln 2."""
    fam = builders.FAMILIES["chatml"]
    tok = builders.train_bpe(fam["kind"], fam["specials"])
    tpl = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{% if m.role != 'assistant' %}{{ m.content }}{% endif %}"
           "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    model = builders.write_model(tmp_path / "m", tok, fam["tokens"], tpl)
    curated = write_curated(tmp_path / "c", ROWS[:3])
    with pytest.raises(ValueError, match="no training pair left.*identical_responses"):
        render_pairs(model, curated, tmp_path / "o", {})
    err = capsys.readouterr().err
    assert "warning: dropped 3 of 3 pairs: identical_responses 3" in err


def test_strftime_template_prints_the_pinned_date_and_warns_only_when_unpinned(tmp_path: Path, capsys) -> None:
    model = builders.family_model(tmp_path / "llama3", "llama3")
    curated = write_curated(tmp_path / "c", ROWS[:1])
    pinned = render_pairs(model, curated, tmp_path / "o", {})  # the schema's default date
    assert pinned["warnings"] == [] and pinned["template"]["date"] == "2024-07-26" == pinned["settings"]["date"]
    assert pinned["template"]["calls_strftime_now"] and "render.date 2024-07-26" in pinned["notes"][0]
    assert "Today Date: 26 Jul 2024" in (tmp_path / "o" / "samples.txt").read_text()
    assert "orpo render: note: the template calls strftime_now" in capsys.readouterr().err
    other = render_pairs(model, curated, tmp_path / "o", {"date": "2031-03-05"})
    assert other["template"]["date"] == "2031-03-05" and "Today Date: 05 Mar 2031" in (tmp_path / "o" / "samples.txt").read_text()
    assert pinned["resolved"]["date"] == "2024-07-26" and other["resolved"]["date"] == "2031-03-05"
    before = f"{datetime.now():%Y-%m-%d}"
    live = render_pairs(model, curated, tmp_path / "o", {"date": None})
    assert live["template"]["date"] is None and "render.date is null" in live["warnings"][0]
    assert live["resolved"]["date"] in (before, f"{datetime.now():%Y-%m-%d}")  # today's, read once
    assert "orpo render: warning: the template calls strftime_now and render.date is null" in capsys.readouterr().err
    # A template variable that sets the date itself leaves nothing to pin or warn about.
    own = render_pairs(model, curated, tmp_path / "o", {"date": None, "template_kwargs": DATE})
    assert own["warnings"] == [] and own["notes"] == [] and own["template"]["date"] is None
    assert own["resolved"]["date"] is None
    with pytest.raises(ValueError, match="render.date: '26 Jul 2024' does not match"):
        render_pairs(model, curated, tmp_path / "o", {"date": "26 Jul 2024"})


def test_a_template_without_strftime_now_records_no_date(tmp_path: Path) -> None:
    model = builders.family_model(tmp_path / "chatml", "chatml")
    manifest = render_pairs(model, write_curated(tmp_path / "c", ROWS[:1]), tmp_path / "o", {})
    assert manifest["template"]["date"] is None and not manifest["template"]["calls_strftime_now"]
    assert manifest["notes"] == []


def test_fit_length_edges() -> None:
    def pair(prompt: list[int], chosen: int, rejected: int) -> EncodedPair:
        return EncodedPair("e", list(prompt), Response([5] * chosen, [1] * chosen),
                           Response([6] * rejected, [1] * rejected), "")

    p = pair([1, 10, 11, 12, 13], 3, 4)  # 1 = BOS
    assert fit_length(p, 7, 100, bos_id=1) is None and p.prompt_ids == [1, 12, 13] and p.truncated
    p = pair([1, 10, 11, 12, 13], 3, 6)
    assert fit_length(p, 7, 100, bos_id=1) is None and p.prompt_ids == [13]  # room for one token: the last
    assert fit_length(pair([1, 10], 3, 7), 7, 100, bos_id=1) == "response_too_long"
    p = pair([10, 11, 12], 1, 1)
    assert fit_length(p, 100, 2, bos_id=1) is None and p.prompt_ids == [11, 12]  # no BOS: plain left-truncation
    p = pair([1, 10], 1, 1)
    assert fit_length(p, 100, 2, bos_id=1) is None and p.prompt_ids == [1, 10] and not p.truncated


# ---------------------------------------------------------------------------------------------------
# The ORPO authors' tokenization: BOS from the post-processor, right-truncation (render.add_bos, over_length)

PAPER_TEMPLATE = Path(__file__).resolve().parents[1] / "config" / "paper" / "mistral-orpo.jinja"


def bos_model(folder: Path, template: str, bos_in_config: bool = True) -> Path:
    """A Mistral-like folder whose tokenizer.json post-processor puts <s> first, as Mistral-7B-v0.1's does."""
    fam = builders.FAMILIES["mistral"]
    tok = builders.train_bpe(fam["kind"], fam["specials"])
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", pair="<s> $A <s> $B",
                                                       special_tokens=[("<s>", tok.token_to_id("<s>"))])
    tokens = fam["tokens"] if bos_in_config else {k: v for k, v in fam["tokens"].items() if k != "bos_token"}
    return builders.write_model(folder, tok, tokens, template)


def authors_ids(tok: Tokenizer, text: str, max_length: int | None = None) -> list[int]:
    """`tokenizer(text, max_length=..., truncation=True)`: the post-processor's BOS, then right-truncation."""
    tok = Tokenizer.from_str(tok.to_str())
    if max_length is not None:
        tok.enable_truncation(max_length)
    return tok.encode(text, add_special_tokens=True).ids


def test_bos_is_added_as_the_post_processor_would_unless_the_template_wrote_it(tmp_path: Path) -> None:
    rows = ROWS[:2]
    for name, template in (("paper", PAPER_TEMPLATE.read_text()), ("mistral", builders.family_template("mistral"))):
        model = bos_model(tmp_path / name, template)
        tpl, tok = load_template(model), load_tokenizer(model)
        bos = tok.token_to_id("<s>")
        manifest = render_pairs(model, write_curated(tmp_path / f"c-{name}", rows), tmp_path / f"o-{name}", {})
        assert manifest["settings"]["add_bos"] == "auto" and manifest["resolved"]["leading_ids"] == [bos]
        for src, got in zip(rows, read(tmp_path / f"o-{name}")):
            for side in ("chosen", "rejected"):
                full = tpl.render(src["prompt"] + [{"role": "assistant", "content": src[side]}])
                ours = got["prompt_ids"] + got[f"{side}_ids"]
                assert ours[0] == bos and ours.count(bos) == 1  # exactly one BOS, first
                if name == "paper":  # the template writes none: ours is tokenizer(text), the authors' tokens
                    assert ours == authors_ids(tok, full)
                else:  # the template writes <s>: tokenizer(text) would double it, ours keeps one
                    assert authors_ids(tok, full)[:2] == [bos, bos] and ours == authors_ids(tok, full)[1:]
            template_ids = encode(tok, tpl.render(src["prompt"], add_generation_prompt=True))
            assert got["prompt_ids"] == ([bos] + template_ids if name == "paper" else template_ids)
    model = tmp_path / "paper"
    render_pairs(model, write_curated(tmp_path / "c-off", rows), tmp_path / "o-off", {"add_bos": False})
    tok = load_tokenizer(model)
    assert all(tok.token_to_id("<s>") not in r["prompt_ids"] for r in read(tmp_path / "o-off"))


def test_add_bos_without_a_post_processor(tmp_path: Path) -> None:
    """auto adds nothing where tokenizer(text) adds nothing; true adds the named BOS, and without one fails."""
    fam = builders.FAMILIES["mistral"]
    model = builders.write_model(tmp_path / "m", builders.train_bpe(fam["kind"], fam["specials"]), fam["tokens"],
                                 PAPER_TEMPLATE.read_text())
    tok = load_tokenizer(model)
    curated = write_curated(tmp_path / "c", ROWS[:1])
    auto = render_pairs(model, curated, tmp_path / "auto", {})
    forced = render_pairs(model, curated, tmp_path / "true", {"add_bos": True})
    assert auto["resolved"]["leading_ids"] == [] and forced["resolved"]["leading_ids"] == [tok.token_to_id("<s>")]
    a, t = read(tmp_path / "auto")[0], read(tmp_path / "true")[0]
    assert t["prompt_ids"] == [tok.token_to_id("<s>")] + a["prompt_ids"] and t["chosen_ids"] == a["chosen_ids"]
    chatml = builders.family_model(tmp_path / "chatml", "chatml")  # names no BOS token
    with pytest.raises(ChatTemplateError, match="add_bos is true.*no BOS token"):
        render_pairs(chatml, curated, tmp_path / "x", {"add_bos": True})
    with pytest.raises(ValueError, match=r"render.add_bos: 'yes' is not one of \['auto', True, False\]"):
        resolve_settings({"add_bos": "yes"})


def _authors_rows() -> list[dict]:
    return [row("short", "Hi", "Hello.", "Go away."),
            row("long-chosen", "Tell me a joke about cats.", "Sure! " * 40, "No."),
            row("both-long", "Hi", "Sure! " * 30, "Sorry, I can't help with that. " * 8),
            row("long-prompt", "What is the capital of France? " * 8, "Paris.", "Rome."),
            row("prompt-at-limit", "List three colors.", "red, green, blue", "no")]


def test_truncate_is_the_authors_filter_and_right_truncation(tmp_path: Path) -> None:
    """Oracle: the authors' main.py, with `tokenizers` standing in for transformers: drop a row when its
    templated prompt (no BOS) has >= prompt_max_length tokens, else tokenizer(full, max_length, truncation=True)."""
    model = bos_model(tmp_path / "m", PAPER_TEMPLATE.read_text())
    tpl, tok = load_template(model), load_tokenizer(model)
    rows = _authors_rows()
    at_limit = len(encode(tok, tpl.render(rows[-1]["prompt"], add_generation_prompt=True)))
    max_prompt, max_length = at_limit + 1, 40  # the last prompt is one token under the limit, BOS aside
    settings = {"over_length": "truncate", "max_prompt_length": max_prompt, "max_length": max_length}
    manifest = render_pairs(model, write_curated(tmp_path / "c", rows), tmp_path / "o", settings)
    got = {r["id"]: r for r in read(tmp_path / "o")}

    expected_kept, cut = [], []
    for src in rows:
        prompt_len = len(encode(tok, tpl.render(src["prompt"], add_generation_prompt=True)))  # their filter's count
        if not prompt_len < max_prompt:
            assert src["id"] not in got
            continue
        expected_kept.append(src["id"])
        r = got[src["id"]]
        assert r["prompt_ids"] == authors_ids(tok, tpl.render(src["prompt"], add_generation_prompt=True))
        was_cut = False
        for side in ("chosen", "rejected"):
            full = tpl.render(src["prompt"] + [{"role": "assistant", "content": src[side]}])
            assert r["prompt_ids"] + r[f"{side}_ids"] == authors_ids(tok, full, max_length)
            whole = authors_ids(tok, full)
            was_cut |= len(whole) > max_length
            mask = r[f"{side}_mask"]
            if len(whole) > max_length:  # cut: every token left after the prompt is scored (no end-of-turn left)
                assert mask == [1] * len(mask) and r["prompt_len"] + len(mask) == max_length
            else:  # whole: scored through </s>, the template's "\n" after it not
                assert mask[-1] == 0 and sum(mask) == len(mask) - 1
        if was_cut:
            cut.append(src["id"])
    assert sorted(got) == sorted(expected_kept) == ["both-long", "long-chosen", "prompt-at-limit", "short"]
    assert manifest["dropped"] == {"prompt_too_long": {"count": 1, "examples": ["long-prompt"]}}
    assert sorted(cut) == ["both-long", "long-chosen"]
    assert manifest["truncated_responses"] == {"count": 2, "examples": ["long-chosen", "both-long"]}
    assert manifest["truncated_prompts"]["count"] == 0 and manifest["settings"]["over_length"] == "truncate"
    assert "(response right-truncated)" in (tmp_path / "o" / "samples.txt").read_text()

    # The default policy on the same rows: no response cut, long responses' rows dropped, the long prompt cut.
    drop = render_pairs(model, write_curated(tmp_path / "c2", rows), tmp_path / "o2",
                        {**settings, "over_length": "drop"})
    assert drop["truncated_responses"]["count"] == 0 and drop["truncated_prompts"]["examples"] == ["long-prompt"]
    assert set(drop["dropped"]) == {"response_too_long"}
    with pytest.raises(ValueError, match=r"render.over_length: 'cut' is not one of \['drop', 'truncate'\]"):
        resolve_settings({"over_length": "cut"})


def test_fit_length_truncate_edges() -> None:
    def pair(prompt: int, chosen: int, rejected: int) -> EncodedPair:
        return EncodedPair("e", [1] + [9] * (prompt - 1), Response([5] * chosen, [1] * (chosen - 1) + [0]),
                           Response([6] * rejected, [1] * rejected), "")

    p = pair(4, 3, 10)
    assert fit_length(p, 8, 4, bos_id=1, over_length="truncate") is None
    assert p.chosen.ids == [5] * 3 and not p.chosen.cut and p.chosen.mask == [1, 1, 0]
    assert p.rejected.ids == [6] * 4 and p.rejected.cut and not p.truncated
    assert fit_length(pair(5, 1, 1), 8, 4, over_length="truncate") == "prompt_too_long"
    p = pair(4, 1, 1)  # a prompt at the limit stays whole
    assert fit_length(p, 8, 4, over_length="truncate") is None and len(p.prompt_ids) == 4
