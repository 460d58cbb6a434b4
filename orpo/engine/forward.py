"""Each supported family's decoder layer, run from the layer's own parts with explicit positions and attention.

Prefix-shared rows need per-token RoPE positions and masks mlx-lm's layers do not take, so the engine calls
each layer's projections, norms, rope and MLP itself, in mlx-lm's order and with its mx.fast ops; nothing is
assigned onto mlx-lm's modules. On plain rows the hidden states are bit-identical to mlx-lm's
(tests/test_engine_stack.py). `check_mlx_lm` refuses mlx-lm versions outside MLX_LM_TESTED, `check_parts`
a model lacking what is called here.
"""

from __future__ import annotations

import importlib.metadata
import operator
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models import gemma3_text
from packaging.specifiers import SpecifierSet

from orpo.device import on_cuda
from orpo.engine.attention import attend

# The mlx-lm versions whose layers this module mirrors (the same range as pyproject's pin).
MLX_LM_TESTED = ">=0.32.2,<0.33"


class UnsupportedModel(ValueError):
    """The model's family (or the installed mlx-lm) has no forward here."""


def mlx_lm_version_supported(version: str) -> bool:
    """Whether an mlx-lm version is in MLX_LM_TESTED."""
    return SpecifierSet(MLX_LM_TESTED).contains(version, prereleases=True)


@lru_cache(maxsize=1)
def check_mlx_lm() -> str:
    """The installed mlx-lm version, refused (UnsupportedModel) outside MLX_LM_TESTED."""
    version = importlib.metadata.version("mlx-lm")
    if not mlx_lm_version_supported(version):
        raise UnsupportedModel(f"train.engine: mlx-lm {version} is installed; the engine's forward mirrors the "
                               f"layers of mlx-lm {MLX_LM_TESTED} (install one of those, or use the naive "
                               "engine: head naive, segment_layers 0, prefix_sharing false)")
    return version


@dataclass(frozen=True)
class Family:
    """How one family's decoder layer differs from Llama's.

    `qk_norm`: per-head RMS norms of queries and keys, on [B, L, heads, D] ("heads", qwen3) or on [B, heads, L, D]
    ("transposed", gemma3). `softcap`: gemma2's own attention. `sandwich`: norms after the attention and the MLP
    too. `residual`: the residual add. `layer_reads`, `model_reads`: what else the stack reads (sliding windows).
    """

    qk_norm: str | None = None
    softcap: bool = False
    sandwich: bool = False
    residual: Callable[[mx.array, mx.array], mx.array] = operator.add
    layer_reads: tuple[str, ...] = ()
    model_reads: tuple[str, ...] = ()

    def parts(self) -> tuple[str, ...]:
        """The layer attributes this family's forward reads (dotted paths from a decoder layer)."""
        names = ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "self_attn.rope",
                 "self_attn.scale", "self_attn.n_heads", "self_attn.n_kv_heads", "mlp", "input_layernorm",
                 "post_attention_layernorm"]
        if self.qk_norm:
            names += ["self_attn.q_norm", "self_attn.k_norm"]
        if self.softcap:
            names += ["self_attn.repeats", "self_attn.head_dim", "self_attn.attn_logit_softcapping"]
        if self.sandwich:
            names += ["pre_feedforward_layernorm", "post_feedforward_layernorm"]
        return (*names, *self.layer_reads)


# mlx-lm module name -> its family's forward ("mistral" is served by mlx_lm.models.llama).
FAMILIES: dict[str, Family] = {
    "llama": Family(layer_reads=("use_sliding",), model_reads=("sliding_window",)),
    "qwen2": Family(),
    "qwen3": Family(qk_norm="heads"),
    "gemma": Family(),
    "gemma2": Family(softcap=True, sandwich=True),
    # gemma3's residual add is mlx-lm's own, looked up per call: check_parts names it where it is missing.
    "gemma3_text": Family(qk_norm="transposed", sandwich=True, residual=lambda x, y: gemma3_text.clip_residual(x, y),
                          model_reads=("sliding_window_pattern", "window_size")),
}


def family_of(model: nn.Module) -> str:
    """The supported family an mlx-lm model belongs to (by the module its class comes from)."""
    family = type(model).__module__.rsplit(".", 1)[-1]
    if family not in FAMILIES or not hasattr(model, "model"):
        kind = getattr(getattr(model, "args", None), "model_type", type(model).__name__)
        raise UnsupportedModel(f"train.engine: model type {kind!r} has no forward here "
                               f"(supported: {', '.join(FAMILIES)}, mistral); use the plain engine")
    return family


def _has(obj: Any, path: str) -> bool:
    for name in path.split("."):
        if not hasattr(obj, name):
            return False
        obj = getattr(obj, name)
    return True


def missing_parts(model: nn.Module, family: str) -> list[str]:
    """What of the parts `family`'s forward reads the model lacks (its first decoder layer's and its own)."""
    inner = model.model
    wanted = ["embed_tokens", "layers", "norm", "args.hidden_size", *FAMILIES[family].model_reads]
    missing = [f"model.{p}" for p in wanted if not _has(inner, p)]
    if missing or not inner.layers:
        return missing or ["model.layers (empty)"]
    if family == "gemma3_text" and not hasattr(gemma3_text, "clip_residual"):
        missing.append("mlx_lm.models.gemma3_text.clip_residual")
    return missing + [f"model.layers.0.{p}" for p in FAMILIES[family].parts() if not _has(inner.layers[0], p)]


def check_parts(model: nn.Module, family: str) -> None:
    """Refuse (UnsupportedModel) a model lacking what its family's forward calls, naming the parts."""
    missing = missing_parts(model, family)
    if missing:
        raise UnsupportedModel(f"train.engine: this {family} model lacks {', '.join(missing)}, which the engine's "
                               f"forward calls (mlx-lm {importlib.metadata.version('mlx-lm')}); use the naive engine")


def rope_at(rope: nn.Module, x: mx.array, positions: mx.array | None) -> mx.array:
    """The module's own RoPE of x [B, heads, L, D] at each token's position (`positions` [B*L]; None: 0..L-1).

    mx.fast.rope takes one offset per leading row, so x is viewed as B*L rows of one token (a free reshape) and
    rotated with offsets = the positions: the module's own rope (any variant) at every position.
    """
    if positions is None:
        return rope(x)
    b, h, length, d = x.shape
    rows = x.transpose(0, 2, 1, 3).reshape(b * length, h, 1, d)
    step = rope_rows_per_call(getattr(rope, "dims", d), h, on_cuda())
    if step is None or step >= len(rows):
        out = rope(rows, offset=positions)
    else:
        out = mx.concatenate([rope(rows[i:i + step], offset=positions[i:i + step]) for i in range(0, len(rows), step)])
    return out.reshape(b, length, h, d).transpose(0, 2, 1, 3)


def rope_rows_per_call(dims: int, heads: int, cuda: bool) -> int | None:
    """How many one-token rows one mx.fast.rope call may rotate (None: any number). MLX 0.32's CUDA rope gives
    rows of fewer than 32 rotated dims a thread block deeper than CUDA's limit of 64 once rows x ceil(heads / 4)
    reaches 128, and the launch fails."""
    return 64 // -(-heads // 4) or 1 if cuda and dims < 32 else None


def softcapped_attention(attn: nn.Module, queries: mx.array, keys: mx.array, values: mx.array,
                         mask: mx.array | None) -> mx.array:
    """gemma2's attention as mlx-lm computes it: scores soft-capped before the softmax, GQA by broadcasting (a
    per-row mask [B, 1, L, keys] then broadcast over the repeats too)."""
    b, _, length, _ = queries.shape
    queries = queries * attn.scale
    if attn.repeats > 1:
        queries = queries.reshape(b, attn.n_kv_heads, attn.repeats, length, attn.head_dim)
        keys, values = mx.expand_dims(keys, 2), mx.expand_dims(values, 2)
        if mask is not None and mask.ndim == 4:
            mask = mask[:, :, None]
    scores = queries @ keys.swapaxes(-1, -2)
    cap = attn.attn_logit_softcapping
    scores = mx.tanh(scores / cap)
    scores *= cap
    if mask is not None:
        if mask.dtype == mx.bool_:
            scores = mx.where(mask, scores, mx.array(mx.finfo(scores.dtype).min, scores.dtype))
        else:
            scores = scores + mask
    out = mx.softmax(scores, precise=True, axis=-1) @ values
    return out.reshape(b, attn.n_heads, length, attn.head_dim) if attn.repeats > 1 else out


@dataclass(eq=False)
class KVCache:
    """One layer's keys and values [B, kv heads, capacity, D] in batched generation, filled to `offset`, and
    `bias` [B, 1, L, keys]: what this forward's queries may see (left padding, causality, the layer's window),
    additive, set by the caller before each forward."""

    keys: mx.array | None = None
    values: mx.array | None = None
    offset: int = 0
    bias: mx.array | None = None

    def update(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        """This forward's keys and values written at `offset`; every key and value so far returned."""
        n = keys.shape[2]
        if self.keys is None:
            self.keys, self.values = keys, values
        else:  # in place: the cache's buffers are donated to the update
            self.keys[:, :, self.offset:self.offset + n] = keys
            self.values[:, :, self.offset:self.offset + n] = values
        self.offset += n
        return self.keys[:, :, :self.offset], self.values[:, :, :self.offset]


def decode_attention(queries: mx.array, keys: mx.array, values: mx.array, scale: float, bias: mx.array,
                     softcap: float | None = None) -> mx.array:
    """Attention of one query a row (q [B, H, 1, D]) over cached keys under an additive `bias` [B, 1, 1, keys].

    A key head's query heads are one matmul's rows, so each cached key is read once; mx.fast's attention with
    an array mask runs MLX's unfused fallback on CUDA, which broadcasts the keys to every query head.
    """
    b, h, _, d = queries.shape
    kv = keys.shape[1]
    scores = (queries * scale).reshape(b, kv, h // kv, d) @ keys.swapaxes(-1, -2)
    if softcap is not None:  # gemma2's, in mlx-lm's order
        scores = mx.tanh(scores / softcap) * softcap
    out = mx.softmax(scores + bias, axis=-1, precise=True) @ values
    return out.reshape(b, h, 1, values.shape[-1])


def attention(family: Family, attn: nn.Module, x: mx.array, mask: Any, positions: mx.array | None,
              ordered: bool = False) -> mx.array:
    """A layer's self-attention of x [B, L, H] under `mask` and `ordered` (as `attend` takes them; a KVCache in
    generation), RoPE at `positions`."""
    b, length, _ = x.shape
    queries = attn.q_proj(x).reshape(b, length, attn.n_heads, -1)
    keys = attn.k_proj(x).reshape(b, length, attn.n_kv_heads, -1)
    values = attn.v_proj(x).reshape(b, length, attn.n_kv_heads, -1).transpose(0, 2, 1, 3)
    if family.qk_norm == "heads":
        queries, keys = attn.q_norm(queries), attn.k_norm(keys)
    queries, keys = queries.transpose(0, 2, 1, 3), keys.transpose(0, 2, 1, 3)
    if family.qk_norm == "transposed":
        queries, keys = attn.q_norm(queries), attn.k_norm(keys)
    queries, keys = rope_at(attn.rope, queries, positions), rope_at(attn.rope, keys, positions)
    if isinstance(mask, KVCache):
        keys, values = mask.update(keys, values)
        mask = mask.bias
        if length == 1:
            cap = attn.attn_logit_softcapping if family.softcap else None
            out = decode_attention(queries, keys, values, attn.scale, mask, cap)
            return attn.o_proj(out.transpose(0, 2, 1, 3).reshape(b, length, -1))
    if family.softcap:
        out = softcapped_attention(attn, queries, keys, values, mask)
    else:
        out = attend(queries, keys, values, attn.scale, mask, ordered)
    return attn.o_proj(out.transpose(0, 2, 1, 3).reshape(b, length, -1))


def decoder_layer(family: Family, layer: nn.Module, x: mx.array, mask: Any, positions: mx.array | None,
                  mlp: Callable[[mx.array], mx.array], ordered: bool = False) -> mx.array:
    """One decoder layer of x [B, L, H]: attention under `mask` at `positions` (`ordered`: as `attend` takes it),
    then `mlp` (the layer's, or a stand-in computing the same, orpo.engine.tiled), with the family's norms and
    residual adds."""
    add = family.residual
    r = attention(family, layer.self_attn, layer.input_layernorm(x), mask, positions, ordered)
    if family.sandwich:
        h = add(x, layer.post_attention_layernorm(r))
        return add(h, layer.post_feedforward_layernorm(mlp(layer.pre_feedforward_layernorm(h))))
    h = add(x, r)
    return add(h, mlp(layer.post_attention_layernorm(h)))


def run_layers(family: Family, layers: Sequence[nn.Module], h: mx.array, masks: Sequence[Any],
               positions: mx.array | None, mlps: Sequence[Callable[[mx.array], mx.array]] | None = None,
               ordered: bool = False) -> mx.array:
    """`layers` in order on h, layer i under masks[i] and mlps[i] (else its own mlp); positions [B, L] or None."""
    flat = None if positions is None else positions.reshape(-1)
    for i, layer in enumerate(layers):
        h = decoder_layer(family, layer, h, masks[i], flat, layer.mlp if mlps is None else mlps[i], ordered)
    return h
