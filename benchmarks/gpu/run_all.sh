#!/usr/bin/env bash
# On a GPU host with vLLM installed and no network: install this project offline into
# /tmp/site, then run the serving smoke test, the `gpu` tests and the benchmarks, with logs in $OUT.
# Usage: bash benchmarks/gpu/run_all.sh [smoke] [tests] [bench] [bench-quick]
#   tests: the `gpu` tests, TESTS (default: tests) within TESTS_TIMEOUT seconds (default 540); the whole
#   suite outgrew one call on the H100 (2026-11-26): run TESTS="tests/ops tests/attention" (about 1 min),
#   then tests/e2e/test_gpu_relay.py in parts, each test starting engines for minutes (2 in 570 s):
#   TESTS="tests/e2e/test_gpu_relay.py -k matches_flash", then "... -k shared_levels", then "... -k sleep"
#   TESTS may list paths with commas (an on_gpus.sh job's words hold no spaces); RELAY_INSTALLED=1 skips the
#   install (jobs beside others that import /tmp/site: installing again replaces it under them)
set -uo pipefail
export PYTHONPATH=/tmp/site VLLM_USE_FLASHINFER_SAMPLER=0 PYTHONUNBUFFERED=1
out=${OUT:-/tmp/out}; mkdir -p "$out"; TESTS=${TESTS:-tests}
[ "${RELAY_INSTALLED:-0}" = 1 ] || python3 -m pip install -q --no-index --no-deps --no-build-isolation --upgrade \
  --target /tmp/site . >"$out/install.log" 2>&1 || { cat "$out/install.log"; exit 1; }
nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.mem --format=csv | tee "$out/gpu.txt"
for step in "$@"; do
  case $step in
    smoke) timeout 420 bash benchmarks/gpu/serve_smoke.sh llama-2-7b-shape "$out/serve_smoke.log" 2>&1 | tee "$out/smoke.txt" ;;
    tests) timeout "${TESTS_TIMEOUT:-540}" python3 -m pytest -m gpu -q -s -rs -p no:cacheprovider ${TESTS//,/ } 2>&1 | tee "$out/gpu_tests.txt" | grep -E "relay vs FA|graphs vs|worker stats|SKIPPED|passed|failed|Error" | tail -25 ;;
    bench) timeout 500 python3 benchmarks/bench_ops.py --out "$out" 2>&1 | tee "$out/bench.txt" | tail -60 ;;
    bench-quick) timeout 300 python3 benchmarks/bench_ops.py --quick --out "$out" 2>&1 | tee "$out/bench.txt" | tail -60 ;;
  esac
done
