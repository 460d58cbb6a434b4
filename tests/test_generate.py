"""Batched generation through the training chat template: ordered, complete, equal to one-at-a-time greedy."""

import json

from mlx_lm import generate as mlx_generate
from mlx_lm import load

from orpo.eval.generate import generate
from orpo.render.template import encode_generation_prompt, load_template, load_tokenizer


def test_batched_greedy_equals_single_prompt_greedy(tiny_base, tmp_path):
    prompts = [
        {"key": 1, "prompt": "Tell me about the dog. Use at least 20 words."},
        {"key": 2, "prompt": "Write a short note about the river."},
        {"key": 3, "prompt": "Describe the apple in a few sentences. Do not use any commas in your answer."},
    ]
    src = tmp_path / "prompts.jsonl"
    src.write_text("".join(json.dumps(p) + "\n" for p in prompts))
    out = tmp_path / "gen.jsonl"
    stats = generate(tiny_base, src, out, {"max_tokens": 24, "batch_size": 2}, label="base")
    rows = [json.loads(x) for x in out.read_text().splitlines()]
    assert [r["key"] for r in rows] == [1, 2, 3] and [r["prompt"] for r in rows] == [p["prompt"] for p in prompts]
    assert all(r["label"] == "base" and r["settings"]["max_tokens"] == 24 for r in rows)
    assert stats["prompts"] == 3 and stats["generated_tokens"] > 0

    model, tok = load(str(tiny_base))
    chat, bare = load_template(tiny_base), load_tokenizer(tiny_base)
    for p, r in zip(prompts, rows):
        ids = encode_generation_prompt(chat, bare, [{"role": "user", "content": p["prompt"]}])
        assert mlx_generate(model, tok, ids, max_tokens=24) == r["response"]


def test_stop_strings_cut_the_response_exactly(tiny_base, tmp_path):
    src = tmp_path / "prompts.jsonl"
    src.write_text(json.dumps({"key": 1, "prompt": "Tell me about the dog."}) + "\n")
    plain = generate(tiny_base, src, tmp_path / "a.jsonl", {"max_tokens": 24}, label="base")
    full = json.loads((tmp_path / "a.jsonl").read_text())["response"]
    words = full.split()
    assert plain["prompts"] == 1 and len(words) >= 3
    stop = " " + words[2]
    generate(tiny_base, src, tmp_path / "b.jsonl", {"max_tokens": 24, "stop": ["never appears", stop]}, label="base")
    cut = json.loads((tmp_path / "b.jsonl").read_text())["response"]
    assert cut == full[: full.index(stop)] and stop not in cut
