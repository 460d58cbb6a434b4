"""Use OpenBLAS for MLX's CPU matmuls on Linux: the mlx[cpu] wheel bundles reference BLAS (~35x slower).

The dynamic loader must see OpenBLAS before MLX loads, so the `orpo` CLI re-executes itself once with
LD_PRELOAD set (`reexec_with_openblas`), and `make test` sets the same variable for in-process MLX.
ORPO_OPENBLAS=0 turns this off; where no OpenBLAS is found everything still works, only slower.
"""

from __future__ import annotations

import argparse
import glob
import importlib.metadata
import os
import subprocess
import sys

_CANDIDATES = [
    "/usr/lib/x86_64-linux-gnu/openblas-pthread/libblas.so.3",
    "/usr/lib/aarch64-linux-gnu/openblas-pthread/libblas.so.3",
    "/usr/lib64/libopenblas.so.0",
    "/usr/lib/x86_64-linux-gnu/libopenblas.so.0",
    "/usr/lib/aarch64-linux-gnu/libopenblas.so.0",
]


def _mlx_uses_bundled_blas() -> bool:
    """True on Linux with the CPU build of MLX (the CUDA build does its matmuls on the GPU)."""
    if not sys.platform.startswith("linux"):
        return False
    for dist in ("mlx-cuda-13", "mlx-cuda-12"):
        try:
            importlib.metadata.distribution(dist)
            return False
        except importlib.metadata.PackageNotFoundError:
            pass
    return True


def find_openblas() -> str | None:
    """Path of an OpenBLAS library exporting the cblas symbols MLX calls, or None."""
    if os.environ.get("ORPO_OPENBLAS", "1") == "0" or not _mlx_uses_bundled_blas():
        return None
    for path in _CANDIDATES:
        if os.path.exists(path):
            return path
    try:
        out = subprocess.run(["ldconfig", "-p"], capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.SubprocessError):
        out = ""
    for line in out.splitlines():
        if "libopenblas.so.0" in line and "=>" in line:
            return line.split("=>", 1)[1].strip()
    hits = sorted(glob.glob("/usr/lib*/**/libopenblas*.so*", recursive=True))
    return hits[0] if hits else None


def preload_value() -> str:
    """The LD_PRELOAD value that adds OpenBLAS to what is already preloaded ('' when none applies)."""
    current = os.environ.get("LD_PRELOAD", "")
    lib = find_openblas()
    if not lib or lib in current.split():
        return current
    return f"{lib} {current}".strip()


def reexec_with_openblas(argv: list[str], command: list[str] | None = None) -> None:
    """Re-execute this Python process with OpenBLAS preloaded, once; returns if nothing is to be done.

    The new process runs `python -m orpo.cli ARGV`, or `python COMMAND` (e.g. a script path plus argv).
    """
    if os.environ.get("_ORPO_BLAS_DONE") == "1":
        return
    value = preload_value()
    os.environ["_ORPO_BLAS_DONE"] = "1"
    if not value or value == os.environ.get("LD_PRELOAD", ""):
        return
    env = dict(os.environ, LD_PRELOAD=value)
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(sys.executable, [sys.executable, *(command or ["-m", "orpo.cli", *argv])], env)


def describe() -> str:
    """One line saying which BLAS MLX's CPU matmuls will use."""
    if not _mlx_uses_bundled_blas():
        return "orpo: MLX runs on Metal/CUDA; no CPU BLAS needed"
    if os.environ.get("ORPO_OPENBLAS", "1") == "0":
        return "orpo: ORPO_OPENBLAS=0: MLX keeps its bundled reference BLAS (slow)"
    lib = find_openblas()
    if lib:
        return f"orpo: MLX CPU matmuls use OpenBLAS ({lib}) instead of the wheel's reference BLAS"
    return "orpo: no OpenBLAS found: MLX uses its bundled reference BLAS (~35x slower matmuls); install libopenblas0-pthread"


def main() -> None:
    """`python -m orpo.blas --preload` prints the LD_PRELOAD value; `--announce` prints one line."""
    ap = argparse.ArgumentParser(prog="python -m orpo.blas", description=main.__doc__)
    ap.add_argument("--preload", action="store_true")
    ap.add_argument("--announce", action="store_true")
    args = ap.parse_args()
    if args.announce:
        print(describe())
    if args.preload:
        print(preload_value())


if __name__ == "__main__":
    main()
