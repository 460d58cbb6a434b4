"""Batched generation through the training chat template: ordered, complete, equal to one-at-a-time greedy."""

import io
import json
import re

from mlx_lm import generate as mlx_generate
from mlx_lm import load

from orpo.eval.generate import generate
from orpo.generation import GenerationProgress
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


def test_progress_logs_a_line_per_tenth_when_not_a_terminal():
    stream, now = io.StringIO(), [0.0]
    bar = GenerationProgress(100, "generate[base]", stream=stream, tty=False, clock=lambda: now[0])
    for i in range(34):  # 34 batches of 3 prompts (the last one 1), 12 tokens each, half a second apart
        now[0] = 0.5 * (i + 1)
        bar.update(min(3, 100 - bar.done), 12)
    bar.close()
    lines = stream.getvalue().splitlines()
    assert len(lines) == 10  # 10%, 20%, ... 100%: not one per batch
    assert [int(re.search(r"\((\d+)%\)", x).group(1)) // 10 for x in lines] == list(range(1, 11))
    # 408 tokens / 17 s; at 30 prompts (10 batches, 5 s) the ETA is 70 prompts at 6 prompts/s: 11.67 s.
    assert lines[-1] == "generate[base]: prompts 100/100 (100%)  tokens 408  24.0 tok/s  elapsed 0:17  eta 0:00"
    assert lines[2] == "generate[base]: prompts 30/100 (30%)  tokens 120  24.0 tok/s  elapsed 0:05  eta 0:12"


def test_progress_is_a_bar_with_prompts_and_tokens_per_second_on_a_terminal():
    stream = io.StringIO()
    bar = GenerationProgress(10, "generate[orpo]", stream=stream, tty=True)
    for _ in range(5):
        bar.update(2, 40)
    bar.close()
    text = stream.getvalue()
    assert "generate[orpo]" in text and "10/10" in text and "tok/s" in text and "prompt" in text
    assert "\r" in text  # redrawn in place, not one line per update


def test_generation_reports_progress_to_stderr(tiny_base, tmp_path, capfd):
    src = tmp_path / "prompts.jsonl"
    src.write_text("".join(json.dumps({"key": i, "prompt": f"Tell me about item {i}."}) + "\n" for i in range(12)))
    stats = generate(tiny_base, src, tmp_path / "gen.jsonl", {"max_tokens": 6, "batch_size": 1}, label="base")
    err = capfd.readouterr().err.splitlines()
    lines = [x for x in err if x.startswith("generate[base]:")]
    assert 5 <= len(lines) <= 11  # pytest's stderr is not a terminal: ~10% lines, not one per 12 batches
    assert lines[-1].startswith(f"generate[base]: prompts 12/12 (100%)  tokens {stats['generated_tokens']:,}  ")
    assert lines[-1].endswith("eta 0:00")


def test_generation_prompts_carry_the_render_date(tiny_base):
    from datetime import datetime

    from conftest import ROOT

    from orpo.generation import load_generator

    llama3 = str(ROOT / "tests" / "fixtures" / "templates" / "llama3.jinja")
    chat = [{"role": "user", "content": "hi"}]

    def system_line(render):
        gen = load_generator(tiny_base, None, {**render, "template_kwargs": {"bos_token": ""}})  # tiny has no BOS
        text = gen.chat.render(chat, add_generation_prompt=True, **gen.template_kwargs)
        return next(line for line in text.splitlines() if line.startswith("Today Date:"))

    assert system_line({"template": llama3}) == "Today Date: 26 Jul 2024"  # the schema's default, as render's
    assert system_line({"template": llama3, "date": "2031-03-05"}) == "Today Date: 05 Mar 2031"
    before = datetime.now().strftime("%d %b %Y")
    live = system_line({"template": llama3, "date": None})
    assert live in (f"Today Date: {before}", f"Today Date: {datetime.now():%d %b %Y}")


def test_generation_prompts_start_with_the_bos_training_prompts_got(tiny_base, tmp_path):
    """A tokenizer whose post-processor adds a leading token: render and generation both start prompts with it."""
    import shutil

    import polars as pl
    from tokenizers import Tokenizer, processors

    from orpo.generation import load_generator
    from orpo.render.pairs import render_pairs

    model = tmp_path / "model"
    shutil.copytree(tiny_base, model)
    tok = Tokenizer.from_file(str(model / "tokenizer.json"))
    lead = tok.token_to_id("<|endoftext|>")  # the tiny vocabulary has no BOS: its pad token stands in for one
    tok.post_processor = processors.Sequence([
        processors.ByteLevel(trim_offsets=False),
        processors.TemplateProcessing(single="<|endoftext|> $A", special_tokens=[("<|endoftext|>", lead)])])
    tok.save(str(model / "tokenizer.json"))
    curated = tmp_path / "curated"
    curated.mkdir()
    prompt = [{"role": "user", "content": "Tell me about the dog."}]
    for split in ("train", "validation"):
        pl.DataFrame({"id": ["a"], "prompt": [prompt], "chosen": ["A dog."], "rejected": ["No."], "source": ["t"],
                      "score_chosen": [1.0], "score_rejected": [0.0]}).write_parquet(curated / f"{split}.parquet")
    for add_bos, expected in (("auto", [lead]), (False, [])):
        render = {"add_bos": add_bos}
        render_pairs(model, curated, tmp_path / f"rendered-{add_bos}", render)
        trained = pl.read_parquet(tmp_path / f"rendered-{add_bos}" / "train.parquet")["prompt_ids"][0].to_list()
        generated = load_generator(model, None, render).prompt_ids(prompt)
        assert generated == trained and trained[: len(expected)] == expected
        assert trained.count(lead) == len(expected)


def test_a_batch_decodes_all_its_prompts_together(tiny_base):
    """generate.batch_size prompts decode in one batch (mlx-lm's own batch generation decodes 32 at most unless
    told), and the greedy responses equal those of batches of 4."""
    from orpo.generation import generate_counted, load_generator

    gen = load_generator(tiny_base)
    assert gen.engine is not None  # the engine's decode, not mlx-lm's batch generation
    prompts = [gen.prompt_ids([{"role": "user", "content": f"Tell me about the dog number {i}."}]) for i in range(40)]
    settings = {"max_tokens": 12, "temperature": 0.0, "top_p": 1.0, "seed": 0}
    small = generate_counted(gen, prompts, {**settings, "batch_size": 4})
    texts, counts, stats = generate_counted(gen, prompts, {**settings, "batch_size": 40})
    assert small[2]["batch_sizes"] == [4] * 10 and stats["batch_sizes"] == [40]
    assert (texts, counts) == small[:2] and min(counts) > 0


def test_the_kv_cache_per_token_is_measured_from_the_models_own_cache(tiny_base):
    """2 (keys, values) x layers x KV heads x head dim x the dtype's bytes, as the folder's config states them."""
    from orpo.generation import kv_bytes_per_token, load_generator

    gen = load_generator(tiny_base)
    c = json.loads((tiny_base / "config.json").read_text())
    head_dim = c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"]
    kv_heads = c.get("num_key_value_heads") or c["num_attention_heads"]
    itemsize = gen.model.model.embed_tokens.weight.dtype.size
    assert kv_bytes_per_token(gen.model) == 2 * c["num_hidden_layers"] * kv_heads * head_dim * itemsize


def test_prompts_are_batched_by_the_memory_their_cache_takes():
    """Each chunk: at most batch_size prompts, n x (longest prompt + largest budget, in 256-position steps) x
    bytes per position within the budget; order kept; a prompt too long for the budget runs alone."""
    from orpo.generation import chunk_by_memory

    lengths = [10, 20, 30, 200, 240, 900, 5000]
    budgets = [100] * len(lengths)
    per_token, cache_bytes = 2, 2 * 1024  # 1024 positions in all
    chunks = chunk_by_memory(list(range(7)), lengths, budgets, 3, per_token, cache_bytes)
    # 3 by batch_size; two of 512 positions; 1000 -> 1024 alone; 5100 over the budget, alone all the same
    assert chunks == [[0, 1, 2], [3, 4], [5], [6]]
    assert chunk_by_memory(list(range(7)), lengths, budgets, 8, per_token, 10**9) == [list(range(7))]
    for chunk in chunk_by_memory(list(range(7)), lengths, budgets, 8, per_token, 2 * 1024 * 4):
        positions = max(-(-(lengths[i] + budgets[i]) // 256) * 256 for i in chunk)
        assert len(chunk) == 1 or len(chunk) * positions * per_token <= 2 * 1024 * 4


def test_generation_within_a_small_cache_budget_gives_the_same_responses(tiny_base):
    """A cache budget of three sequences: no batch holds more than three, and the greedy responses equal those of
    one unconstrained batch."""
    from orpo.generation import generate_counted, load_generator

    gen = load_generator(tiny_base)
    prompts = [gen.prompt_ids([{"role": "user", "content": f"Tell me about the cat number {i}."}]) for i in range(10)]
    settings = {"max_tokens": 12, "temperature": 0.0, "top_p": 1.0, "seed": 0, "batch_size": 10}
    whole = generate_counted(gen, prompts, settings)
    positions = -(-(max(len(p) for p in prompts) + 12) // 256) * 256
    per_token = gen.kv_bytes_per_position  # what generate_counted sizes batches by
    texts, counts, stats = generate_counted(gen, prompts, settings, cache_bytes=3 * positions * per_token)
    assert whole[2]["batch_sizes"] == [10] and max(stats["batch_sizes"]) == 3 and sum(stats["batch_sizes"]) == 10
    assert (texts, counts) == whole[:2]


def test_a_family_without_the_engines_forward_generates_through_mlx_lm(tiny_base):
    """A model the engine has no forward for still generates (mlx-lm's batch generation), the same greedy tokens
    as the engine's decode gives the same model."""
    from orpo.generation import generate_counted, load_generator

    gen = load_generator(tiny_base)
    prompts = [gen.prompt_ids([{"role": "user", "content": f"Name the bird number {i}."}]) for i in range(5)]
    settings = {"max_tokens": 10, "temperature": 0.0, "top_p": 1.0, "seed": 0, "batch_size": 5}
    ours = generate_counted(gen, prompts, settings)
    gen.engine = None  # as for a family the engine does not know
    assert generate_counted(gen, prompts, settings)[:2] == ours[:2]
