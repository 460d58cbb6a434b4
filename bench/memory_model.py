"""The trainer's activation estimate (`orpo.train.footprint.activation_bytes`) against the measured step.

For each case one value_and_grad of the product's step (`orpo.train.step`, the engine resolved on this machine as a
run resolves it) on random pairs of a real geometry, at a few depths: the memory the step takes above what was
resident before it (peak - resident, the gradients' own arrays taken off) beside the estimate, so the per-layer
slope and the depth-independent part (head, boundaries) can both be read; the same pairs also packed two to a row
(`pack_width` in the row). `orpo.train.footprint.plan_memory`
chooses the segmented backward from this estimate, so it must not fall short of the measurement.

    .venv/bin/python bench/memory_model.py --geometry cpu-small
    python3 bench/memory_model.py --geometry h200,mistral-7b --json $OUT/memory-model.json    # on the GPU
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

sys.path[:0] = [str(Path(__file__).resolve().parents[1]), str(Path(__file__).resolve().parent)]

import mlx.core as mx  # noqa: E402

from engine import GB, LAMBDA, LORA, build_model, random_pairs  # noqa: E402
from engine_shapes import CPU_SMALL, LLAMA_1B, MISTRAL_7B  # noqa: E402
from orpo.config import section_defaults  # noqa: E402
from orpo.train.footprint import measured_activations  # noqa: E402
from orpo.train.lora import apply_lora  # noqa: E402
from orpo.train.rows import block_lengths  # noqa: E402
from orpo.train.settings import engine_settings  # noqa: E402
from orpo.train.step import resolve_engine  # noqa: E402

GEOMETRIES = {"cpu-small": (CPU_SMALL, (2, 4)), "h200": (replace(LLAMA_1B, dtype="bfloat16"), (2, 4, 16)),
              "mistral-7b": (replace(MISTRAL_7B, dtype="bfloat16"), (2, 4, 32))}


def measure(shape: Any, layers: int, method: str, engine: dict[str, Any], seed: int = 0) -> dict[str, Any]:
    """One case: the step's memory above the resident arrays (its gradients' own taken off) and the estimate."""
    e = resolve_engine(engine_settings({**section_defaults("train")["engine"], **engine}))
    model = build_model(shape, seed, layers)
    if method == "lora":
        apply_lora(model, LORA, seed)
    model.train()
    m = measured_activations(model, random_pairs(shape, seed), e, LAMBDA)
    del model
    mx.clear_cache()
    return {"layers": layers, "method": method, "segment_layers": e.segment_layers, "pack_width": e.pack_width,
            "rows": m["rows"], "width": m["width"], "measured_gb": round(m["measured"] / GB, 4),
            "predicted_gb": round(m["predicted"] / GB, 4),
            "predicted_over_measured": round(m["predicted"] / m["measured"], 3)}


def packed(shape: Any) -> dict[str, int]:
    """The same pairs as the plain cases in packed rows: two pairs a row (a multiple of 128), two rows a micro-batch."""
    return {"pack_width": -(-2 * max(block_lengths(random_pairs(shape, 0))) // 128) * 128, "pack_rows": 2}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--geometry", default="cpu-small", help=f"comma-separated: {', '.join(GEOMETRIES)}")
    ap.add_argument("--full-depth", action="store_true",
                    help="also the geometry's own depth (LoRA: plain backward, segments of 4, packed)")
    ap.add_argument("--engine", default="{}", help="train.engine settings (JSON) under every case's own")
    ap.add_argument("--depths", help="the two layer counts of the slope, e.g. 4,8 (default: the geometry's)")
    ap.add_argument("--dtype", help="the model's dtype in place of the geometry's (e.g. bfloat16 at cpu-small)")
    ap.add_argument("--json", help="write the rows here (after each case)")
    args = ap.parse_args()
    rows: list[dict[str, Any]] = []
    for name in args.geometry.split(","):
        shape, depths = GEOMETRIES[name]
        shape = replace(shape, dtype=args.dtype) if args.dtype else shape
        if args.depths:
            depths = (*map(int, args.depths.split(",")), *depths[2:])
        cases = [(d, "lora", {}) for d in depths[:2]] + [(depths[1], "lora", {"segment_layers": 1}),
                                                         (depths[1], "lora", {"segment_layers": 2}),
                                                         (depths[1], "full", {}), (depths[1], "full", {"segment_layers": 1})]
        cases += [(depths[1], "lora", {}, 2)]  # half the pairs: the per-token slope
        cases += [(d, "lora", packed(shape)) for d in depths[:2]]
        if args.full_depth:
            cases += [(depths[2], "lora", e) for e in ({}, {"segment_layers": 4}, packed(shape))]
        for layers, method, engine, *pairs in cases:
            s = replace(shape, pairs=pairs[0]) if pairs else shape
            row = {"geometry": name, "pairs": s.pairs,
                   **measure(s, layers, method, {**json.loads(args.engine), **engine})}
            rows.append(row)
            print(json.dumps(row), flush=True)
            if args.json:
                Path(args.json).write_text(json.dumps({"rows": rows, "device": mx.device_info()}, indent=1, default=str))


if __name__ == "__main__":
    main()
