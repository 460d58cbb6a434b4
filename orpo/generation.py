"""Batched generation on MLX through the training chat template, shared by evaluation and SPIN."""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Mapping
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any, Callable, TextIO

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.generate import batch_generate
from mlx_lm.models.base import create_causal_mask
from mlx_lm.models.cache import make_prompt_cache
from mlx_lm.sample_utils import make_sampler
from mlx_lm.tokenizer_utils import TokenizerWrapper
from mlx_lm.utils import load_adapters
from mlx_lm.utils import load_tokenizer as load_wrapper
from tokenizers import Tokenizer
from tqdm import tqdm

from orpo import progress
from orpo.device import device_memory
from orpo.engine.forward import KVCache, UnsupportedModel
from orpo.engine.head import LMHead, head_logits, lm_head_of
from orpo.engine.stack import Stack
from orpo.precision import Precision, load_model
from orpo.render.settings import PromptSettings, RenderSettings, prompt_settings, resolve_prompting
from orpo.render.template import ChatTemplate, encode_generation_prompt, resolve_model_dir, with_leading


@dataclass
class Generator:
    """A loaded model (with or without an adapter) and the exact prompt rendering used in training."""

    model: nn.Module
    wrapper: TokenizerWrapper
    chat: ChatTemplate
    tokenizer: Tokenizer
    template_kwargs: dict[str, Any]
    context: int | None = None  # positions the model takes (prompt + generated tokens); None: not stated
    context_source: str | None = None  # where `context` was read, e.g. "config.json max_position_embeddings"
    lead: tuple[int, ...] = ()  # ids every prompt starts with (render.add_bos), as in training
    precision: Precision | None = None  # the dtype the model computes in (model.dtype), and why

    @cached_property
    def engine(self) -> tuple[Stack, LMHead] | None:
        """The engine's forward and head for this model (generation's own batched decode), or None for a family
        the engine has no forward for (mlx-lm's batch generation then)."""
        try:
            return Stack(self.model), lm_head_of(self.model)
        except (UnsupportedModel, ValueError):
            return None

    @cached_property
    def kv_bytes_per_position(self) -> int:
        """kv_bytes_per_token of the model, measured once per loaded model (a judge or SPIN generates many times)."""
        return kv_bytes_per_token(self.model)

    def prompt_ids(self, messages: list[dict[str, Any]]) -> list[int]:
        """Token ids of the generation prompt for a conversation."""
        return with_leading(encode_generation_prompt(self.chat, self.tokenizer, messages, **self.template_kwargs),
                            list(self.lead))

    def budget(self, prompt_tokens: int, max_tokens: int) -> int:
        """Tokens that may follow a prompt of `prompt_tokens`: `max_tokens`, cut to the room left in the context."""
        if self.context is None:
            return max_tokens
        return max(0, min(max_tokens, self.context - prompt_tokens))


# Prompts prefilled together while the others decode: mlx-lm's own default (a prefill's activations are
# [prompts, prompt length, H]).
PREFILL_BATCH = 8
# Of the memory beside the weights, what a batch's KV cache may fill: the rest is the prefill's activations,
# the sampler's [batch, V] logits and the cache's growth by 256-token steps (mlx-lm's).
KV_MEMORY_FRACTION = 0.6
KV_STEP = 256  # mlx-lm's caches grow by this many positions


def kv_bytes_per_token(model: nn.Module) -> int:
    """Bytes the model's cache holds per position of one sequence, measured on its own cache (every family and
    dtype alike): the cache after 2 x KV_STEP prompt tokens minus the cache after KV_STEP, per token."""

    def held(n: int) -> int:
        cache = make_prompt_cache(model)
        mx.eval(model(mx.zeros((1, n), mx.int32), cache=cache))
        return sum(c.nbytes for c in cache)

    return max(0, held(2 * KV_STEP) - held(KV_STEP)) // KV_STEP


def memory_beside_weights() -> int:
    """Bytes of the device's memory (the host's on the CPU) not held by live arrays now."""
    return max(0, device_memory() - mx.get_active_memory())


def chunk_by_memory(order: list[int], lengths: list[int], budgets: list[int], batch_size: int, per_token: int,
                    cache_bytes: int) -> list[list[int]]:
    """`order` cut into consecutive chunks of at most `batch_size` prompts whose KV cache fits `cache_bytes`.

    A batch's cache is as long as its longest prompt plus its largest budget (shorter prompts are left-padded)
    and rounded up to a KV_STEP: a chunk holds n x that x `per_token` bytes. A prompt too long to fit alone
    still gets a chunk of its own (the cache then decides).
    """
    def positions(i: int) -> int:
        return -(-(lengths[i] + budgets[i]) // KV_STEP) * KV_STEP

    chunks: list[list[int]] = []
    chunk: list[int] = []
    longest = 0
    for i in order:
        full = len(chunk) == batch_size or (len(chunk) + 1) * max(longest, positions(i)) * per_token > cache_bytes
        if chunk and full:
            chunks.append(chunk)
            chunk, longest = [], 0
        chunk.append(i)
        longest = max(longest, positions(i))
    return chunks + [chunk] if chunk else chunks


# config.json keys that state a model's position limit, in the order they are tried.
CONTEXT_KEYS = ("max_position_embeddings", "n_positions", "max_seq_len", "seq_length", "n_ctx")


def context_length(model_dir: str | Path) -> tuple[int, str] | None:
    """The model's position limit from its config.json (top level, then text_config) and where it was found.

    None when the folder has no config.json or it states no limit: generation is then left unchecked.
    """
    path = Path(model_dir) / "config.json"
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    if not isinstance(config, dict):
        return None
    for where, section in (("", config), ("text_config.", config.get("text_config"))):
        if not isinstance(section, dict):
            continue
        for key in CONTEXT_KEYS:
            value = section.get(key)
            if isinstance(value, int) and not isinstance(value, bool) and value > 0:
                return value, f"config.json {where}{key}"
    return None


def trained_model_folder(adapter: str | Path | None) -> Path | None:
    """The model folder a full-parameter run left where an adapter is expected: a run's `model/`, or a checkpoint
    folder (itself a model folder); None for an adapter folder or a LoRA run."""
    if adapter is None:
        return None
    folder = Path(adapter)
    if (folder / "adapters.safetensors").is_file():
        return None
    for candidate in (folder / "model", folder):
        if (candidate / "config.json").is_file() and (candidate / "model.safetensors").is_file():
            return candidate
    return None


def load_generator(
    model: str | Path, adapter: str | Path | None = None,
    render: PromptSettings | RenderSettings | Mapping[str, Any] | None = None, dtype: str = "auto",
) -> Generator:
    """Load a model folder or hub id in `dtype` (model.dtype), optionally with a LoRA adapter folder, for generation.

    An `adapter` that is a full-parameter run (or one of its checkpoints) stands for its trained model folder,
    which replaces `model`. `render` is the render stage's settings (`orpo.render.settings.prompt_settings`):
    its template override, template variables, date and add_bos apply here too, so generation prompts are
    rendered exactly as training prompts were.
    """
    s = prompt_settings(render)
    trained = trained_model_folder(adapter)
    if trained is not None:
        model, adapter = trained, None
    model_dir = resolve_model_dir(model, weights=True)
    # mlx_lm.load's steps, with the base weights cast before the adapter (kept in its saved dtype) is added.
    net, config, precision = load_model(model_dir, dtype)
    if adapter:
        net = load_adapters(net, str(adapter))
        net.eval()
    wrapper = load_wrapper(model_dir, eos_token_ids=config.get("eos_token_id", None))
    p = resolve_prompting(model_dir, s)
    context, source = context_length(model_dir) or (None, None)
    return Generator(net, wrapper, p.template, p.tokenizer, p.template_kwargs, context, source, p.lead, precision)


# Prompt tokens a prefill forward takes at once (its activations are [rows, prompt length, H]): mlx-lm's
# prefill of 8 prompts in steps of 2048 tokens.
PREFILL_TOKENS = 8 * 2048


def visible_bias(pads: mx.array, start: int, length: int, window: int | None, dtype: mx.Dtype) -> mx.array:
    """Additive masks [B, 1, length, start + length] of left-padded rows for queries at columns start..: mlx-lm's
    causal mask, except that a padding query sees itself (finite values, never read, where none would be NaN)."""
    seen = create_causal_mask(length, start, window, left_padding=pads)
    seen = seen | (mx.arange(start, start + length)[:, None] == mx.arange(start + length)[None])
    return mx.where(seen, mx.array(0.0, dtype), mx.array(-mx.inf, dtype))


def forward_cached(stack: Stack, head: LMHead, tokens: mx.array, pads: mx.array, caches: list[KVCache]) -> mx.array:
    """Logits [B, V] of the last of `tokens` [B, L], which join the caches at their offset."""
    start, length = caches[0].offset, tokens.shape[1]
    h = stack.embed(tokens)
    biases = {w: visible_bias(pads, start, length, w, h.dtype) for w in set(stack.windows)}
    for cache, window in zip(caches, stack.windows):
        cache.bias = biases[window]
    positions = mx.arange(start, start + length)[None] - pads[:, None]  # RoPE counts from each row's first token
    h = stack.run(h, caches, 0, len(stack.layers), positions)
    return head_logits(head, stack.norm(h[:, -1:]))[:, 0]


def prefill(stack: Stack, head: LMHead, prompts: list[list[int]], room: int) -> tuple[mx.array, list[KVCache]]:
    """The last prompt token's logits [B, V] and the layers' caches: each prompt left-padded to the longest, then
    `room` free positions. Prompts (longest first) run PREFILL_TOKENS at a time, each block padded to its own
    longest only and written into the caches' rows as it is done."""
    width = len(prompts[0])
    logits, caches = [], []
    i = 0
    while i < len(prompts):
        block = prompts[i:i + max(1, PREFILL_TOKENS // len(prompts[i]))]
        w = len(block[0])
        part = [KVCache() for _ in stack.layers]
        tokens = mx.array([[0] * (w - len(p)) + p for p in block])
        logits.append(forward_cached(stack, head, tokens, mx.array([w - len(p) for p in block]), part))
        if not caches:
            empty = lambda x: mx.zeros((len(prompts), x.shape[1], width + room, x.shape[3]), x.dtype)  # noqa: E731
            caches = [KVCache(empty(c.keys), empty(c.values), width) for c in part]
        for c, new in zip(caches, part):
            c.keys[i:i + len(block), :, width - w:width] = new.keys
            c.values[i:i + len(block), :, width - w:width] = new.values
        mx.eval(logits[-1], [(c.keys, c.values) for c in caches])
        i += len(block)
    return mx.concatenate(logits), caches


def decode(stack: Stack, head: LMHead, prompts: list[list[int]], budgets: list[int], sampler: Callable,
           stops: set[int]) -> list[list[int]]:
    """The tokens generated after each prompt (a stop token ends one and is left out), all in one batch.

    Prompts are left-padded into one cache of the longest prompt plus the largest budget; each step decodes every
    row still going, the next step's graph built while this one runs. Rows that have finished leave the batch
    when they are half of it (one gather of the caches).
    """
    out: list[list[int]] = [[] for _ in prompts]
    # Each row's prompt, longest first; None once the row has finished.
    batch: list[int | None] = sorted((i for i, b in enumerate(budgets) if b > 0), key=lambda i: -len(prompts[i]))
    if not batch:
        return out
    rows = [prompts[i] for i in batch]
    pads = mx.array([len(rows[0]) - len(p) for p in rows])
    logits, caches = prefill(stack, head, rows, max(budgets))
    sample = lambda logits: sampler(logits - mx.logsumexp(logits, axis=-1, keepdims=True))  # noqa: E731
    y = sample(logits)
    going = len(batch)
    while going:
        following = sample(forward_cached(stack, head, y[:, None], pads, caches))
        mx.async_eval(following)
        for r, token in enumerate(y.tolist()):
            i = batch[r]
            if i is None:
                continue
            if token not in stops:
                out[i].append(token)
            if token in stops or len(out[i]) == budgets[i]:
                batch[r] = None
                going -= 1
        if going and 2 * going <= len(batch):
            keep = [r for r, i in enumerate(batch) if i is not None]
            following, pads, caches = compact(following, pads, caches, keep)
            batch = [batch[r] for r in keep]
        y = following
    return out


def compact(y: mx.array, pads: mx.array, caches: list[KVCache], keep: list[int]) -> tuple[mx.array, mx.array,
                                                                                         list[KVCache]]:
    """The batch cut to the rows `keep`: their next tokens, paddings and caches."""
    idx = mx.array(keep)
    return y[idx], pads[idx], [KVCache(c.keys[idx], c.values[idx], c.offset) for c in caches]


def truncate_at_stop(text: str, stops: list[str]) -> str:
    """`text` up to (not including) the earliest occurrence of any stop string."""
    cut = min((i for i in (text.find(x) for x in stops) if i >= 0), default=len(text))
    return text[:cut]


class GenerationProgress:
    """Prompts done of total and tokens/s: a tqdm bar on a terminal, else a line per ~10% (Snakemake logs) with
    the elapsed time and the ETA."""

    def __init__(self, total: int, label: str = "generate", stream: TextIO | None = None, tty: bool | None = None,
                 clock: Callable[[], float] = time.perf_counter):
        self.stream = stream if stream is not None else sys.stderr
        self.tty = bool(getattr(self.stream, "isatty", lambda: False)()) if tty is None else tty
        self.total, self.label, self.clock = total, label, clock
        self.done = self.tokens = 0
        self.start = clock()
        self.next_tenth = 1  # the next 10% mark that earns a log line
        self.bar = (tqdm(total=total, desc=label, unit="prompt", file=self.stream, dynamic_ncols=True, smoothing=0.3)
                    if self.tty else None)

    def tokens_per_s(self) -> float:
        """Generated tokens per second of wall time so far."""
        return self.tokens / max(self.clock() - self.start, 1e-9)

    def update(self, prompts: int, tokens: int) -> None:
        """Record a finished batch: how many prompts it answered and how many tokens it generated."""
        self.done += prompts
        self.tokens += tokens
        if self.bar is not None:
            self.bar.set_postfix_str(f"{self.tokens_per_s():.1f} tok/s", refresh=False)
            self.bar.update(prompts)
            return
        tenth = self.done * 10 // max(self.total, 1)
        if tenth >= self.next_tenth or self.done == self.total:
            self.next_tenth = tenth + 1
            elapsed = self.clock() - self.start
            print(progress.line(f"{self.label}: prompts", self.done, self.total, {"tokens": f"{self.tokens:,}"},
                                self.tokens_per_s(), elapsed, progress.eta(elapsed, self.done, self.total - self.done),
                                percent=True), file=self.stream, flush=True)

    def close(self) -> None:
        """Finish the bar (nothing to do for log lines)."""
        if self.bar is not None:
            self.bar.close()


def generate_batched(
    gen: Generator, prompts: list[list[int]], settings: dict[str, Any],
    progress: Callable[[int, int], None] | None = None, label: str = "generate",
) -> tuple[list[str], dict[str, Any]]:
    """One response per prompt (token ids), in input order; greedy at temperature 0, else seeded sampling.

    Prompts of similar length decode together (less padding); the output keeps the input order. Decoding
    stops at the tokenizer's end-of-turn tokens; `settings["stop"]` strings cut the text afterwards, which
    is exact whatever the tokenization around them (the token counts include what was cut). Progress goes
    to stderr as a GenerationProgress named `label`, or, when given, to the `progress(done, total)` callback.
    """
    texts, _, stats = generate_counted(gen, prompts, settings, progress, label)
    return texts, stats


def generate_counted(
    gen: Generator, prompts: list[list[int]], settings: dict[str, Any],
    progress: Callable[[int, int], None] | None = None, label: str = "generate",
    budgets: list[int] | None = None, cache_bytes: int | None = None,
) -> tuple[list[str], list[int], dict[str, Any]]:
    """generate_batched, also returning each prompt's generated token count; `budgets` are per-prompt max_tokens.

    Without `budgets` every prompt may generate `settings["max_tokens"]` tokens. Prompts run shortest first in
    batches of at most `settings["batch_size"]`, fewer where their KV cache would pass `cache_bytes` (default:
    KV_MEMORY_FRACTION of the memory beside the weights).
    """
    mx.random.seed(settings["seed"])
    sampler = make_sampler(temp=settings["temperature"], top_p=settings["top_p"])
    budgets = [settings["max_tokens"]] * len(prompts) if budgets is None else list(budgets)
    if len(budgets) != len(prompts):
        raise ValueError(f"{len(budgets)} budgets for {len(prompts)} prompts")
    order = sorted(range(len(prompts)), key=lambda i: (len(prompts[i]), i))
    if cache_bytes is None:
        cache_bytes = int(KV_MEMORY_FRACTION * memory_beside_weights())
    chunks = chunk_by_memory(order, [len(p) for p in prompts], budgets, settings["batch_size"],
                             gen.kv_bytes_per_position, cache_bytes)
    texts: list[str] = [""] * len(prompts)
    counts: list[int] = [0] * len(prompts)
    bar = None if progress else GenerationProgress(len(prompts), label)
    t0, tokens = time.time(), 0
    try:
        done = 0
        for chunk in chunks:
            out = generated_ids(gen, [prompts[i] for i in chunk], [budgets[i] for i in chunk], sampler)
            batch_tokens = 0
            for i, ids in zip(chunk, out):
                texts[i], counts[i] = gen.wrapper.decode(ids), len(ids)
                batch_tokens += len(ids)
            tokens += batch_tokens
            done += len(chunk)
            del out
            mx.clear_cache()  # the finished batch's cache buffers go back before the next batch's, of other sizes
            if bar is not None:
                bar.update(len(chunk), batch_tokens)
            elif progress:
                progress(done, len(order))
    finally:
        if bar is not None:
            bar.close()
    seconds = time.time() - t0
    stops = [x for x in settings.get("stop") or [] if x]
    if stops:
        texts = [truncate_at_stop(t, stops) for t in texts]
    return texts, counts, {"prompts": len(prompts), "generated_tokens": tokens, "seconds": round(seconds, 1),
                           "tokens_per_s": round(tokens / max(seconds, 1e-9), 1),
                           "batch_sizes": [len(c) for c in chunks]}


def generated_ids(gen: Generator, prompts: list[list[int]], budgets: list[int], sampler: Callable) -> list[list[int]]:
    """The tokens generated after each prompt of one batch: the engine's decode, else mlx-lm's batch generation."""
    if gen.engine is None:
        # mlx-lm decodes at most completion_batch_size sequences at once (32 unless told): the whole batch here.
        return batch_generate(gen.model, gen.wrapper, prompts, max_tokens=budgets, sampler=sampler,
                              return_token_ids=True, completion_batch_size=len(prompts),
                              prefill_batch_size=min(len(prompts), PREFILL_BATCH)).token_ids
    return decode(*gen.engine, prompts, budgets, sampler, set(gen.wrapper.eos_token_ids))
