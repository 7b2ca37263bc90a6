#!/usr/bin/env bash
# GPU host, after benchmarks/gpu/run_all.sh has installed the project: end-to-end relay runs.
# Usage: bash benchmarks/gpu/e2e.sh STEP...   with STEP one of
#   single2    the headline ratio to no prompt: Llama-2-7B shape, P=2048, 1000 requests, relay and no system
#              prompt, each engine run twice (about 4 min)
#   l2_8192    throughput, P = 8192, default / relay / no system prompt (Llama-2-7B shape)
#   l3         throughput, Llama-3-8B shape, single (P=2048) and multi-prompt workloads, default / relay / no
#              system prompt / the relay backend without prompts, and the decode-latency sweep
#   multi2     the multi-prompt workload (four system prompts, 20% plain requests), Llama-2-7B shape, 1000
#              requests, each engine run twice: relay, no system prompt, vLLM's default (CONFIGS=relay,noprefix
#              leaves the default out: on the H100 the three outgrow a 570 s call)
#   serve3     serving through the OpenAI server at Poisson rates, default vs relay (Llama-3-8B shape)
# Each throughput step takes CONFIGS; N (requests per workload of l2_8192 and l3, default 500) and RATES
# (default 1,4,8,16,32) tune the size; l2_8192 and l3 take REPEAT (runs per engine, default 1), l3 LATENCY
# (set empty: no decode-latency sweep); serve3 SERVE_CONFIGS (default default,relay; relay-plain: nothing
# registered) and ROUNDS (above 1: the servers up at once on one GPU, the rates run on each in turn, ROUNDS times).
# BT_EXTRA: more bench_throughput.py options for every throughput step, e.g. BT_EXTRA=--triton-cache=/tmp/tc
# (a fresh Triton cache per configuration: the kernels compiled inside a timed run are named in its JSON).
set -uo pipefail
export PYTHONPATH=/tmp/site VLLM_USE_FLASHINFER_SAMPLER=0 PYTHONUNBUFFERED=1
out=${OUT:-/tmp/out}; mkdir -p "$out"
N=${N:-500}; RATES=${RATES:-1,4,8,16,32}; DUR=${DUR:-20}
m2=$(python3 -m vllm_relay.testing build llama-2-7b-shape | tail -1 | cut -f2)
m3=$(python3 -m vllm_relay.testing build llama-3-8b-shape | tail -1 | cut -f2)
bt="python3 benchmarks/bench_throughput.py ${BT_EXTRA:-}"
for step in "$@"; do
  case $step in
    single2) $bt --model "$m2" --prefix-len 2048 --num-prompts 1000 --max-model-len 5120 --repeat 2 \
          --configs "${CONFIGS:-relay,noprefix}" --out "$out/single_llama2.json" ;;
    l2_8192) $bt --model "$m2" --prefix-len 8192 --num-prompts "$N" --max-model-len 9000 --repeat "${REPEAT:-1}" \
          --configs "${CONFIGS:-default,relay,noprefix}" --out "$out/e2e_llama2_8192.json" ;;
    l3) $bt --model "$m3" --prefix-len 2048 --num-prompts "$N" --max-model-len 5120 --workloads single,multi \
          ${LATENCY---latency} --repeat "${REPEAT:-1}" --configs "${CONFIGS:-default,relay,noprefix,noprefix-relay}" \
          --out "$out/e2e_llama3.json" ;;
    multi2) $bt --model "$m2" --prefix-len 2048 --num-prompts 1000 --max-model-len 5120 --workloads multi --repeat 2 \
          --configs "${CONFIGS:-relay,noprefix,default}" --out "$out/multi_llama2.json" ;;
    serve3) python3 benchmarks/bench_serving.py --model "$m3" --rates "$RATES" --duration "$DUR" \
          --configs "${SERVE_CONFIGS:-default,relay}" --rounds "${ROUNDS:-1}" --out "$out/serving_llama3.json" ;;
  esac
done
