#!/usr/bin/env bash
# On the GPU machine: waits up to $1 seconds for the DAG gpu_dag_launch.sh started, prints its progress and packs
# its small outputs (no weights) into $OUT. usage: bash bench/gpu_dag_poll.sh 560
limit=${1:-500}
t0=$(date +%s)
while kill -0 "$(cat /tmp/paper.pid)" 2>/dev/null && [ $(( $(date +%s) - t0 )) -lt "$limit" ]; do sleep 5; done
w=/tmp/paper-gpu
echo "== $(( $(date +%s) - $(cat /tmp/paper.start) )) s since launch; running: $(kill -0 "$(cat /tmp/paper.pid)" 2>/dev/null && echo yes || echo no)"
echo "== finished rules (s, max RSS MB)"
for f in $(find $w/benchmarks -name '*.tsv' -printf '%T@ %p\n' 2>/dev/null | sort -n | cut -d' ' -f2); do
  echo "$f $(tail -1 $f | cut -f1,3)"
done
echo "== newest logs"
for f in $(ls -t $(find $w/logs -name '*.log' 2>/dev/null) | head -2); do echo "-- $f"; tail -4 "$f"; done
nvidia-smi --query-gpu=memory.used,utilization.gpu --format=csv,noheader
echo "== paper.log tail"; tail -5 /tmp/paper.log
[ -f /tmp/paper-gpu.json ] && cp /tmp/paper-gpu.json "$OUT/"
cp /tmp/paper.log "$OUT/paper-log.txt"
(cd $w && tar --exclude='*.safetensors' --exclude='./model' --exclude='*/generations/*' --exclude='./.snakemake' \
   -czf "$OUT/dag-small.tgz" benchmarks logs results overlay.yaml 2>/dev/null) || true
(cd $w && tar -czf "$OUT/dag-generations.tgz" $(find results -path '*generations*' -name '*.jsonl') 2>/dev/null) || true
ls -la "$OUT"
