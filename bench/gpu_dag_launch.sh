#!/usr/bin/env bash
# On the GPU machine: starts bench/paper_gpu.py in its own session (it outlives the device call) from a copy of
# the repo at /tmp/repo, with the wheels gpu_wheels.md packs (langdetect and connection_pool from .gpu/extra).
# usage (repo root, after install.sh): bash bench/gpu_dag_launch.sh [paper_gpu.py args...]
set -e
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .gpu/extra/*.whl
rm -rf /tmp/repo && mkdir -p /tmp/repo
tar --exclude='./.gpu/p[0-9]*' -cf - . | tar -C /tmp/repo -xf -
cd /tmp/repo
export PYTHONPATH=/tmp/site:/tmp/repo PYTHONUNBUFFERED=1
date +%s > /tmp/paper.start
setsid nohup python3 bench/paper_gpu.py --prompts .gpu/ifeval/input_data.jsonl --json /tmp/paper-gpu.json "$@" \
  > /tmp/paper.log 2>&1 < /dev/null &
echo $! > /tmp/paper.pid
echo "launched pid $(cat /tmp/paper.pid): paper_gpu.py $*"
