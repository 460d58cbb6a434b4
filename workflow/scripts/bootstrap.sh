#!/usr/bin/env bash
# Creates or reuses the virtual environment and installs what the project needs, picking the MLX build
# for this machine: Metal on macOS, CUDA 13 where an NVIDIA GPU answers, the CPU build otherwise. On Linux
# CPU it installs OpenBLAS as root where apt-get exists (the mlx[cpu] wheel's bundled BLAS is ~35x slower).
# Usage: workflow/scripts/bootstrap.sh VENV_DIR
set -euo pipefail
venv=${1:-.venv}
root=$(cd "$(dirname "$0")/../.." && pwd)
cd "$root"

python=${PYTHON:-}
if [ -z "$python" ]; then
  for p in python3.12 python3.11 python3.13 python3.10 python3; do
    if command -v "$p" >/dev/null && "$p" -c 'import sys; sys.exit(sys.version_info < (3, 10))' 2>/dev/null; then
      python=$p; break
    fi
  done
fi
[ -n "$python" ] || { echo "bootstrap: need Python >= 3.10 on PATH (or set PYTHON)" >&2; exit 1; }

case "$(uname -s)" in
  Darwin) backend=metal ;;
  Linux)
    if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L 2>/dev/null | grep -q GPU; then backend=cuda; else backend=cpu; fi ;;
  *) echo "bootstrap: unsupported OS $(uname -s)" >&2; exit 1 ;;
esac
backend=${ORPO_BACKEND:-$backend}
extras=test
[ "$backend" = metal ] || extras="$backend,test"

if [ "$backend" = cpu ] && [ "${ORPO_OPENBLAS:-1}" != 0 ] && ! ldconfig -p 2>/dev/null | grep -q 'libopenblas\.so\.0'; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    echo "bootstrap: installing OpenBLAS (apt-get install libopenblas0-pthread)"
    (DEBIAN_FRONTEND=noninteractive apt-get install -y -q libopenblas0-pthread >/dev/null 2>&1 \
      || { apt-get update -q >/dev/null 2>&1 && DEBIAN_FRONTEND=noninteractive apt-get install -y -q libopenblas0-pthread >/dev/null 2>&1; }) \
      || echo "bootstrap: could not install OpenBLAS; MLX keeps its bundled reference BLAS (slow)"
  fi
fi

[ -x "$venv/bin/python" ] || "$python" -m venv "$venv"
stamp="$venv/.orpo-installed"
want="$extras $(cat pyproject.toml | (sha256sum 2>/dev/null || shasum -a 256) | cut -c1-16)"
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ]; then
  echo "bootstrap: installing orpo-pipeline[$extras] into $venv"
  "$venv/bin/python" -m pip install -q --upgrade pip >/dev/null
  "$venv/bin/python" -m pip install -q -e ".[$extras]"
  echo "$want" > "$stamp"
fi
