"""The ORPO paper's IFEval experiment scaled to the embedded model, end to end, timed.

Runs `snakemake results/paper/orpo-ifeval-tiny/table.md --configfile config/paper/orpo-ifeval-tiny.yaml` in a
fresh working directory (two experiments, alpha = h4 binarization, beta = argilla_clean, sharing data and
the base model), then prints the job counts, each rule's wall time and max RSS from benchmarks/*.tsv, and
the table. The test suite runs the same config at a micro scale (tests/test_workflow_paper.py).

    .venv/bin/python bench/paper_tiny.py [--workdir DIR] [--cores N]
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from orpo.report.sources import benchmark

TARGET = "results/paper/orpo-ifeval-tiny/table.md"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workdir", type=Path, default=None, help="default: a new temporary folder")
    ap.add_argument("--cores", type=int, default=2)
    a = ap.parse_args()
    workdir = a.workdir or Path(tempfile.mkdtemp(prefix="paper-tiny-"))
    workdir.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "snakemake", TARGET, "--snakefile", str(ROOT / "Snakefile"), "--directory",
           str(workdir), "--configfile", str(ROOT / "config/paper/orpo-ifeval-tiny.yaml"), "--cores", str(a.cores)]
    t0 = time.perf_counter()
    run = subprocess.run(cmd, capture_output=True, text=True, check=False)
    wall = time.perf_counter() - t0
    if run.returncode != 0:
        sys.exit(f"snakemake failed ({run.returncode}):\n{run.stderr[-4000:]}")
    stats = (run.stdout + run.stderr).split("Job stats:", 1)[1].split("\n\n", 1)[0]
    print(f"workdir {workdir}; {wall:.0f} s wall on {a.cores} cores\n\njob counts:")
    print("\n".join(ln for ln in stats.splitlines() if re.match(r"^\w+\s+\d+$", ln)))
    print("\n| rule | wall s | max RSS MB |\n|---|---:|---:|")
    for tsv in sorted((workdir / "benchmarks").rglob("*.tsv")):
        rec = benchmark(tsv)
        rss = f"{rec['max_rss']:.0f}" if rec.get("max_rss") is not None else "NA"
        print(f"| {tsv.relative_to(workdir / 'benchmarks').with_suffix('')} | {rec['s']:.1f} | {rss} |")
    print("\n" + (workdir / TARGET).read_text())


if __name__ == "__main__":
    main()
