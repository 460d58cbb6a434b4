"""Binarization recipes: turn one raw UltraFeedback row into a (chosen, rejected) pair or a drop reason.

h4 (HuggingFaceH4/ultrafeedback_binarized, create_dataset.py):
  chosen = the completion with the highest `overall_score` (the first one on a tie, as Python's max);
  rejected = a seeded pick among all the OTHER completions, whatever their score: ties with the
  chosen score are kept, and there is no minimum score. Fewer than 2 completions: no pair.
argilla_clean (argilla/ultrafeedback-binarized-preferences[-cleaned], README):
  score = the mean of the four aspect ratings, "N/A" ignored; a completion rated N/A on every aspect
  has no score and takes no part. chosen = the first completion with the best mean; rejected = a
  seeded pick among the completions whose mean is strictly lower. When no completion is strictly
  lower (every scored completion shares the best mean) the row is a tie and is dropped: argilla
  picked an equal one and then filtered out chosen rating == rejected rating. Fewer than 2 scored
  completions: no pair.

The seeded pick is `pick(seed, row id, n)`: the first 8 bytes of sha256(f"{seed}:rejected:{id}"), as a
big-endian integer, modulo n. It depends only on the seed and the row, never on other rows or order.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable

from orpo.curate.schema import Completion, Pair, RawExample

TOO_FEW = "too_few_completions"
TIE = "tie"


def pick(seed: int, row_id: str, n: int, purpose: str = "rejected") -> int:
    """A seeded index in [0, n) for one row (see the module docstring for the exact rule)."""
    digest = hashlib.sha256(f"{seed}:{purpose}:{row_id}".encode()).digest()
    return int.from_bytes(digest[:8], "big") % n


def mean_rating(c: Completion) -> float | None:
    """Mean of the aspect ratings that are not N/A; None when all are N/A."""
    values = [v for v in c.ratings.values() if v is not None]
    return sum(values) / len(values) if values else None


def _pair(
    ex: RawExample, comps: tuple[Completion, ...], best: int, rej: int, sc: float | None, sr: float | None
) -> Pair:
    return Pair(ex.id, (("user", ex.instruction),), comps[best].response, comps[rej].response, ex.source, sc, sr)


def h4(ex: RawExample, seed: int) -> Pair | str:
    """HuggingFaceH4's binarization: best overall_score vs a seeded pick among the others."""
    comps = ex.completions
    if len(comps) < 2:
        return TOO_FEW
    scores = [c.overall_score for c in comps]
    best = max(range(len(comps)), key=lambda i: scores[i])  # first on a tie
    others = [i for i in range(len(comps)) if i != best]
    rej = others[pick(seed, ex.id, len(others))]
    return _pair(ex, comps, best, rej, scores[best], scores[rej])


def argilla_clean(ex: RawExample, seed: int) -> Pair | str:
    """Argilla's binarization: best mean aspect rating vs a seeded pick among strictly lower means."""
    comps = ex.completions
    means = [mean_rating(c) for c in comps]
    scored = [i for i, m in enumerate(means) if m is not None]
    if len(scored) < 2:
        return TOO_FEW
    top = max(means[i] for i in scored)  # type: ignore[type-var]
    best = next(i for i in scored if means[i] == top)
    lower = [i for i in scored if means[i] < top]  # type: ignore[operator]
    if not lower:
        return TIE
    rej = lower[pick(seed, ex.id, len(lower))]
    return _pair(ex, comps, best, rej, means[best], means[rej])


RECIPES: dict[str, Callable[[RawExample, int], Pair | str]] = {"h4": h4, "argilla_clean": argilla_clean}
