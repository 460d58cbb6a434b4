"""The embedded base model: an HF-style folder mlx-lm loads, warmed up so that it generates text."""

import json

import mlx.core as mx
from mlx_lm import generate, load
from tokenizers import Tokenizer

from orpo.base.model import build_base, read_conversations
from orpo.base.tokenizer import CHAT_TEMPLATE, EOS_TOKEN, train_bpe
from orpo.io import sha256_file

from conftest import TINY_BASE


def test_folder_is_hf_style_and_loads_in_mlx_lm(tiny_base):
    for name in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"):
        assert (tiny_base / name).exists(), name
    config = json.loads((tiny_base / "config.json").read_text())
    assert config["model_type"] == "llama" and config["num_hidden_layers"] == TINY_BASE["num_layers"]
    tok_config = json.loads((tiny_base / "tokenizer_config.json").read_text())
    assert tok_config["chat_template"] == CHAT_TEMPLATE and tok_config["eos_token"] == EOS_TOKEN

    model, tokenizer = load(str(tiny_base))
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "Tell me about the cat."}],
                                           add_generation_prompt=True, tokenize=False)
    assert prompt.endswith("<|im_start|>assistant\n")
    assert Tokenizer.from_file(str(tiny_base / "tokenizer.json")).token_to_id(EOS_TOKEN) in tokenizer.eos_token_ids
    text = generate(model, tokenizer, prompt, max_tokens=20)
    assert len(text.split()) >= 3


def test_warmup_lowers_the_loss(tiny_base):
    log = json.loads((tiny_base / "warmup_log.json").read_text())
    assert log[-1]["step"] == TINY_BASE["steps"]
    assert log[-1]["loss"] < 0.7 * log[0]["loss"]


def test_same_settings_give_identical_bytes(tiny_raw, tiny_base, tmp_path):
    build_base(tiny_raw, tmp_path / "again", TINY_BASE)
    for name in ("model.safetensors", "tokenizer.json", "config.json"):
        assert sha256_file(tmp_path / "again" / name) == sha256_file(tiny_base / name), name


def test_tokenizer_round_trips_the_data(tiny_raw):
    convs, _ = read_conversations(tiny_raw)
    texts = [c[0] for c in convs[:50]]
    tok = train_bpe(texts, 512)
    for t in texts:
        assert tok.decode(tok.encode(t, add_special_tokens=False).ids) == t
    assert mx.array(tok.encode(texts[0]).ids).size < len(texts[0])


def test_raw_rows_are_read_in_every_form_curate_takes(tiny_raw, tmp_path):
    """data.raw as a folder, a .parquet file or binarized rows: the base stage reads what curate reads (one
    reader); a malformed line is skipped (and counted) under curate's on_error: skip, named otherwise."""
    import polars as pl
    import pytest

    from orpo.io import InputError

    want, _ = read_conversations(tiny_raw)
    folder = tmp_path / "folder"
    folder.mkdir()
    lines = tiny_raw.read_text().splitlines()
    (folder / "a.jsonl").write_text("\n".join(lines[:60]) + "\n")
    (folder / "b.jsonl").write_text("\n".join(lines[60:]) + "\n")
    assert read_conversations(folder)[0] == want
    rows = [json.loads(x) for x in lines]
    pl.DataFrame({"instruction": [r["instruction"] for r in rows],
                  "completions": [[{"response": c["response"]} for c in r["completions"]] for r in rows]}
                 ).write_parquet(tmp_path / "raw.parquet")
    assert read_conversations(tmp_path / "raw.parquet")[0] == want
    binarized = tmp_path / "binarized.jsonl"
    binarized.write_text(json.dumps({"prompt": "Say hi.", "chosen": [{"role": "user", "content": "Say hi."},
                                                                     {"role": "assistant", "content": "Hi!"}],
                                     "rejected": "No."}) + "\n")
    assert read_conversations(binarized)[0] == [("Say hi.", ["Hi!", "No."])]
    broken = tmp_path / "broken.jsonl"
    broken.write_text(lines[0] + "\n{not json\n" + lines[1] + "\n")
    with pytest.raises(InputError, match="broken.jsonl, line 2"):
        read_conversations(broken)
    assert read_conversations(broken, "skip") == (want[:2], 1)
    (tmp_path / "field.jsonl").write_text(json.dumps({"completions": [{"response": "x"}]}) + "\n")
    with pytest.raises(InputError, match="field.jsonl, line 1, field 'instruction'"):
        read_conversations(tmp_path / "field.jsonl")
    with pytest.raises(InputError, match="no rows \\(1 malformed, skipped\\)"):
        read_conversations(tmp_path / "field.jsonl", "skip")
