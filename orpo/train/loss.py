"""The ORPO objective (Hong et al. 2024) on per-row mean response log-probs; no model in here."""

from __future__ import annotations

import math

import mlx.core as mx
import mlx.nn as nn

_LN_HALF = -math.log(2.0)


def log1mexp(x: mx.array) -> mx.array:
    """log(1 - exp(x)) for x < 0, stable at both ends (Maechler's two-branch form).

    Each branch gets a clamped input so the branch `where` discards never produces inf/NaN, whose
    gradient would otherwise poison the one it keeps.
    """
    x = mx.minimum(x, -1e-12)
    near = x > _LN_HALF
    x_near = mx.where(near, x, _LN_HALF)
    x_far = mx.where(near, _LN_HALF, x)
    return mx.where(near, mx.log(-mx.expm1(x_near)), mx.log1p(-mx.exp(x_far)))


def orpo_terms(logp_chosen: mx.array, logp_rejected: mx.array) -> tuple[mx.array, mx.array, mx.array]:
    """Per row: (nll, or_loss, log_odds) from mean response log-probs l_w, l_r.

    log_odds = (l_w - l_r) - (log1mexp(l_w) - log1mexp(l_r)); or_loss = -log sigmoid(log_odds); nll = -l_w.
    """
    log_odds = (logp_chosen - logp_rejected) - (log1mexp(logp_chosen) - log1mexp(logp_rejected))
    or_loss = -nn.log_sigmoid(log_odds)
    return -logp_chosen, or_loss, log_odds


def orpo_loss(logp_chosen: mx.array, logp_rejected: mx.array, lam: float) -> tuple[mx.array, dict[str, mx.array]]:
    """Batch mean of NLL(chosen) + lambda * L_OR, and the metrics the trainer logs."""
    nll, or_loss, log_odds = orpo_terms(logp_chosen, logp_rejected)
    loss = (nll + lam * or_loss).mean()
    metrics = {
        "loss": loss,
        "nll": nll.mean(),
        "or_loss": or_loss.mean(),
        "log_odds": log_odds.mean(),
        "logp_chosen": logp_chosen.mean(),
        "logp_rejected": logp_rejected.mean(),
        "accuracy": (logp_chosen > logp_rejected).astype(mx.float32).mean(),
        "margin": (logp_chosen - logp_rejected).mean(),
    }
    return loss, metrics
