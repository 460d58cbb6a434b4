"""Log-prob heads: the naive one (full logits) and the fused one (flash-CCE: no [tokens, vocab] logits).

The fused head runs token chunks, chained (`queue.after`) so a fixed few [chunk, V] blocks are alive at once
(a vocab-block online softmax kept every block alive in MLX); its analytic vjp recomputes each block from the
saved logsumexp. Matmuls in the head's dtype, as the model's layer does; softmax math in float32.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from functools import cache

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

from orpo.engine.queue import EvalQueue, after

# Model-args fields with which an mlx-lm family scales its logits beyond head(model.model(x)) [+ softcap]
# (cohere, granite, minicpm, falcon_h1, ...): the fused head would score different logits, so refuse.
_LOGIT_SCALING_ARGS = ("logit_scale", "logits_scaling", "dim_model_base", "output_multiplier", "lm_head_multiplier")


@dataclass(frozen=True, eq=False)
class LMHead:
    """An output projection: logits = softcap(h W^T + bias), W float [V, H] or quantized (packed).

    `path`: the weight's module path in the model; `trainable`: whether the fused head also returns gradients for
    the weight (and bias), as the model's own layer would.
    """

    weight: mx.array
    scales: mx.array | None = None
    biases: mx.array | None = None
    group_size: int | None = None
    bits: int | None = None
    softcap: float | None = None
    mode: str = "affine"
    bias: mx.array | None = None  # output bias [V], for heads that have one
    trainable: bool = False
    path: str = "lm_head"

    @property
    def quantized(self) -> bool:
        return self.scales is not None

    @property
    def vocab_size(self) -> int:
        return self.weight.shape[0]

    @property
    def hidden_size(self) -> int:
        return self.weight.shape[1] * 32 // self.bits if self.quantized else self.weight.shape[1]

    def project(self, h: mx.array) -> mx.array:
        """Raw logits h W^T (+ bias) in the head's dtype, computed exactly as the model's layer does."""
        if self.quantized:
            out = mx.quantized_matmul(h, self.weight, scales=self.scales, biases=self.biases, transpose=True,
                                      group_size=self.group_size, bits=self.bits, mode=self.mode)
            return out if self.bias is None else out + self.bias
        # nn.Linear adds its bias inside addmm, QuantizedLinear after its matmul
        return h @ self.weight.T if self.bias is None else mx.addmm(self.bias, h, self.weight.T)

    def dequantized(self) -> LMHead:
        """This head with a float weight (a quantized one dequantized in its scales' dtype): the fused head's
        chunks then run plain matmuls, many times faster than quantized ones over thousands of rows
        (orpo.engine.quantized)."""
        if not self.quantized:
            return self
        w = mx.dequantize(self.weight, self.scales, self.biases, self.group_size, self.bits, mode=self.mode)
        return replace(self, weight=w, scales=None, biases=None, group_size=None, bits=None)


def _apply_softcap(x: mx.array, cap: float | None) -> mx.array:
    return x if cap is None else mx.tanh(x / cap) * cap  # mlx-lm's order of operations


def head_logits(head: LMHead, h: mx.array) -> mx.array:
    """Naive full logits [..., V] incl. the softcap: exactly what model(...) returns for final hidden h."""
    return _apply_softcap(head.project(h), head.softcap)


def mean_logps_from_logits(logits: mx.array, targets: mx.array, scored: mx.array) -> mx.array:
    """Masked mean over positions of log softmax(logits)[target], computed in float32; shape [N]."""
    logits = logits.astype(mx.float32)
    scored = scored.astype(mx.float32)
    target_logits = mx.take_along_axis(logits, targets[..., None], axis=-1).squeeze(-1)
    logp = target_logits - mx.logsumexp(logits, axis=-1)
    return (logp * scored).sum(axis=-1) / mx.maximum(scored.sum(axis=-1), 1.0)


def response_mean_logps(model: nn.Module, tokens: mx.array, mask: mx.array) -> mx.array:
    """The naive head through the model's own forward: the masked mean log-prob per row of full [N, T, V]
    logits; `mask[i, t] = 1` when token t of row i is scored (predicted from position t-1)."""
    return mean_logps_from_logits(model(tokens[:, :-1]), tokens[:, 1:], mask[:, 1:])


def token_logp(head: LMHead, h: mx.array, targets: mx.array, fused: bool = True, chunk: int = 0) -> mx.array:
    """log p(target) [M] float32 of final hidden states h [M, H]: the fused head, or the naive head's full logits."""
    if fused:
        return fused_logp(head, h, targets, chunk)
    logits = head_logits(head, h).astype(mx.float32)
    return mx.take_along_axis(logits, targets[:, None], axis=-1)[:, 0] - mx.logsumexp(logits, axis=-1)


def _trains(module: nn.Module, where: str, quantized: bool) -> bool:
    """Whether a head trains: a float head's weight (and bias, if any) together, or neither; a quantized one never."""
    names = [k for k, _ in tree_flatten(module.trainable_parameters())]
    if names and quantized:
        raise ValueError(f"{where} has trainable parameters ({', '.join(names)}): a quantized head cannot be trained; "
                         "freeze it (train.full.freeze) or train a float model")
    owned = {"weight"} | ({"bias"} if "bias" in module else set())
    if names and set(names) != owned:
        raise ValueError(f"{where}: trainable {sorted(names)} but not {sorted(owned - set(names))}: the fused head "
                         "trains the weight and bias together; freeze or unfreeze the whole module")
    return bool(names)


def lm_head_of(model: nn.Module) -> LMHead:
    """The output projection of an mlx-lm model (lm_head or the tied embedding) and its final softcap."""
    name = type(model).__module__.rsplit(".", 1)[-1]
    args = getattr(model, "args", None)
    for field in _LOGIT_SCALING_ARGS:
        if getattr(args, field, None) is not None:
            raise ValueError(f"model type {name!r} scales its logits (args.{field}); the fused head does not "
                             "support it; use train.engine.head: naive")
    tied_flag = getattr(model, "tie_word_embeddings", getattr(args, "tie_word_embeddings", False))
    if "lm_head" in model and not tied_flag:
        module, where, path = model["lm_head"], "lm_head", "lm_head"
    else:
        module = getattr(getattr(model, "model", None), "embed_tokens", None)
        where, path = "model.embed_tokens (tied)", "model.embed_tokens"
        if module is None:
            raise ValueError(f"model type {name!r}: no output projection found (looked for lm_head and a "
                             "tied model.embed_tokens)")
    cap = getattr(model, "final_logit_softcapping", getattr(args, "final_logit_softcapping", None))
    cap = float(cap) if cap else None  # mlx-lm treats 0/None as no cap
    if isinstance(module, (nn.QuantizedLinear, nn.QuantizedEmbedding)):
        _trains(module, where, quantized=True)
        return LMHead(module["weight"], module["scales"], module.get("biases"), module.group_size, module.bits,
                      cap, module.mode, module.get("bias"), path=path)
    if isinstance(module, (nn.Linear, nn.Embedding)):
        return LMHead(module["weight"], softcap=cap, bias=module.get("bias"),
                      trainable=_trains(module, where, quantized=False), path=path)
    raise ValueError(f"{where} is a {type(module).__name__} (e.g. an adapter on the head): the fused head needs "
                     "a frozen Linear/Embedding or their quantized forms; use train.engine.head: naive")


@cache
def _forward_block(cap: float | None) -> Callable:
    """Compiled: raw logit block [c, V] and targets [c] -> (logp, logsumexp) in float32."""

    def block(x: mx.array, targets: mx.array) -> tuple[mx.array, mx.array]:
        z = _apply_softcap(x.astype(mx.float32), cap)
        lse = mx.logsumexp(z, axis=-1)
        return mx.take_along_axis(z, targets[:, None], axis=-1)[:, 0] - lse, lse

    return mx.compile(block)


@cache
def _grad_block(cap: float | None, float32: bool = False) -> Callable:
    """Compiled: d(g_logp * logp + g_lse * lse)/dx for one raw logit block, in the block's dtype (or float32)."""

    def block(x: mx.array, lse: mx.array, targets: mx.array, g: mx.array, g_lse: mx.array) -> mx.array:
        xf = x.astype(mx.float32)
        th = None if cap is None else mx.tanh(xf / cap)
        z = xf if th is None else th * cap
        p = mx.exp(z - lse[:, None])
        onehot = mx.arange(x.shape[-1])[None, :] == targets[:, None]
        # d logp/dz = onehot - p and d lse/dz = p, so the sum is g*onehot - p*(g - g_lse)
        dz = mx.where(onehot, g[:, None], 0.0) - p * (g - g_lse)[:, None]
        if cap is not None:
            dz = dz * (1.0 - th * th)
        return dz if float32 else dz.astype(x.dtype)  # the naive path's cotangent on the logits has their dtype too

    return mx.compile(block)


def _logp_chunks(head: LMHead, h: mx.array, targets: mx.array, chunk: int,
                 queue: EvalQueue | None) -> tuple[mx.array, mx.array]:
    """(logp, logsumexp) [M] chunk by chunk: chained for a lazy graph (queue None), or each chunk pushed to `queue`."""
    forward = _forward_block(head.softcap)
    logp, lse = [], []
    for s in range(0, h.shape[0], chunk):
        x = head.project(h[s : s + chunk] if queue is not None else after(h[s : s + chunk], logp[-1:] + lse[-1:]))
        lp, ls = forward(x, targets[s : s + chunk])
        if queue is not None:
            queue.push(lp, ls)
        logp.append(lp)
        lse.append(ls)
    if queue is not None:
        queue.drain()
    return mx.concatenate(logp), mx.concatenate(lse)


@dataclass(frozen=True)
class HeadGrads:
    """Cotangents of the fused head's inputs: the hidden states [M, H] and, for a trainable head, weight and bias."""

    hidden: mx.array
    weight: mx.array | None = None
    bias: mx.array | None = None

    def by_name(self, head: LMHead) -> dict[str, mx.array]:
        """The head's parameter cotangents under their paths in the model (empty for a frozen head)."""
        named = {f"{head.path}.weight": self.weight, f"{head.path}.bias": self.bias}
        return {k: v for k, v in named.items() if v is not None}


def _cotangents(head: LMHead, h: mx.array, targets: mx.array, lse: mx.array, g: mx.array, g_lse: mx.array,
                chunk: int, queue: EvalQueue | None) -> HeadGrads:
    """Cotangents of sum(g * logp + g_lse * lse) for a float (dequantized) head, each chunk's logit block
    recomputed (the forward kept none).

    A trainable head's block gives its float32 dz once: dz W (in the head's dtype) for h, and dz^T h added to a
    float32 [V, H] accumulator (float32 operands: no chunk's part is rounded before the sum).
    """
    backward = _grad_block(head.softcap, float32=head.trainable)
    dh = []
    dw = mx.zeros(head.weight.shape, mx.float32) if head.trainable else None
    db = mx.zeros(head.bias.shape, mx.float32) if head.trainable and head.bias is not None else None
    for s in range(0, h.shape[0], chunk):
        e = slice(s, s + chunk)
        # Chained on every use of the previous block's dz, so it is freed before this block is built.
        hc = h[e] if queue is not None else after(h[e], ([] if dw is None else [dw]) + dh[-1:])
        x = head.project(hc)
        dz = backward(x, lse[e], targets[e], g[e], g_lse[e])
        d = (dz if dw is None else dz.astype(x.dtype)) @ head.weight
        if dw is not None:
            dw = mx.addmm(dw, dz.T, hc.astype(mx.float32))
        if db is not None:
            db = db + dz.sum(axis=0)
        if queue is not None:
            queue.push(d, *(a for a in (dw, db) if a is not None))
        dh.append(d)
    if queue is not None:
        queue.drain()
    return HeadGrads(mx.concatenate(dh).astype(h.dtype), None if dw is None else dw.astype(head.weight.dtype),
                     None if db is None else db.astype(head.bias.dtype))


def _fused(head: LMHead, chunk: int) -> Callable:
    """The custom function (h [M, H], targets [M]) -> (logp, logsumexp), with its chunked analytic vjp.

    A trainable head's weight (and bias) are primals too, so the vjp returns their cotangents and autodiff adds
    them to the weight's other uses (a tied embedding's lookup).
    """
    head = head.dequantized()
    params = [head.weight, *([] if head.bias is None else [head.bias])] if head.trainable else []

    def bound(params: list[mx.array]) -> LMHead:
        return replace(head, weight=params[0], bias=params[1] if len(params) > 1 else None) if params else head

    @mx.custom_function
    def logp_lse(h: mx.array, targets: mx.array, *params: mx.array) -> tuple[mx.array, mx.array]:
        return _logp_chunks(bound(params), h, targets, chunk, None)

    @logp_lse.vjp
    def logp_lse_vjp(primals, cotangents, outputs):
        h, targets, *params = primals
        g, g_lse = (c.astype(mx.float32) for c in cotangents)
        grads = _cotangents(bound(params), h, targets, outputs[1], g, g_lse, chunk, None)
        if not params:
            return grads.hidden, None
        no_grad = mx.zeros_like(targets)  # a None before other cotangents would shift them (MLX 0.32)
        return (grads.hidden, no_grad, *(a for a in (grads.weight, grads.bias) if a is not None))

    return lambda h, targets: logp_lse(h, targets, *params)


def fused_logp_eager(head: LMHead, h: mx.array, targets: mx.array, chunk: int,
                     overlap: int = 0) -> tuple[mx.array, Callable[[mx.array], HeadGrads]]:
    """(logp [M], grad_fn): the fused head evaluated chunk by chunk, outside autodiff (the segmented backward),
    `overlap` chunks in flight at once; grad_fn(g) maps a cotangent on logp [M] to HeadGrads, also chunk by chunk.
    """
    chunk, head = chunk_for(head.vocab_size, chunk), head.dequantized()
    logp, lse = _logp_chunks(head, h, targets, chunk, EvalQueue(overlap))

    def grad_fn(g: mx.array) -> HeadGrads:
        g = g.astype(mx.float32)
        return _cotangents(head, h, targets, lse, g, mx.zeros_like(g), chunk, EvalQueue(overlap))

    return logp, grad_fn


# Auto chunking: about this many logits per [chunk, V] block (2^25 float32 = 128 MB), so the head's
# peak stays the same whatever the vocabulary (a fixed token count per chunk grows with V; bench/README.md).
AUTO_BLOCK_LOGITS = 2**25


def chunk_for(vocab_size: int, chunk: int) -> int:
    """Tokens per chunk: `chunk` itself, or for 0 (auto) the count whose [chunk, V] block holds ~2^25 logits."""
    return chunk if chunk != 0 else max(16, AUTO_BLOCK_LOGITS // vocab_size // 16 * 16)


def fused_logp(head: LMHead, h: mx.array, targets: mx.array, chunk: int = 1024) -> mx.array:
    """log softmax(softcap(h W^T))[target] per token, float32, token-chunked; differentiable w.r.t. h (and the
    head's weight and bias where the head is trainable).

    h [..., H] (any float dtype) and targets [...] (int) give logp [...]. The backward recomputes one
    [chunk, V] block at a time (chunk 0: `chunk_for`'s vocabulary-scaled size).
    """
    chunk = chunk_for(head.vocab_size, chunk)
    if h.ndim < 1 or h.shape[-1] != head.hidden_size:
        raise ValueError(f"fused_logp: h has shape {tuple(h.shape)}, expected [..., {head.hidden_size}] "
                         "(the head's hidden size)")
    if targets.shape != h.shape[:-1]:
        raise ValueError(f"fused_logp: targets has shape {tuple(targets.shape)}, expected {tuple(h.shape[:-1])} "
                         "(h's leading shape)")
    if not mx.issubdtype(h.dtype, mx.floating) or not mx.issubdtype(targets.dtype, mx.integer):
        raise ValueError(f"fused_logp: h must be float and targets int, got {h.dtype} and {targets.dtype}")
    if chunk < 1:
        raise ValueError(f"fused_logp: chunk must be >= 1, got chunk={chunk}")
    lead = h.shape[:-1]
    flat_h, flat_t = h.reshape(-1, h.shape[-1]), targets.reshape(-1)
    if flat_h.shape[0] == 0:
        return mx.zeros(lead, dtype=mx.float32)
    logp, _ = _fused(head, chunk)(flat_h, flat_t)
    return logp.reshape(lead)
