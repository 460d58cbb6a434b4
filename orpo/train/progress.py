"""Training progress: a tqdm bar on a terminal; off one (Snakemake logs) a line per log step with the step of
the total, loss, tokens/s, elapsed time and ETA, and a line per validation. metrics.jsonl keeps every number."""

from __future__ import annotations

import json
import sys
import time
from typing import Any, Callable, TextIO

from tqdm import tqdm

from orpo.progress import eta, line

VALIDATION_KEYS = ("loss", "nll", "or_loss", "accuracy", "margin")
# The predicted peak's parts, in GB (orpo.train.footprint.predict_memory).
PREDICTED_PARTS = ("weights", "gradients", "master_weights", "moments", "reference", "activations")


class Progress:
    """Reports train steps and events (validation, resume) to `stream` (stderr by default)."""

    def __init__(self, total: int, start: int, log_every: int, stream: TextIO | None = None, tty: bool | None = None,
                 clock: Callable[[], float] = time.perf_counter):
        self.stream = stream if stream is not None else sys.stderr
        self.tty = bool(self.stream.isatty()) if tty is None else tty
        self.total, self.start, self.log_every, self.clock = total, start, log_every, clock
        self.t0 = clock()
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
            print(self.line(m), file=self.stream, flush=True)

    def line(self, m: dict[str, Any]) -> str:
        """`step 50/300  loss 1.2340  acc 0.62  margin +0.123  lr 1.00e-03  mem 12 MB  1,234 tok/s  elapsed 0:41
        eta 3:05`: the ETA at the pace of the steps run since the start (or resume), validations included."""
        elapsed = self.clock() - self.t0
        loop = m.get("elapsed_s", elapsed)  # the training loop's own clock, when the trainer gives it
        fields = {"loss": f"{m['loss']:.4f}", "acc": f"{m['accuracy']:.2f}", "margin": f"{m['margin']:+.3f}",
                  "lr": f"{m['lr']:.2e}", "mem": f"{m['active_memory_mb']:,.0f} MB"}
        return line("step", m["step"], self.total, fields, m.get("tokens_per_s"), elapsed,
                    eta(loop, m["step"] - self.start, self.total - m["step"]))

    def event(self, record: dict[str, Any]) -> None:
        """A one-off record (a validation, a resume): a line above the bar on a terminal, a log line otherwise."""
        text = self.describe(record)
        if self.bar is not None:
            self.bar.write(text, file=self.stream)
        else:
            print(text, file=self.stream, flush=True)

    def describe(self, record: dict[str, Any]) -> str:
        """A validation as `step 50/300  validation  loss 1.2000  nll ...  checkpoint 3fa9...`, a resume as a
        sentence; any other record as its JSON."""
        if set(record) == {"resumed_from_step"}:
            return f"resumed from step {record['resumed_from_step']}/{self.total} (its checkpoint)"
        if "predicted_memory_gb" in record:
            p = record["predicted_memory_gb"]
            parts = ", ".join(f"{k} {v:.2f}" for k, v in p.items() if k in PREDICTED_PARTS)
            seg, least = p["segment_layers"], p["segment_min_positions"]
            backward = f"recomputed in {seg}-layer segments" if p["recomputes"] else "plain backward"
            plan = (f"segment_layers {seg}" + (f" from {least} positions" if seg and least else "")
                    + (f", mlp_chunks {p['mlp_chunks']}" if seg and p["mlp_chunks"] > 1 else ""))
            planned = f", auto under a budget of {p['budget_gb']:.2f} GB" if "budget_gb" in p else ""
            rows = f"{p['rows']} rows x {p['width']}" + (", pairs packed" if p.get("packed") else "")
            return (f"predicted peak memory {p['peak']:.2f} GB ({parts}) at a micro-batch of {rows} ({backward}); "
                    f"{plan}{planned}"
                    + (f"; warning: {record['warning']}" if record.get("warning") else ""))
        if "peak_memory_gb" in record:
            m = record["peak_memory_gb"]
            return f"peak memory {m['measured']:.2f} GB measured, {m['predicted']:.2f} GB predicted"
        if "validation" in record and "step" in record:
            v = record["validation"] or {}  # none with no validation pairs: the checkpoint alone
            parts = [f"step {record['step']}/{self.total}", "validation" if v else "checkpoint",
                     *(f"{k} {v[k]:+.4f}" if k == "margin" else f"{k} {v[k]:.4f}" for k in VALIDATION_KEYS if k in v)]
            if record.get("sha256"):
                parts.append(f"checkpoint {record['sha256']}")
            return "  ".join(parts)
        return json.dumps(record)

    def close(self) -> None:
        """Finish the bar (no-op for log lines)."""
        if self.bar is not None:
            self.bar.close()
