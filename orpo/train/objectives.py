"""Preference objectives as pure functions of per-sequence response log-probs (train.objective).

Every engine path gives the mean response log-probs l_w, l_r (chosen, rejected), the scored-token counts (so
the summed log-probs s = l * count) and, where train.nll_span says so, the chosen sequence's mean log-prob
over its NLL span; so each engine setting serves each objective:

- orpo (Hong et al. 2024): NLL(chosen) + λ · -log σ(log odds(l_w) - log odds(l_r)).
- simpo (Meng et al. 2024): -log σ(β (l_w - l_r) - γ), no NLL term.
- orpo_margin: NLL(chosen) + λ · SimPO's term; sft_simpo: NLL(chosen) + SimPO's term.
- dpo (Rafailov et al. 2023): -log σ(β_dpo ((s_w - s_w_ref) - (s_r - s_r_ref))) on summed log-probs, the
  reference's from the model with its LoRA adapters off (full-parameter training: a frozen copy).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import mlx.core as mx
import mlx.nn as nn

OBJECTIVES = ("orpo", "simpo", "orpo_margin", "sft_simpo", "dpo")
# The objectives whose preference term λ weights (train.lambda, or the controller's λ).
LAMBDA_WEIGHTED = ("orpo", "orpo_margin")


@dataclass(frozen=True)
class Objective:
    """What the loss is (train.objective, beta, gamma, dpo_beta); hashable, so a compiled step is keyed by it."""

    name: str = "orpo"
    beta: float = 2.0
    gamma: float = 1.0
    dpo_beta: float = 0.1

    @property
    def needs_reference(self) -> bool:
        """Whether the loss compares with a reference model's log-probs (one extra forward, no gradient)."""
        return self.name == "dpo"

    @classmethod
    def of(cls, s) -> Objective:
        """The objective a TrainSettings names."""
        return cls(s.objective, s.beta, s.gamma, s.dpo_beta)


@dataclass(frozen=True)
class PairLoss:
    """One step's loss: the objective, this step's λ (a number, or a scalar array under mx.compile) and, for
    dpo, the reference mean log-probs [2B] of its sequences (chosen rows, then rejected)."""

    objective: Objective
    lam: float | mx.array
    ref: mx.array | None = None


def pair_loss_of(loss: PairLoss | float) -> PairLoss:
    """`loss` as a PairLoss: a bare number is ORPO's λ."""
    return loss if isinstance(loss, PairLoss) else PairLoss(Objective(), loss)


# --- the terms ---

_LN_HALF = -math.log(2.0)


def log1mexp(x: mx.array) -> mx.array:
    """log(1 - exp(x)) for x < 0, stable at both ends (Maechler's two-branch form); each branch's input is
    clamped so the branch `where` discards makes no inf/NaN to poison the gradient."""
    x = mx.minimum(x, -1e-12)
    near = x > _LN_HALF
    x_near = mx.where(near, x, _LN_HALF)
    x_far = mx.where(near, _LN_HALF, x)
    return mx.where(near, mx.log(-mx.expm1(x_near)), mx.log1p(-mx.exp(x_far)))


def orpo_terms(logp_chosen: mx.array, logp_rejected: mx.array,
               nll_logp: mx.array | None = None) -> tuple[mx.array, mx.array, mx.array]:
    """Per row: (nll, or_loss, log_odds) from mean response log-probs l_w, l_r: log_odds = (l_w - l_r) -
    (log1mexp(l_w) - log1mexp(l_r)); or_loss = -log sigmoid(log_odds); nll = -l_w, or -nll_logp where given."""
    log_odds = (logp_chosen - logp_rejected) - (log1mexp(logp_chosen) - log1mexp(logp_rejected))
    or_loss = -nn.log_sigmoid(log_odds)
    return -logp_chosen if nll_logp is None else -nll_logp, or_loss, log_odds


# --- the loss ---


def orpo_loss(logp_chosen: mx.array, logp_rejected: mx.array, lam: float | mx.array,
              nll_logp: mx.array | None = None) -> tuple[mx.array, dict[str, mx.array]]:
    """Batch mean of NLL(chosen) + lambda * L_OR, and the metrics the trainer logs.

    The NLL is -logp_chosen (the paper's L_SFT: the response's mean log-prob), or -nll_logp where given (the
    chosen sequence's mean log-prob over the span train.nll_span names); the odds ratio always compares responses.
    """
    nll, or_loss, log_odds = orpo_terms(logp_chosen, logp_rejected, nll_logp)
    loss = (nll + lam * or_loss).mean()
    return loss, _metrics(loss, nll, or_loss, log_odds, logp_chosen, logp_rejected)


def pair_objective(loss: PairLoss | float, logps: mx.array, counts: mx.array,
                   nll_logp: mx.array | None = None) -> tuple[mx.array, dict[str, mx.array]]:
    """Batch mean of `loss`'s objective over n pairs and the metrics the trainer logs.

    `logps` [2n] mean response log-probs (chosen, then rejected), `counts` [2n] their scored tokens, `nll_logp`
    [n] the chosen sequences' mean log-prob over the NLL span where it is not the response. Every objective logs
    ORPO's terms too; the others also `pref_loss`, their own preference term.
    """
    loss = pair_loss_of(loss)
    o = loss.objective
    n = logps.shape[0] // 2
    lw, lr = logps[:n], logps[n:]
    if o.name == "orpo":
        return orpo_loss(lw, lr, loss.lam, nll_logp)
    nll, or_loss, log_odds = orpo_terms(lw, lr, nll_logp)
    if o.name == "dpo":
        if loss.ref is None:
            raise ValueError("train.objective dpo: the step has no reference log-probs")
        ref = mx.stop_gradient(loss.ref) * counts  # summed log-probs: mean times scored tokens
        pref = -nn.log_sigmoid(o.dpo_beta * ((lw * counts[:n] - ref[:n]) - (lr * counts[n:] - ref[n:])))
        total = pref
    else:
        pref = -nn.log_sigmoid(o.beta * (lw - lr) - o.gamma)
        total = {"simpo": pref, "orpo_margin": nll + loss.lam * pref, "sft_simpo": nll + pref}[o.name]
    value = total.mean()
    # one array where the loss is the term: mx.compile fails on two equal outputs it merges
    pref_loss = value if total is pref else pref.mean()
    return value, {**_metrics(value, nll, or_loss, log_odds, lw, lr), "pref_loss": pref_loss}


def _metrics(loss: mx.array, nll: mx.array, or_loss: mx.array, log_odds: mx.array, lw: mx.array,
             lr: mx.array) -> dict[str, mx.array]:
    return {
        "loss": loss,
        "nll": nll.mean(),
        "or_loss": or_loss.mean(),
        "log_odds": log_odds.mean(),
        "logp_chosen": lw.mean(),
        "logp_rejected": lr.mean(),
        "accuracy": (lw > lr).astype(mx.float32).mean(),
        "margin": (lw - lr).mean(),
    }
