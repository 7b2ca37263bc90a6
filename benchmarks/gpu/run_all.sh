#!/usr/bin/env bash
# On a GPU host with vLLM installed and no network: install this project offline into
# /tmp/site, then run the `gpu` tests and the kernel benchmark, with logs in $OUT.
# Usage: bash benchmarks/gpu/run_all.sh [tests] [bench] [bench-quick]
#   tests: the `gpu` tests, TESTS (default: tests) within TESTS_TIMEOUT seconds (default 540); the whole
#   suite takes longer: acceptance.sh runs it in steps, each under a call's 600 s
set -uo pipefail
export PYTHONPATH=/tmp/site VLLM_USE_FLASHINFER_SAMPLER=0 PYTHONUNBUFFERED=1
out=${OUT:-/tmp/out}; mkdir -p "$out"; TESTS=${TESTS:-tests}
python3 -m pip install -q --no-index --no-deps --no-build-isolation --upgrade \
  --target /tmp/site . >"$out/install.log" 2>&1 || { cat "$out/install.log"; exit 1; }
nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.mem --format=csv | tee "$out/gpu.txt"
for step in "$@"; do
  case $step in
    tests) timeout "${TESTS_TIMEOUT:-540}" python3 -m pytest -m gpu -q -s -rs -p no:cacheprovider $TESTS 2>&1 | tee "$out/gpu_tests.txt" | grep -E "relay vs FA|graphs vs|worker stats|SKIPPED|passed|failed|Error" | tail -25 ;;
    bench) timeout 500 python3 benchmarks/bench_ops.py --out "$out" 2>&1 | tee "$out/bench.txt" | tail -60 ;;
    bench-quick) timeout 300 python3 benchmarks/bench_ops.py --quick --out "$out" 2>&1 | tee "$out/bench.txt" | tail -60 ;;
  esac
done
