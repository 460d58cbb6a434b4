"""The `base` stage core: train the tokenizer, initialise a tiny llama and warm it up on the raw rows."""

from __future__ import annotations

import json
import time
from collections.abc import Mapping
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import jinja2
import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
import numpy as np
from mlx.utils import tree_flatten
from mlx_lm.models import llama
from mlx_lm.utils import save_config, save_model

from orpo.base.tokenizer import CHAT_TEMPLATE, EOS_TOKEN, save_tokenizer, train_bpe
from orpo.engine.embedding import with_summed_embeddings
from orpo.folders import mark_complete
from orpo.io import InputError, atomic_path, write_json
from orpo.rows import iter_items
from orpo.optim import lr_schedule, warmup_steps_for
from orpo.settings import as_dict, typed
from orpo import progress


@dataclass(frozen=True)
class BaseSettings:
    """The `base` section: the embedded model's shape and warm-up (the schema describes each key)."""

    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    intermediate_size: int
    max_length: int
    context_length: int
    steps: int
    batch_size: int
    lr: float
    warmup: float
    weight_decay: float
    seed: int
    log_every: int


def read_conversations(raw: str | Path, on_error: str = "raise") -> tuple[list[tuple[str, list[str]]], int]:
    """(instruction, responses) per raw row, read as curate reads them (orpo.rows: a .jsonl/.json/.parquet file,
    a folder of them, a hub id): an UltraFeedback row gives its completions, a binarized row its last user
    turn with chosen and rejected. Returns them and the count of malformed rows skipped (on_error "skip",
    curate's setting: both stages then read the same rows); with "raise" a bad row names file, line and field.
    """
    out, skipped = [], 0
    for item in iter_items([str(raw)], on_error):
        if item.error is not None:
            skipped += 1
            continue
        try:
            out.append(_conversation(item.row))
        except InputError as e:
            if on_error == "raise":
                raise item.located(e.field, e.reason) from None
            skipped += 1
    if not out:
        raise InputError(raw, None, None, "no rows" + (f" ({skipped} malformed, skipped)" if skipped else ""))
    return out, skipped


def _conversation(row: dict) -> tuple[str, list[str]]:
    """One row's (instruction, responses); InputError(field) for a missing or mistyped field (no path yet)."""

    def bad(field: str, message: str) -> InputError:
        return InputError("", None, field, message)

    if "completions" in row:
        instruction, comps = row.get("instruction"), row["completions"]
        if not isinstance(instruction, str):
            raise bad("instruction", "missing or not a string")
        if not isinstance(comps, list) or not comps:
            raise bad("completions", "missing or empty list")
        for i, c in enumerate(comps):
            if not isinstance(c, dict) or not isinstance(c.get("response"), str):
                raise bad(f"completions[{i}].response", "missing or not a string")
        return instruction, [c["response"] for c in comps]
    responses = []
    for key in ("chosen", "rejected"):
        value = row.get(key)
        if isinstance(value, list) and value and isinstance(value[-1], dict):
            value = value[-1].get("content")  # a conversation ending in the assistant turn
        if not isinstance(value, str):
            raise bad(key, "missing, or neither a string nor a conversation ending in a message")
        responses.append(value)
    prompt = row.get("prompt")
    if not isinstance(prompt, str):  # a message list, or the turns before a conversation's response
        turns = prompt if isinstance(prompt, list) else row["chosen"][:-1] if isinstance(row["chosen"], list) else []
        users = [t["content"] for t in turns
                 if isinstance(t, dict) and t.get("role") == "user" and isinstance(t.get("content"), str)]
        prompt = users[-1] if users else None
    if prompt is None:
        raise bad("prompt", "missing: no user turn before the responses")
    return prompt, responses


def render_chat(instruction: str, response: str) -> str:
    """The conversation as the embedded chat template renders it."""
    template = _template()
    return template.render(
        messages=[{"role": "user", "content": instruction}, {"role": "assistant", "content": response}],
        add_generation_prompt=False,
    )


_TEMPLATE: jinja2.Template | None = None


def _template() -> jinja2.Template:
    global _TEMPLATE
    if _TEMPLATE is None:
        env = jinja2.Environment(trim_blocks=True, lstrip_blocks=True)
        _TEMPLATE = env.from_string(CHAT_TEMPLATE)
    return _TEMPLATE


def model_args(s: BaseSettings, vocab_size: int, eos_id: int) -> dict[str, Any]:
    """The HF-style config.json of the tiny llama."""
    return {
        "model_type": "llama",
        "architectures": ["LlamaForCausalLM"],
        "hidden_size": s.hidden_size,
        "num_hidden_layers": s.num_layers,
        "intermediate_size": s.intermediate_size,
        "num_attention_heads": s.num_heads,
        "num_key_value_heads": s.num_heads,
        "rms_norm_eps": 1e-5,
        "vocab_size": vocab_size,
        "max_position_embeddings": s.context_length,
        "rope_theta": 10000.0,
        "tie_word_embeddings": True,
        "torch_dtype": "float32",
        "eos_token_id": eos_id,
    }


def lm_loss(model: nn.Module, chunk: mx.array) -> mx.array:
    """Mean next-token cross-entropy over a packed [B, T+1] chunk (no padding anywhere)."""
    logits = model(chunk[:, :-1]).astype(mx.float32)
    return nn.losses.cross_entropy(logits, chunk[:, 1:]).mean()


def packed_chunks(encoded: list[list[list[int]]], s: BaseSettings) -> np.ndarray:
    """[steps, batch, max_length+1] token chunks: per epoch one random completion per row, rows shuffled,
    concatenated and cut into fixed lengths (the standard pretraining packing: no compute on padding,
    every batch as diverse as the data, one shape so the step compiles once)."""
    rng = np.random.default_rng(s.seed)
    width, need = s.max_length + 1, s.steps * s.batch_size
    chunks: list[np.ndarray] = []
    while len(chunks) < need:
        order = rng.permutation(len(encoded))
        stream = np.fromiter((t for i in order for t in encoded[i][rng.integers(0, len(encoded[i]))]), np.int32)
        chunks += list(stream[: len(stream) // width * width].reshape(-1, width))
    return np.stack(chunks[:need]).reshape(s.steps, s.batch_size, width)


def build_base(raw_path: str | Path, out_dir: str | Path, settings: BaseSettings | Mapping[str, Any],
               on_error: str = "raise") -> dict[str, Any]:
    """Write an HF-style model folder (config, weights, tokenizer with chat template) warmed up on raw rows.

    The folder replaces `out_dir` only when complete (orpo.folders): a failed rebuild keeps the model there.
    """
    s = typed(BaseSettings, "base", settings)
    convs, skipped = read_conversations(raw_path, on_error)
    texts = [render_chat(ins, r) for ins, rs in convs for r in rs]
    tok = train_bpe(texts, s.vocab_size)
    eos_id = tok.token_to_id(EOS_TOKEN)

    mx.random.seed(s.seed)
    config = model_args(s, tok.get_vocab_size(), eos_id)
    model = llama.Model(llama.ModelArgs.from_dict(config))
    # Its gradient sums a token's rows in a fixed order: the warm-up gives the same weights on a GPU run to run.
    with_summed_embeddings(model)
    mx.eval(model.parameters())
    n_params = sum(v.size for _, v in tree_flatten(model.parameters()))

    # The base sees good and bad answers alike (a random completion per row per epoch), so it learns the
    # language and the format but not which answers are preferred: that is ORPO's job.
    encoded = [[e.ids for e in tok.encode_batch([render_chat(ins, r) for r in rs], add_special_tokens=False)]
               for ins, rs in convs]
    batches = packed_chunks(encoded, s)
    steps = s.steps
    lr = lr_schedule("cosine", s.lr, steps, warmup_steps_for(steps, s.warmup))
    opt = optim.AdamW(learning_rate=lr, weight_decay=s.weight_decay)
    loss_and_grad = nn.value_and_grad(model, lm_loss)
    state = [model.state, opt.state]

    @partial(mx.compile, inputs=state, outputs=state)
    def train_step(chunk: mx.array) -> mx.array:
        loss, grads = loss_and_grad(model, chunk)
        opt.update(model, grads)
        return loss

    log: list[dict[str, Any]] = []
    t0 = time.time()
    for step in range(1, steps + 1):
        loss = train_step(mx.array(batches[step - 1]))
        mx.eval(loss, state)
        if step % s.log_every == 0 or step == steps:
            tokens_seen, elapsed = step * batches[0].size, time.time() - t0
            rec = {"step": step, "loss": round(loss.item(), 4), "tokens": tokens_seen,
                   "tokens_per_s": round(tokens_seen / elapsed, 1)}
            log.append(rec)  # warmup_log.json keeps the numbers; the log gets a line to read
            print(progress.line("step", step, steps, {"loss": f"{rec['loss']:.4f}"}, rec["tokens_per_s"], elapsed,
                                progress.eta(elapsed, step, steps - step)), flush=True)
    tokens_seen = batches.size

    manifest = {
        "rows": len(convs), "malformed_skipped": skipped, "texts": len(texts), "vocab_size": tok.get_vocab_size(),
        "parameters": int(n_params), "steps": steps, "tokens_seen": tokens_seen,
        "final_loss": log[-1]["loss"], "seconds": round(time.time() - t0, 1), "settings": as_dict(s),
    }
    with atomic_path(out_dir) as tmp:
        tmp.mkdir()
        save_model(tmp, model)
        save_config(dict(config), tmp / "config.json")
        save_tokenizer(tok, tmp, s.max_length)
        (tmp / "generation_config.json").write_text(json.dumps({"eos_token_id": eos_id}) + "\n")
        write_json(tmp / "warmup_log.json", log)
        write_json(tmp / "manifest.json", manifest)
        mark_complete(tmp, "base")
    return manifest
