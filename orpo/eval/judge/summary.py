"""From the two orders' verdicts to a question's outcome, and win/tie/loss rates with bootstrap intervals.

As FastChat's show_result: an outcome stands when both orders agree; a disagreement ("inconsistent")
counts as a tie; a question with an error in either order is left out of the rates (and reported).
"""

from __future__ import annotations

from typing import Any

import numpy as np

OUTCOMES = ("win", "loss", "tie", "inconsistent", "error")
RATES = ("win_rate", "tie_rate", "loss_rate", "adjusted_win_rate", "inconsistent_rate")


def winner(verdict: str | None, order: str) -> str:
    """The model a slot verdict picks: 'a', 'b', 'tie' or 'error'; order 'ab' puts model a in slot A."""
    if verdict is None:
        return "error"
    if verdict == "tie":
        return "tie"
    in_a, in_b = ("a", "b") if order == "ab" else ("b", "a")
    return in_a if verdict == "A" else in_b


def outcome(first: str, second: str) -> str:
    """Model a's outcome from the winners of both orders."""
    if "error" in (first, second):
        return "error"
    if first != second:
        return "inconsistent"
    return {"a": "win", "b": "loss", "tie": "tie"}[first]


def _rates(counts: np.ndarray) -> np.ndarray:
    """RATES (last axis) from counts of win, loss, tie, inconsistent (last axis)."""
    win, loss, tie, inc = (counts[..., i] for i in range(4))
    n = counts.sum(axis=-1)
    return np.stack([win / n, (tie + inc) / n, loss / n, (win + 0.5 * (tie + inc)) / n, inc / n], axis=-1)


def summarize(outcomes: list[str], n_resamples: int, seed: int, level: float = 0.95) -> dict[str, Any]:
    """Counts of each outcome and, over judged questions, each rate with a percentile bootstrap interval."""
    counts = {o: outcomes.count(o) for o in OUTCOMES}
    judged = [OUTCOMES.index(o) for o in outcomes if o != "error"]
    out: dict[str, Any] = {"questions": len(outcomes), "judged": len(judged), "counts": counts,
                           "bootstrap": {"n_resamples": n_resamples, "seed": seed, "level": level}}
    if not judged:
        out.update({r: {"estimate": None, "lo": None, "hi": None} for r in RATES})
        return out
    codes = np.array(judged)
    onehot = np.eye(4)[codes]  # questions x (win, loss, tie, inconsistent)
    # Questions are the unit of resampling: both orders of a question stay together.
    idx = np.random.default_rng(seed).integers(0, len(codes), size=(n_resamples, len(codes)))
    point, samples = _rates(onehot.sum(axis=0)), _rates(onehot[idx].sum(axis=1))
    tail = (1 - level) / 2
    lo, hi = np.quantile(samples, [tail, 1 - tail], axis=0)
    out.update({r: {"estimate": float(point[i]), "lo": float(lo[i]), "hi": float(hi[i])} for i, r in enumerate(RATES)})
    return out
