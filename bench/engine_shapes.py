"""Named benchmark shapes and suites shared by bench/engine.py (MLX) and bench/peer_liger.py (PyTorch).

Pure Python on purpose (no MLX, no torch): both benchmarks import it, in their own environments, so
they run exactly the same model and batch shapes.

A suite is what one `--shape NAME` runs: a list of cases (one subprocess each) plus the target checks
computed from them (ratios between two cases measured in that same run). Both also check, the same way, that
the device is theirs alone as they start.
"""

from __future__ import annotations

import sys
from dataclasses import asdict, dataclass, field, replace
from typing import Any

# UltraFeedback-like pairs: (median, low, high) of prompt, chosen and rejected lengths; sigma of their logs.
ULTRAFEEDBACK = ((150, 40, 700), (300, 60, 800), (300, 60, 800))
SIGMA = 0.8


def ultrafeedback_lengths(n: int, seed: int) -> list[tuple[int, int, int]]:
    """n (prompt, chosen, rejected) lengths, each drawn from its clipped log-normal (seeded)."""
    import numpy as np

    rng = np.random.default_rng(seed)
    cols = [np.clip(np.round(np.exp(np.log(med) + SIGMA * rng.standard_normal(n))), lo, hi).astype(int)
            for med, lo, hi in ULTRAFEEDBACK]
    return [tuple(int(c[i]) for c in cols) for i in range(n)]


@dataclass(frozen=True)
class Shape:
    """A random-init llama and its batch: `pairs` pairs of `prompt` prompt and `response` response tokens each."""

    hidden: int
    layers: int
    heads: int
    kv_heads: int
    intermediate: int
    vocab: int
    head_dim: int | None = None
    tied: bool = True
    rope_theta: float = 10000.0
    dtype: str = "float32"
    pairs: int = 4
    prompt: int = 128
    response: int = 128
    # Prompt lengths spread evenly over [prompt - spread/2, prompt + spread/2] across the pairs (mean `prompt`):
    # pairs that share no prompt length, as real data has (0 = every prompt `prompt` long).
    prompt_spread: int = 0

    def llama_config(self) -> dict[str, Any]:
        """Keys both mlx_lm.models.llama.ModelArgs and transformers.LlamaConfig accept."""
        return {
            "hidden_size": self.hidden, "num_hidden_layers": self.layers, "num_attention_heads": self.heads,
            "num_key_value_heads": self.kv_heads, "intermediate_size": self.intermediate,
            "vocab_size": self.vocab, "head_dim": self.head_dim or self.hidden // self.heads,
            "tie_word_embeddings": self.tied, "rope_theta": self.rope_theta, "rms_norm_eps": 1e-5,
        }

    def prompt_lengths(self) -> list[int]:
        """Each pair's prompt length."""
        n = self.pairs
        return [self.prompt + round((i - (n - 1) / 2) * self.prompt_spread / max(1, n - 1)) for i in range(n)]

    def two_forward_tokens(self) -> int:
        """Tokens of one step counted as two forwards ([prompt; chosen] and [prompt; rejected]) per pair."""
        return sum(2 * (p + self.response) for p in self.prompt_lengths())

    def linear_params(self) -> int:
        """Weights of the decoder's seven projections over all layers (what every stack token multiplies)."""
        d, a, kv = self.hidden, self.heads * (self.head_dim or self.hidden // self.heads), \
            self.kv_heads * (self.head_dim or self.hidden // self.heads)
        return self.layers * (2 * d * a + 2 * d * kv + 3 * d * self.intermediate)

    def step_flops(self, method: str = "lora", prefix_sharing: bool = True) -> float:
        """Model FLOPs of one ORPO step over this batch (value and gradients; no recompute, padding or update):
        `pair_flops` of each pair."""
        return sum(self.pair_flops(p, self.response, self.response, method, prefix_sharing)
                   for p in self.prompt_lengths())

    def pair_flops(self, prompt: int, chosen: int, rejected: int, method: str = "lora",
                   prefix_sharing: bool = True) -> float:
        """Model FLOPs of one pair's value and gradients at this geometry.

        Matmuls only, 2 FLOPs a multiply-add: each stack token through the projections (forward, the input's
        gradient, and for `full` the weights' gradient), causal attention over the (query, key) pairs each row
        sees (4 x heads x head_dim a pair forward, twice that backward), the head on the scored response tokens.
        Prefix sharing runs the prompt once per pair (rejected's rows attend to it); without it, twice.
        """
        passes = 3 if method == "full" else 2  # LoRA: the frozen weights need no gradient (adapters: < 1%)
        attn = 4 * self.heads * (self.head_dim or self.hidden // self.heads)
        p, c, r = prompt, chosen, rejected
        causal_c = (p + c) * (p + c + 1) // 2
        if prefix_sharing:
            stack, pairs = p + c + r, causal_c + r * p + r * (r + 1) // 2
        else:
            stack, pairs = 2 * p + c + r, causal_c + (p + r) * (p + r + 1) // 2
        head = 2 * self.hidden * self.vocab * (c + r)
        return (2 * self.linear_params() * stack * passes + 3 * attn * pairs * self.layers
                + head * (3 if method == "full" else 2))


def real_length_mfu(shape: Shape, lengths: list[tuple[int, int, int]], two_forward_tokens_per_s: float | None,
                    tflops: float | None, method: str = "lora", prefix_sharing: bool = True) -> float | None:
    """Model FLOPs utilisation over pairs of their own lengths, from a run's two-forward tokens/s (pairs/s times
    the pairs' mean two-forward tokens): `pair_flops` of each pair over the same time, against the probed rate."""
    if not (two_forward_tokens_per_s and tflops):
        return None
    flops = sum(shape.pair_flops(p, c, r, method, prefix_sharing) for p, c, r in lengths)
    tokens = sum(2 * p + c + r for p, c, r in lengths)
    return flops * two_forward_tokens_per_s / tokens / (tflops * 1e12)


@dataclass(frozen=True)
class Case:
    """One measured variant: a full ORPO step ('step') or the log-prob head alone ('head', M = pairs * response)."""

    name: str
    shape: Shape
    kind: str = "step"
    engine: dict[str, Any] = field(default_factory=dict)  # overrides of the schema's train.engine defaults
    baseline: str = "naive"  # the case its ratios are taken against

    def to_json(self) -> dict[str, Any]:
        """Plain-JSON form (what a child process receives)."""
        return {"name": self.name, "shape": asdict(self.shape), "kind": self.kind, "engine": dict(self.engine),
                "baseline": self.baseline}

    @staticmethod
    def from_json(obj: dict[str, Any]) -> Case:
        """Inverse of to_json."""
        return Case(obj["name"], Shape(**obj["shape"]), obj["kind"], dict(obj["engine"]), obj["baseline"])


@dataclass(frozen=True)
class Check:
    """A target: metric(numerator) / metric(denominator) compared with a bound."""

    label: str
    metric: str  # a key of a case's result: tokens_per_s, peak_gb, extra_gb
    numerator: str
    denominator: str
    op: str  # "<=" or ">="
    bound: float


@dataclass(frozen=True)
class Suite:
    """What `--shape NAME` runs."""

    cases: list[Case]
    checks: list[Check] = field(default_factory=list)
    peer: bool = True  # whether bench/peer_liger.py has a meaning on these shapes (not for the head alone)
    steps: int = 10  # timed steps per variant (--steps overrides)
    warmup: int = 3  # untimed steps first: graph building, compilation, allocator warm-up (--warmup overrides)


# Llama-3.2-1B's geometry (the reference shape): ~1.24B parameters, bf16.
LLAMA_1B = Shape(hidden=2048, layers=16, heads=32, kv_heads=8, intermediate=8192, vocab=128256, head_dim=64,
                 tied=True, rope_theta=500000.0, dtype="bfloat16", pairs=4, prompt=512, response=512)
# Mistral-7B-v0.1's geometry (~7.2B parameters, untied head, 8 KV heads of 128), bf16.
MISTRAL_7B = Shape(hidden=4096, layers=32, heads=32, kv_heads=8, intermediate=14336, vocab=32000, head_dim=128,
                   tied=False, rope_theta=10000.0, dtype="bfloat16", pairs=4, prompt=512, response=512)
# Small enough for a few float32 steps per variant on 2 CPU cores.
CPU_SMALL = Shape(hidden=256, layers=4, heads=4, kv_heads=2, intermediate=768, vocab=8192, dtype="float32",
                  pairs=4, prompt=128, response=128)


def _main_cases(shape: Shape, segment_layers: int, limit_gb: float, sweep_gb: tuple[float, ...] = ()) -> list[Case]:
    """Naive, each technique alone, all together.

    `limit_gb`: the memory limit (train.engine.memory_limit_gb) of the queued lean variant, set under the
    peer's checkpointed peak on the GPU shape; `sweep_gb`: more limits, each with overlap 1 and 4.
    """
    seg = {"segment_layers": segment_layers}
    wide = {"width_multiple": 128}  # what width_multiple 0 (auto) gives on CUDA: cuDNN's attention backward
    compiled = {"compile": True}
    return [
        Case("naive", shape),
        Case("width-128", shape, engine=wide),
        Case("fused", shape, engine={"head": "fused"}),
        Case(f"segmented-{segment_layers}", shape, engine=seg),
        Case("prefix", shape, engine={"prefix_sharing": True}),
        Case("fused-prefix-128", shape, engine={"head": "fused", "prefix_sharing": True, **wide}),
        Case("fused-128", shape, engine={"head": "fused", **wide}),
        Case(f"seg{segment_layers}-128", shape, engine={"head": "fused", **seg, **wide}),
        Case("all", shape, engine={"head": "fused", **seg, "prefix_sharing": True, **wide}),
        # The memory end of the trade-off: one layer per segment, small head chunks.
        Case("lean-128", shape, engine={"head": "fused", "head_chunk": 256, "segment_layers": 1, **wide}),
        Case("all-lean", shape, engine={"head": "fused", "head_chunk": 256, "segment_layers": 1, "prefix_sharing": True, **wide}),
        # The same programs under mx.compile (train.engine.compile; auto = on with CUDA).
        Case("fused-128-compiled", shape, engine={"head": "fused", **wide, **compiled}),
        Case("fused-prefix-128-compiled", shape, engine={"head": "fused", "prefix_sharing": True, **wide, **compiled}),
        Case("fused-prefix-128-c-exclusion", shape, engine={"head": "fused", "prefix_sharing": True, **wide, **compiled,
                                                            "prefix_attention": "exclusion"}),
        Case(f"seg{segment_layers}-128-compiled", shape, engine={"head": "fused", **seg, **wide, **compiled}),
        Case("lean-128-compiled", shape, engine={"head": "fused", "head_chunk": 256, "segment_layers": 1, **wide, **compiled}),
        Case("all-lean-compiled", shape, engine={"head": "fused", "head_chunk": 256, "segment_layers": 1,
                                                 "prefix_sharing": True, **wide, **compiled}),
        # Segments queued one ahead of the GPU (train.engine.overlap): speed for memory.
        Case("all-lean-compiled-overlap", shape, engine={"head": "fused", "head_chunk": 256, "segment_layers": 1,
                                                         "prefix_sharing": True, **wide, **compiled, "overlap": 1}),
        # Queued deeper, but MLX waits for queued work whenever memory passes the limit.
        Case("all-lean-compiled-limited", shape, engine={"head": "fused", "head_chunk": 256, "segment_layers": 1,
                                                         "prefix_sharing": True, **wide, **compiled, "overlap": 4,
                                                         "memory_limit_gb": limit_gb}),
        # Each layer's MLP differentiated in 4 token chunks (train.engine.mlp_chunks), waited for / queued one ahead.
        Case("all-lean-mlp4-compiled", shape, engine={"head": "fused", "head_chunk": 256, "segment_layers": 1,
                                                      "prefix_sharing": True, **wide, **compiled, "mlp_chunks": 4}),
        Case("all-lean-mlp4-c-overlap", shape, engine={"head": "fused", "head_chunk": 256, "segment_layers": 1,
                                                              "prefix_sharing": True, **wide, **compiled, "mlp_chunks": 4,
                                                              "overlap": 1}),
        # Both, under the memory limit: the MLP's chunks shrink the layer's working set, the limit holds the queue.
        Case("all-lean-mlp4-c-o1-limited", shape, engine={"head": "fused", "head_chunk": 256, "segment_layers": 1,
                                                          "prefix_sharing": True, **wide, **compiled, "mlp_chunks": 4,
                                                          "overlap": 1, "memory_limit_gb": limit_gb}),
        Case("all-lean-mlp4-c-o1-l-exclusion", shape, engine={"head": "fused", "head_chunk": 256, "segment_layers": 1,
                                                              "prefix_sharing": True, **wide, **compiled, "mlp_chunks": 4,
                                                              "overlap": 1, "memory_limit_gb": limit_gb,
                                                              "prefix_attention": "exclusion"}),
    ] + [Case(f"all-lean-c-o{depth}-l{gb:g}", shape, engine={"head": "fused", "head_chunk": 256, "segment_layers": 1,
                                                            "prefix_sharing": True, **wide, **compiled, "overlap": depth,
                                                            "memory_limit_gb": gb})
         for gb in sweep_gb for depth in (1, 4)]


def _lora_7b_cases(shape: Shape, limit_gb: float) -> list[Case]:
    """The CUDA default step and the lean recipe (limit: the peer's checkpointed peak), bf16 base and QLoRA."""
    default = {"head": "fused", "prefix_sharing": True, "width_multiple": 128, "compile": True}
    lean = {**default, "head_chunk": 256, "segment_layers": 1, "mlp_chunks": 4, "overlap": 1, "memory_limit_gb": limit_gb}
    return [Case("default", shape, engine=default, baseline="default"),
            Case("lean", shape, engine=lean, baseline="default"),
            Case("qlora4-default", shape, engine={**default, "bits": 4}, baseline="default"),
            Case("qlora4-lean", shape, engine={**lean, "bits": 4}, baseline="default")]


def _head_suite(base: Shape, small_vocab: int, large_vocab: int, tokens: int, chunk: int) -> Suite:
    """The head alone (hidden -> logp, grad w.r.t. hidden) at two vocab sizes, `tokens` response tokens.

    Besides the default chunk, the large vocab runs with the chunk scaled down by the vocab ratio so its
    [chunk, V] block has the same bytes as the small vocab's (token chunking alone cannot hold a fixed
    chunk's block constant when V grows).
    """
    small = replace(base, vocab=small_vocab, pairs=1, prompt=0, response=tokens)
    large = replace(small, vocab=large_vocab)
    scaled = max(1, chunk * small_vocab // large_vocab)
    s, l = f"{small_vocab // 1000}k", f"{large_vocab // 1000}k"
    cases = [
        Case(f"naive-V{s}", small, "head", baseline=f"naive-V{s}"),
        Case(f"naive-V{l}", large, "head", baseline=f"naive-V{l}"),
        Case(f"fused-V{s}", small, "head", {"head": "fused", "head_chunk": chunk}, baseline=f"naive-V{s}"),
        Case(f"fused-V{l}", large, "head", {"head": "fused", "head_chunk": chunk}, baseline=f"naive-V{l}"),
        Case(f"fused-V{l}-c{scaled}", large, "head", {"head": "fused", "head_chunk": scaled}, baseline=f"naive-V{l}"),
        # The default: head_chunk 0 sizes chunks by the vocabulary (orpo.engine.head.chunk_for).
        Case(f"fused-V{s}-auto", small, "head", {"head": "fused", "head_chunk": 0}, baseline=f"naive-V{s}"),
        Case(f"fused-V{l}-auto", large, "head", {"head": "fused", "head_chunk": 0}, baseline=f"naive-V{l}"),
        # The segmented backward's head: the same blocks evaluated one chunk at a time (fused_logp_eager).
        Case(f"eager-V{s}-auto", small, "head", {"head": "fused", "head_chunk": 0, "eager": True}, baseline=f"naive-V{s}"),
        Case(f"eager-V{l}-auto", large, "head", {"head": "fused", "head_chunk": 0, "eager": True}, baseline=f"naive-V{l}"),
    ]
    checks = [Check(f"fused head peak, V={l} vs V={s} ({tokens} tokens, chunk {chunk})", m,
                    f"fused-V{l}", f"fused-V{s}", "<=", 1.1) for m in ("peak_gb", "extra_gb")]
    checks += [Check(f"fused head peak, V={l} chunk {scaled} vs V={s} chunk {chunk}", m,
                     f"fused-V{l}-c{scaled}", f"fused-V{s}", "<=", 1.1) for m in ("peak_gb", "extra_gb")]
    checks += [Check(f"fused head peak, V={l} vs V={s}, auto chunk (the default)", m,
                     f"fused-V{l}-auto", f"fused-V{s}-auto", "<=", 1.1) for m in ("peak_gb", "extra_gb")]
    checks += [Check(f"fused head peak, V={l} vs V={s}, auto chunk, evaluated chunk by chunk (segmented backward)", m,
                     f"eager-V{l}-auto", f"eager-V{s}-auto", "<=", 1.1) for m in ("peak_gb", "extra_gb")]
    return Suite(cases, checks, peer=False)


def _segment_suite(base: Shape, few: int, many: int, segment_layers: int) -> Suite:
    """Segmented backward at `few` and `many` layers (plain backward beside each)."""
    lo, hi = replace(base, layers=few), replace(base, layers=many)
    seg = {"segment_layers": segment_layers}
    cases = [
        Case(f"naive-L{few}", lo, baseline=f"naive-L{few}"),
        Case(f"segmented-{segment_layers}-L{few}", lo, engine=seg, baseline=f"naive-L{few}"),
        Case(f"naive-L{many}", hi, baseline=f"naive-L{many}"),
        Case(f"segmented-{segment_layers}-L{many}", hi, engine=seg, baseline=f"naive-L{many}"),
    ]
    checks = [Check(f"segmented peak, {many} vs {few} layers", m, f"segmented-{segment_layers}-L{many}",
                    f"segmented-{segment_layers}-L{few}", "<=", 1.3) for m in ("peak_gb", "extra_gb")]
    return Suite(cases, checks)


def _prefix_suite(base: Shape, response: int) -> Suite:
    """Prompts twice the responses: one shared-prompt forward vs two (the token count alone allows 1.5x).

    Shared rows attend as SplitRows (the default) or, in the `-exclusion` cases, with the exclusion dims;
    the `-spread` cases give each pair its own prompt length (3/8 of the prompt apart, mean unchanged), so
    rejected's attention runs once per pair.
    """
    shape = replace(base, prompt=2 * response, response=response)
    spread = replace(shape, prompt_spread=3 * shape.prompt // 8)
    wide = {"width_multiple": 128}
    fused_c = {"head": "fused", "compile": True}
    cases = [Case("naive", shape), Case("prefix", shape, engine={"prefix_sharing": True}),
             Case("width-128", shape, engine=wide, baseline="width-128"),
             Case("prefix-128", shape, engine={"prefix_sharing": True, **wide}, baseline="width-128"),
             Case("prefix-128-exclusion", shape, engine={"prefix_sharing": True, **wide, "prefix_attention": "exclusion"},
                  baseline="width-128"),
             Case("width-128-compiled", shape, engine={**wide, **fused_c}, baseline="width-128-compiled"),
             Case("prefix-128-compiled", shape, engine={"prefix_sharing": True, **wide, **fused_c},
                  baseline="width-128-compiled"),
             Case("prefix-128-c-exclusion", shape, engine={"prefix_sharing": True, **wide, **fused_c,
                                                          "prefix_attention": "exclusion"}, baseline="width-128-compiled"),
             Case("width-128-c-spread", spread, engine={**wide, **fused_c}, baseline="width-128-c-spread"),
             Case("prefix-128-c-spread", spread, engine={"prefix_sharing": True, **wide, **fused_c},
                  baseline="width-128-c-spread")]
    return Suite(cases, [Check("prefix sharing tokens/s, prompts 2x responses", "tokens_per_s",
                               "prefix", "naive", ">=", 1.4),
                         Check("prefix sharing tokens/s, prompts 2x responses, widths of 128", "tokens_per_s",
                               "prefix-128", "width-128", ">=", 1.4),
                         Check("prefix sharing tokens/s, prompts 2x responses, fused head, widths of 128, compiled",
                               "tokens_per_s", "prefix-128-compiled", "width-128-compiled", ">=", 1.4),
                         Check("prefix sharing tokens/s, prompts 2x responses of their own lengths, compiled",
                               "tokens_per_s", "prefix-128-c-spread", "width-128-c-spread", ">=", 1.4)])


CPU_SEGMENTS = replace(CPU_SMALL, hidden=128, heads=2, kv_heads=1, intermediate=384, vocab=4096, prompt=64, response=64)

CPU_RUN = {"steps": 3, "warmup": 1}
# The headline target, against bench/peer_liger.py's results (bench/engine.py --peer PEER.json).
PEER_CHECKS = [Check(f"{v} vs torch+Liger tokens/s", "tokens_per_s", v, "peer:liger", ">=", 1.3)
               for v in ("fused-128", "fused-prefix-128", "lean-128", "fused-128-compiled", "lean-128-compiled",
                         "all-lean-compiled", "all-lean-compiled-limited", "all-lean-mlp4-c-overlap",
                         "all-lean-mlp4-c-o1-limited")]
PEER_CHECKS += [Check(f"{v} peak vs torch+Liger+checkpointing peak", "peak_gb", v, "peer:liger-ckpt", "<=", 1.0)
                for v in ("lean-128", "all-lean", "lean-128-compiled", "all-lean-compiled", "all-lean-compiled-limited",
                          "all-lean-mlp4-compiled", "all-lean-mlp4-c-overlap", "all-lean-mlp4-c-o1-limited")]

SUITES: dict[str, Suite] = {
    # The CPU sizes: every preset below its h200 twin, each finishing in about a minute on 2 idle cores.
    "cpu-small": Suite(_main_cases(CPU_SMALL, 2, 0.1), PEER_CHECKS, **CPU_RUN),
    "cpu-head": replace(_head_suite(CPU_SMALL, 4000, 32000, 1024, 256), **CPU_RUN),
    "cpu-segments": replace(_segment_suite(CPU_SEGMENTS, 2, 8, 2), **CPU_RUN),
    "cpu-prefix": replace(_prefix_suite(CPU_SMALL, 64), **CPU_RUN),
    # The reference shape and its targets (the lent H200).
    "h200": Suite(_main_cases(LLAMA_1B, 4, 5.0, (3.0, 3.5, 4.0)), PEER_CHECKS),
    "h200-head": _head_suite(LLAMA_1B, 32000, 256000, 8192, 1024),
    "h200-segments": _segment_suite(LLAMA_1B, 8, 32, 4),
    "h200-prefix": _prefix_suite(LLAMA_1B, 512),
    # LoRA at Mistral-7B's geometry: the default step and the lean recipe, each on the bf16 base and on a 4-bit one.
    "h200-7b": Suite(_lora_7b_cases(MISTRAL_7B, 20.0), steps=5, warmup=2),
    "cpu-7b": replace(Suite(_lora_7b_cases(CPU_SMALL, 0.1)), **CPU_RUN),
    # Mistral-7B's geometry at 4 pairs of 512 + 512 and of 1024 + 1024 (2048-token pairs): the shapes of
    # `bench/trainer.py --geometry mistral-7b --method full`'s fixed cases, for the peer's full-parameter runs.
    "mistral-7b": Suite([Case("naive", MISTRAL_7B), Case("naive-2048", replace(MISTRAL_7B, prompt=1024, response=1024))]),
}


def random_pair_tokens(shape: Shape, seed: int) -> tuple[list[list[int]], list[list[int]], list[list[int]]]:
    """(prompts, chosen, rejected) of uniform random token ids, seeded: the same batch in both benchmarks."""
    import numpy as np

    rng = np.random.default_rng(seed)
    n = shape.pairs
    prompts = [rng.integers(0, shape.vocab, p).tolist() for p in shape.prompt_lengths()]
    chosen = [rng.integers(0, shape.vocab, shape.response).tolist() for _ in range(n)]
    rejected = [rng.integers(0, shape.vocab, shape.response).tolist() for _ in range(n)]
    return prompts, chosen, rejected


def step_shapes(suite: Suite) -> dict[str, Shape]:
    """The distinct step shapes of a suite, keyed by a short label (what the peer runs on)."""
    out: dict[str, Shape] = {}
    for case in suite.cases:
        if case.kind == "step" and case.shape not in out.values():
            suffix = case.name.rsplit("-", 1)[-1] if case.name.rsplit("-", 1)[-1].startswith("L") else ""
            spread = f"S{case.shape.prompt_spread}" if case.shape.prompt_spread else ""
            out[suffix or f"P{case.shape.prompt}R{case.shape.response}{spread}"] = case.shape
    return out


def ratio_checks(checks: list[Check], results: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    """Each check's measured ratio and whether it meets its bound (None where a side was not measured)."""
    out = []
    for c in checks:
        num, den = results.get(c.numerator, {}), results.get(c.denominator, {})
        ratio = None
        if num.get(c.metric) is not None and den.get(c.metric):
            ratio = num[c.metric] / den[c.metric]
        met = None if ratio is None else (ratio <= c.bound if c.op == "<=" else ratio >= c.bound)
        out.append({"label": c.label, "metric": c.metric, "numerator": c.numerator, "denominator": c.denominator,
                    "target": f"{c.op} {c.bound}", "ratio": ratio, "met": met})
    return out


def _ratio(row: dict[str, Any], base: dict[str, Any], key: str) -> str:
    """row[key] / base[key] as a table cell, '-' where the baseline is missing or was not measured."""
    b = base.get(key)
    return f"{row[key] / b:>8.2f}" if b and row.get(key) is not None and not base.get("note") else f"{'-':>8}"


def format_table(rows: list[dict[str, Any]], title: str) -> str:
    """The table both benchmarks print: tokens/s, peak and extra memory, each with its ratio to the row's baseline.

    A row: name, path, tokens_per_s, peak_gb, extra_gb, step_s, baseline (name), note (why it failed), and
    optionally mfu (a column where any row has one).
    """
    by_name = {r["name"]: r for r in rows}
    with_mfu = any(r.get("mfu") is not None for r in rows)
    w = max([len("variant")] + [len(r["name"]) for r in rows]) + 1
    head = f"{'variant':<{w}}{'path':<24}{'tokens/s':>11}{'x base':>8}{'peak GB':>9}{'x base':>8}" \
           f"{'extra GB':>10}{'x base':>8}{'step s':>9}" + (f"{'MFU':>7}" if with_mfu else "")
    lines = [title, head, "-" * len(head)]
    for r in rows:
        if r.get("note"):
            lines.append(f"{r['name']:<{w}}{r['note']}")
            continue
        base = by_name.get(r.get("baseline") or "", {})
        x = {k: _ratio(r, base, k) for k in ("tokens_per_s", "peak_gb", "extra_gb")}
        lines.append(f"{r['name']:<{w}}{r['path']:<24}{r['tokens_per_s']:>11.0f}{x['tokens_per_s']}"
                     f"{r['peak_gb']:>9.3f}{x['peak_gb']}{r['extra_gb']:>10.3f}{x['extra_gb']}{r['step_s']:>9.3f}"
                     + ((f"{r['mfu']:>7.1%}" if r.get("mfu") is not None else f"{'-':>7}") if with_mfu else ""))
    return "\n".join(lines)


def format_checks(checks: list[dict[str, Any]]) -> str:
    """One line per target check."""
    lines = []
    for c in checks:
        measured = "not measured" if c["ratio"] is None else f"{c['ratio']:.2f}x ({'met' if c['met'] else 'NOT met'})"
        lines.append(f"  {c['label']} [{c['metric']}]: {measured}, target {c['target']}")
    return "\n".join(lines)


# In use on the device before a bench has done any work, beyond its own CUDA context: another process's.
BUSY_DEVICE_GB = 2.0


def warn_busy_device(used_gb: float | None) -> None:
    """Say on stderr when the device had more than BUSY_DEVICE_GB in use as the bench started: its memory and
    speed are then shared with something else (a run a `timeout` left behind, another job)."""
    if used_gb is not None and used_gb > BUSY_DEVICE_GB:
        print(f"warning: the device had {used_gb:.1f} GB in use before this bench started (another process?): "
              "its times and peaks may not be this run's alone", file=sys.stderr, flush=True)
