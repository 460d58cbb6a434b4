"""Log-prob heads: mean log-prob of the scored (response) tokens of each row."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn


def mean_logps_from_logits(logits: mx.array, targets: mx.array, scored: mx.array) -> mx.array:
    """Masked mean over positions of log softmax(logits)[target], computed in float32; shape [N]."""
    logits = logits.astype(mx.float32)
    scored = scored.astype(mx.float32)
    target_logits = mx.take_along_axis(logits, targets[..., None], axis=-1).squeeze(-1)
    logp = target_logits - mx.logsumexp(logits, axis=-1)
    return (logp * scored).sum(axis=-1) / mx.maximum(scored.sum(axis=-1), 1.0)


def response_mean_logps(model: nn.Module, tokens: mx.array, mask: mx.array) -> mx.array:
    """Naive head: full [N, T, V] logits, then the masked mean log-prob per row.

    `mask[i, t] = 1` when token t of row i is a scored response token (predicted from position t-1).
    """
    return mean_logps_from_logits(model(tokens[:, :-1]), tokens[:, 1:], mask[:, 1:])
