#!/usr/bin/env bash
# GPU host, after benchmarks/gpu/run_all.sh has installed the project: where a throughput run spends
# its host time. Each CONFIG of bench_throughput.py runs once (Llama-3-8B shape, P=2048, N requests)
# under py-spy (every process: front end, engine core, worker), raw stacks into $OUT/prof_CONFIG.txt;
# summarize them here with `python3 benchmarks/profile_summary.py $OUT/prof_*.txt`.
# Usage: PYSPY=/path/to/py-spy bash benchmarks/gpu/profile.sh CONFIG...   (N, default 1000)
set -uo pipefail
export PYTHONPATH=/tmp/site VLLM_USE_FLASHINFER_SAMPLER=0 PYTHONUNBUFFERED=1
out=${OUT:-/tmp/out}; mkdir -p "$out"
N=${N:-1000}; PYSPY=${PYSPY:-py-spy}
m3=$(python3 -m vllm_relay.testing build llama-3-8b-shape | tail -1 | cut -f2)
for config in "$@"; do
  timeout 280 "$PYSPY" record -r 25 --subprocesses -f raw -o "$out/prof_$config.txt" -- \
    python3 benchmarks/bench_throughput.py --model "$m3" --prefix-len 2048 --num-prompts "$N" \
    --max-model-len 4096 --worker "$config" 2>&1 | grep -E "requests/s|Error" | cut -c1-200
done
