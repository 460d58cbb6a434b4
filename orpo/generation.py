"""Batched generation on MLX through the training chat template, shared by evaluation and SPIN."""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import mlx.core as mx
import mlx.nn as nn
from mlx_lm import load
from mlx_lm.generate import batch_generate
from mlx_lm.sample_utils import make_sampler
from mlx_lm.tokenizer_utils import TokenizerWrapper
from tokenizers import Tokenizer

from orpo.render.template import ChatTemplate, encode_generation_prompt, load_template, load_tokenizer, resolve_model_dir


@dataclass
class Generator:
    """A loaded model (with or without an adapter) and the exact prompt rendering used in training."""

    model: nn.Module
    wrapper: TokenizerWrapper
    chat: ChatTemplate
    tokenizer: Tokenizer
    template_kwargs: dict[str, Any]

    def prompt_ids(self, messages: list[dict[str, Any]]) -> list[int]:
        """Token ids of the generation prompt for a conversation."""
        return encode_generation_prompt(self.chat, self.tokenizer, messages, **self.template_kwargs)


def load_generator(
    model: str | Path, adapter: str | Path | None = None, render: dict[str, Any] | None = None,
) -> Generator:
    """Load a model folder or hub id, optionally with a LoRA adapter folder, for generation.

    `render` is the render stage's settings: its template override and template variables apply here
    too, so generation prompts are rendered exactly as training prompts were.
    """
    render = render or {}
    model_dir = resolve_model_dir(model, weights=True)
    net, wrapper = load(str(model_dir), adapter_path=str(adapter) if adapter else None)
    chat = load_template(model_dir, render.get("template"))
    return Generator(net, wrapper, chat, load_tokenizer(model_dir), dict(render.get("template_kwargs") or {}))


def truncate_at_stop(text: str, stops: list[str]) -> str:
    """`text` up to (not including) the earliest occurrence of any stop string."""
    cut = min((i for i in (text.find(x) for x in stops) if i >= 0), default=len(text))
    return text[:cut]


def generate_batched(
    gen: Generator, prompts: list[list[int]], settings: dict[str, Any],
    progress: Callable[[int, int], None] | None = None,
) -> tuple[list[str], dict[str, Any]]:
    """One response per prompt (token ids), in input order; greedy at temperature 0, else seeded sampling.

    Prompts of similar length decode together (less padding); the output keeps the input order. Decoding
    stops at the tokenizer's end-of-turn tokens; `settings["stop"]` strings cut the text afterwards, which
    is exact whatever the tokenization around them (the token counts include what was cut).
    """
    mx.random.seed(settings["seed"])
    sampler = make_sampler(temp=settings["temperature"], top_p=settings["top_p"])
    order = sorted(range(len(prompts)), key=lambda i: (len(prompts[i]), i))
    texts: list[str] = [""] * len(prompts)
    t0, tokens = time.time(), 0
    for start in range(0, len(order), settings["batch_size"]):
        chunk = order[start : start + settings["batch_size"]]
        out = batch_generate(gen.model, gen.wrapper, [prompts[i] for i in chunk], max_tokens=settings["max_tokens"],
                             sampler=sampler, return_token_ids=True)
        for i, text, ids in zip(chunk, out.texts, out.token_ids):
            texts[i] = text
            tokens += len(ids)
        if progress:
            progress(min(start + len(chunk), len(order)), len(order))
    seconds = time.time() - t0
    stops = [x for x in settings.get("stop") or [] if x]
    if stops:
        texts = [truncate_at_stop(t, stops) for t in texts]
    return texts, {"prompts": len(prompts), "generated_tokens": tokens, "seconds": round(seconds, 1),
                   "tokens_per_s": round(tokens / max(seconds, 1e-9), 1)}
