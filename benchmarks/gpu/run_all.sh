#!/usr/bin/env bash
# One GPU-host session after the staging protocol (DEVELOPERS.md): install this project offline into
# /tmp/site, then run the serving smoke test, the `gpu` tests and the benchmarks, with logs in $OUT.
# Usage: bash benchmarks/gpu/run_all.sh [smoke] [tests] [bench] [bench-quick] [layer] [layer-quick] [kernels] [tune] [pages] [joint] [host]
#   tests: the `gpu` tests, TESTS (default: tests) within TESTS_TIMEOUT seconds (default 540); the whole
#   suite outgrew one call on the H100 (2026-11-26): run TESTS="tests/ops tests/attention" (about 1 min),
#   then tests/e2e/test_gpu_relay.py in parts, each test starting engines for minutes (2 in 570 s):
#   TESTS="tests/e2e/test_gpu_relay.py -k matches_flash", then "... -k shared_levels", then "... -k sleep"
#   kernels: benchmarks/layer_kernels.py (GPU time of each kernel of a layer call, per plan)
#   tune: benchmarks/tune_level.py (the fused Triton level's tile sweep, against the FA level)
#   layer: benchmarks/bench_layer.py (the planner's rule, host cost per layer; with .old/ as the
#   previous implementation when present: `git archive 3c09a6c vllm_relay | tar -x -C .old`)
#   TESTS may list paths with commas (an on_gpus.sh job's words hold no spaces); RELAY_INSTALLED=1 skips the
#   install (jobs beside others that import /tmp/site: installing again replaces it under them)
#   pages: benchmarks/bench_page_size.py, a level and (--causal) prompt chunks through 16-token and FA3-tile
#   pages (about 1 min each)
#   joint: benchmarks/bench_joint.py, JOINT_ARGS its arguments (",," for spaces, as HOST_ARGS below)
#   host: benchmarks/bench_host.py (relay's host work per step, HOST_ARGS its arguments with ",," for spaces,
#   e.g. HOST_ARGS=--scenarios,,registered,mixed,,--reqs,,256,891; with .old/ present, the same
#   for that implementation, in $OUT/host_old: `git archive 3be1b41 vllm_relay | tar -x -C .old`)
set -uo pipefail
export PYTHONPATH=/tmp/site VLLM_USE_FLASHINFER_SAMPLER=0 PYTHONUNBUFFERED=1
out=${OUT:-/tmp/out}; mkdir -p "$out"; TESTS=${TESTS:-tests}; HOST_ARGS=${HOST_ARGS:-}; JOINT_ARGS=${JOINT_ARGS:-}
[ "${RELAY_INSTALLED:-0}" = 1 ] || python3 -m pip install -q --no-index --no-deps --no-build-isolation --upgrade \
  --target /tmp/site . >"$out/install.log" 2>&1 || { cat "$out/install.log"; exit 1; }
nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.mem --format=csv | tee "$out/gpu.txt"
old=""; [ -d .old/vllm_relay ] && old="--old-src .old"
for step in "$@"; do
  case $step in
    smoke) timeout 420 bash benchmarks/gpu/serve_smoke.sh llama-2-7b-shape "$out/serve_smoke.log" 2>&1 | tee "$out/smoke.txt" ;;
    tests) timeout "${TESTS_TIMEOUT:-540}" python3 -m pytest -m gpu -q -s -rs -p no:cacheprovider ${TESTS//,/ } 2>&1 | tee "$out/gpu_tests.txt" | grep -E "relay vs FA|graphs vs|worker stats|SKIPPED|passed|failed|Error" | tail -25 ;;
    bench) timeout 500 python3 benchmarks/bench_ops.py --out "$out" 2>&1 | tee "$out/bench.txt" | tail -60 ;;
    bench-quick) timeout 300 python3 benchmarks/bench_ops.py --quick --out "$out" 2>&1 | tee "$out/bench.txt" | tail -60 ;;
    layer) timeout 540 python3 benchmarks/bench_layer.py $old --out "$out" 2>&1 | tee "$out/layer.txt" | tail -70 ;;
    kernels) timeout 300 python3 benchmarks/layer_kernels.py --out "$out" 2>&1 | tee "$out/kernels.txt" | tail -30 ;;
    tune) timeout 540 python3 benchmarks/tune_level.py --out "$out" 2>&1 | tee "$out/tune.txt" | tail -20 ;;
    pages) timeout 240 python3 benchmarks/bench_page_size.py --out "$out" 2>&1 | tee "$out/pages.txt" | tail -22
           timeout 240 python3 benchmarks/bench_page_size.py --causal --out "$out" 2>&1 | tail -22 ;;
    joint) timeout 540 python3 benchmarks/bench_joint.py ${JOINT_ARGS//,,/ } --out "$out" 2>&1 | tee "$out/joint.txt" | tail -30 ;;
    host) timeout 240 python3 benchmarks/bench_host.py --device cuda ${HOST_ARGS//,,/ } --out "$out" 2>&1 | tee "$out/host.txt" | tail -12
          if [ -d .old/vllm_relay ]; then PYTHONPATH=.old:$PYTHONPATH timeout 240 python3 benchmarks/bench_host.py \
            --device cuda --out "$out/host_old" 2>&1 | tail -12; fi ;;
    layer-quick) timeout 300 python3 benchmarks/bench_layer.py --quick $old --out "$out" 2>&1 | tee "$out/layer.txt" | tail -40 ;;
  esac
done
