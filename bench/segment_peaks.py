"""Where a segmented step peaks: the memory peak between consecutive evaluations (segments, head chunks).

Runs one case of a suite (bench/engine_shapes.py) through `pair_value_and_grad` with its evaluation queues
recording `mx.get_peak_memory()` after each evaluation they wait for (overlap 0), then prints, for the last
of a few steps, each phase's peak in order and the largest per kind: forward segments, head chunks,
backward segments. Only meaningful with `segment_layers` > 0 and `overlap` 0.

    python3 bench/segment_peaks.py --shape h200 --variant all-lean-compiled [--engine '{"mlp_chunks": 4}']
"""

from __future__ import annotations

import argparse
import json

import mlx.core as mx
from engine import BENCH_KEYS, LAMBDA, step_inputs  # this script runs from bench/
from engine_shapes import SUITES

import orpo.engine.head as head_module
import orpo.engine.queue as queue_module
import orpo.engine.segmented as segmented_module
from orpo.train.settings import engine_settings
from orpo.train.step import pair_value_and_grad, resolve_engine

GB = 1e9
PHASES: list[tuple[str, float]] = []


def recording_queue(kind: str) -> type:
    """An EvalQueue that logs (kind, peak GB since the last log) after each evaluation it waits for."""

    class Recording(queue_module.EvalQueue):
        def push(self, *arrays: object) -> None:
            super().push(*arrays)
            if self.depth == 0:
                PHASES.append((kind, mx.get_peak_memory() / GB))
                mx.reset_peak_memory()

    return Recording


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shape", default="cpu-small", choices=sorted(SUITES))
    ap.add_argument("--variant", default="all-lean-compiled")
    ap.add_argument("--engine", default="{}", help="JSON overrides of the case's train.engine settings")
    ap.add_argument("--steps", type=int, default=4)
    a = ap.parse_args()
    case = next(c for c in SUITES[a.shape].cases if c.name == a.variant)
    given = {**case.engine, **json.loads(a.engine)}  # over the schema's defaults
    engine = resolve_engine(engine_settings({k: v for k, v in given.items() if k not in BENCH_KEYS}))
    segmented_module.EvalQueue = recording_queue("segment")
    head_module.EvalQueue = recording_queue("head")
    model, pairs = step_inputs(case, 0)
    for _ in range(a.steps):
        PHASES.clear()
        mx.reset_peak_memory()
        start = mx.get_active_memory() / GB
        mx.eval(pair_value_and_grad(model, pairs, LAMBDA, engine))
    n_forward = next((i for i, (kind, _) in enumerate(PHASES) if kind == "head"), len(PHASES))
    labelled = [("forward" if i < n_forward else "backward") if kind == "segment" else kind
                for i, (kind, _) in enumerate(PHASES)]
    print(f"{a.shape}/{a.variant} {a.engine}: resident {start:.3f} GB at the step's start; peak GB per phase, in order:")
    print("  " + " ".join(f"{label[0]}{peak:.2f}" for label, (_, peak) in zip(labelled, PHASES)))
    for label in ("forward", "head", "backward"):
        peaks = [p for lab, (_, p) in zip(labelled, PHASES) if lab == label]
        if peaks:
            print(f"  {label:<9} {len(peaks):>3} evaluations, largest peak {max(peaks):.3f} GB")


if __name__ == "__main__":
    main()
