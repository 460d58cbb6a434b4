"""Forward positions of an epoch of UltraFeedback-like pairs, the steps cut into micro-batches by either length.

Host work only (the rows `orpo.train.step.prepare` builds; no device): for tight shared rows (what the engine builds
where the exclusion attention fits) and without them (the Mistral-7B head dim on CUDA: a micro-batch of differing
prompts falls back to two-forward rows), the positions (padding included) when each step's pairs are cut in order
of the shared row's length (prompt + chosen + rejected) and of the longer sequence (prompt + max(chosen,
rejected)); `orpo.train.step.row_lengths` picks the one the rows pad to. Also how often consecutive micro-batches
change shape (each change meets another compiled trace and its device state). `--window 32` orders the steps as
`train.group_by_length` does. `--pack W` adds the rows `train.engine.pack_width` W builds: each step's pairs
placed first-fit, longest first, into rows of W positions, micro-batches of `--pack-rows` such rows (a step's
last micro-batch the rows left), so the micro-batches' shapes differ only in that last one's rows and in their
targets' ladder rung; and which steps meet a shape for the first time (a new trace of the compiled step).

    .venv/bin/python bench/row_padding.py --pairs 1024 [--window 32] [--pack 2560 --pack-rows 2]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parents[1]), str(Path(__file__).resolve().parent)]

import numpy as np  # noqa: E402

from orpo.batching import batch_schedule  # noqa: E402
from orpo.train.data import Pairs, pair_lengths, pair_tokens  # noqa: E402
from orpo.train.distributed import shard_micro_batches  # noqa: E402
from orpo.train.rows import block_lengths  # noqa: E402
from orpo.train.settings import engine_settings  # noqa: E402
from orpo.train.step import prepare, prepare_packed_step, resolve_engine  # noqa: E402
from engine_shapes import ultrafeedback_lengths  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--pairs", type=int, default=1024)
    ap.add_argument("--batch", type=int, default=4, help="pairs per micro-batch")
    ap.add_argument("--step", type=int, default=32, help="pairs per optimizer step")
    ap.add_argument("--width-multiple", type=int, default=128, help="train.engine.width_multiple (CUDA's 128)")
    ap.add_argument("--window", type=int, default=1, help="steps sorted by length together (32: train.group_by_length)")
    ap.add_argument("--pack", type=int, default=0, metavar="W", help="also pack each step's rows into rows of W")
    ap.add_argument("--pack-rows", type=int, default=4, help="packed rows per micro-batch")
    a = ap.parse_args()
    rng = np.random.default_rng(0)
    draw = ultrafeedback_lengths(a.pairs, 1)
    prompt, chosen, rejected = ([rng.integers(5, 30000, x[i]).tolist() for x in draw] for i in range(3))
    pairs = Pairs([str(i) for i in range(a.pairs)], prompt, chosen, rejected, [[1] * len(c) for c in chosen],
                  [[1] * len(r) for r in rejected])
    engine = resolve_engine(engine_settings({"width_multiple": a.width_multiple, "prefix_sharing": True}))
    schedule = batch_schedule(pair_lengths(pairs), a.step, 1, 0, 0, a.window)
    print(f"{a.pairs} pairs, {a.step} a step in micro-batches of {a.batch}, widths of {a.width_multiple}, "
          f"steps grouped by length in windows of {a.window}")
    for tight in (True, False):
        for name, key in (("prompt + chosen + rejected", pair_tokens(pairs)),
                          ("prompt + max(chosen, rejected)", pair_lengths(pairs))):
            positions = real = two_forward = 0
            shapes = []
            for step in schedule:
                for rows in shard_micro_batches(sorted(step, key=lambda r: (key[r], r)), a.batch, 0, 1):
                    b = prepare(pairs.select(rows), engine, tight)
                    positions, real, two_forward = positions + b.positions, real + b.row_tokens, two_forward + b.two_forward_tokens
                    shapes.append(b.signature())
            changes = sum(x != y for x, y in zip(shapes, shapes[1:]))
            print(f"{'tight rows' if tight else 'no tight rows':<14} cut by {name:<31} positions {positions:>10,}  "
                  f"padding {1 - real / positions:.3f}  positions / two-forward tokens {positions / two_forward:.3f}  "
                  f"shapes {len(set(shapes))}, changes {changes / len(schedule):.2f} a step")
    if a.pack:
        packed(pairs, schedule, a.pack, a.pack_rows, a.width_multiple)


def packed(pairs: Pairs, schedule: list[list[int]], width: int, rows: int, multiple: int) -> None:
    """Positions, micro-batches and shapes of each step's pairs as the trainer packs them (train.engine.pack_width
    `width`, pack_rows `rows`)."""
    engine = resolve_engine(engine_settings({"width_multiple": multiple, "prefix_sharing": True,
                                             "pack_width": width, "pack_rows": rows}))
    blocks = block_lengths(pairs)
    if max(blocks) > width:
        sys.exit(f"--pack {width}: the longest pair takes {max(blocks)} positions")
    positions = real = micro = 0
    shapes, seen, new_at = [], set(), []  # new_at: the steps that meet a shape no step before met (each a trace)
    for i, step in enumerate(schedule, 1):
        before = len(seen)
        for b in prepare_packed_step(pairs.select(step), [blocks[r] for r in step], engine):
            micro += 1
            positions, real = positions + b.positions, real + b.row_tokens
            shapes.append(b.signature())
            seen.add(shapes[-1])
        if len(seen) > before:
            new_at.append(i)
    changes = sum(x != y for x, y in zip(shapes, shapes[1:]))
    print(f"packed into {rows} x {width}{'':<17} positions {positions:>10,}  padding {1 - real / positions:.3f}  "
          f"micro-batches {micro / len(schedule):.2f} a step  shapes {len(seen)}, "
          f"changes {changes / len(schedule):.2f} a step")
    quarter = [sum(len(schedule) * q / 4 < s <= len(schedule) * (q + 1) / 4 for s in new_at) for q in range(4)]
    print(f"  steps meeting a new shape: {len(new_at)} of {len(schedule)}, by quarter of the epoch {quarter}, "
          f"the last at step {new_at[-1]}")


if __name__ == "__main__":
    main()
