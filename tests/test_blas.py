"""OpenBLAS is found and preloaded for MLX on the Linux CPU build, and the CLI re-executes with it."""

import json
import os
import subprocess
import sys

import pytest

from orpo import blas

linux_cpu = pytest.mark.skipif(not blas._mlx_uses_bundled_blas(), reason="only the Linux CPU build bundles BLAS")


def _env(**extra):
    env = {k: v for k, v in os.environ.items() if k not in ("LD_PRELOAD", "_ORPO_BLAS_DONE")}
    return {**env, **extra}


@linux_cpu
def test_openblas_is_found_here():
    # make (bootstrap) installs it where it can; CI runs as root on Debian.
    lib = blas.find_openblas()
    assert lib and os.path.exists(lib)
    assert lib in blas.preload_value().split()


@linux_cpu
def test_cli_reexecutes_with_openblas_loaded():
    out = subprocess.run([sys.executable, "-m", "orpo.cli", "env"], env=_env(), capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    loaded = json.loads(out.stdout)["blas_loaded"]
    assert any("openblas" in lib for lib in loaded), loaded


@linux_cpu
def test_switch_off_keeps_the_bundled_blas():
    out = subprocess.run([sys.executable, "-m", "orpo.cli", "env"], env=_env(ORPO_OPENBLAS="0"),
                         capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    loaded = json.loads(out.stdout)["blas_loaded"]
    assert loaded and not any("openblas" in lib for lib in loaded), loaded
