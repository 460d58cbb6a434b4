"""Training progress: a tqdm bar on a terminal, one JSON line per log step otherwise (Snakemake logs)."""

from __future__ import annotations

import json
import sys
from typing import Any, TextIO

from tqdm import tqdm

LOG_KEYS = ("step", "loss", "nll", "or_loss", "accuracy", "margin", "lr", "tokens_per_s", "active_memory_mb")


class Progress:
    """Reports train steps and events (validation, resume) to `stream` (stderr by default)."""

    def __init__(self, total: int, start: int, log_every: int, stream: TextIO | None = None, tty: bool | None = None):
        self.stream = stream if stream is not None else sys.stderr
        self.tty = bool(self.stream.isatty()) if tty is None else tty
        self.total, self.log_every = total, log_every
        self.bar = (tqdm(total=total, initial=start, file=self.stream, unit="step", dynamic_ncols=True, smoothing=0.1)
                    if self.tty else None)

    def step(self, m: dict[str, Any]) -> None:
        """One finished optimizer step's metrics (a line of metrics.jsonl)."""
        if self.bar is not None:
            self.bar.set_postfix({"loss": f"{m['loss']:.4f}", "acc": f"{m['accuracy']:.2f}",
                                  "tok/s": f"{m['tokens_per_s']:.0f}", "mem": f"{m['active_memory_mb']:.0f}MB"},
                                 refresh=False)
            self.bar.update(1)
        elif m["step"] % self.log_every == 0 or m["step"] == self.total:
            self.event({k: m[k] for k in LOG_KEYS})

    def event(self, line: dict[str, Any]) -> None:
        """A one-off record: printed above the bar on a terminal, as a JSON line otherwise."""
        if self.bar is not None:
            self.bar.write(json.dumps(line), file=self.stream)
        else:
            print(json.dumps(line), file=self.stream, flush=True)

    def close(self) -> None:
        """Finish the bar (no-op for JSON lines)."""
        if self.bar is not None:
            self.bar.close()
