"""Progress lines for logs (Snakemake's, where no bar redraws): where a loop is, how fast, and when it ends.

`step 50/300  loss 1.2340  acc 0.62  1,234 tok/s  elapsed 0:41  eta 3:05`: the base warm-up, ORPO
training and generation all log this form, each with its own fields.
"""

from __future__ import annotations

import math


def duration(seconds: float | None) -> str:
    """0:41, 3:05, 1:02:03 (m:ss under an hour, h:mm:ss after); ? when unknown."""
    if seconds is None or not math.isfinite(seconds) or seconds < 0:
        return "?"
    s = int(round(seconds))
    h, rest = divmod(s, 3600)
    m, s = divmod(rest, 60)
    return f"{h}:{m:02d}:{s:02d}" if h else f"{m}:{s:02d}"


def eta(elapsed: float, done: int, left: int) -> float | None:
    """Seconds still to go at the mean pace so far (None before anything is done)."""
    if done <= 0:
        return None
    return elapsed / done * max(left, 0)


def line(what: str, done: int, total: int, fields: dict[str, str], tokens_per_s: float | None, elapsed: float,
         eta_s: float | None, percent: bool = False) -> str:
    """`{what} {done}/{total} [(p%)]  {field value ...}  {n} tok/s  elapsed {m:ss}  eta {m:ss}`."""
    head = f"{what} {done}/{total}" + (f" ({100 * done // max(total, 1)}%)" if percent else "")
    parts = [head, *(f"{k} {v}" for k, v in fields.items())]
    if tokens_per_s is not None:
        parts.append(f"{tokens_per_s:,.0f} tok/s" if tokens_per_s >= 100 else f"{tokens_per_s:.1f} tok/s")
    parts += [f"elapsed {duration(elapsed)}", f"eta {duration(eta_s)}"]
    return "  ".join(parts)
