#!/usr/bin/env bash
# GPU host, after benchmarks/gpu/run_all.sh has installed the project: shared prefixes nobody
# registered, relay against vLLM's default, the ceiling and the bound.
# Usage: bash benchmarks/gpu/sharing.sh STEP...   with STEP one of
#   samples2    Hydragen's sweep on the Llama-2-7B shape: P in $PS, n in $NS, 128 output tokens
#   samples3    the same on the Llama-3-8B shape
#   tree2       a 2048-token system prompt over 8 documents x 4 questions x 8 samples: relay, relay
#               with the registered prompt only, default, ceiling (TREE_CONFIGS: a subset)
#   plain3      nothing shared: 1000 requests (128 in / 256 out), vLLM's default and the relay backend,
#               each run twice on its engine (bench_throughput.py noprefix, noprefix-relay)
#   serve3p     nothing shared, served: every request without a system prompt (--plain-fraction 1), streamed
#               through the OpenAI server at Poisson rates $RATES (default 1,4,8) for $DUR s each (default 20):
#               vLLM's default server and the relay backend with nothing registered (TTFT, TPOT p50)
# CONFIGS (default ceiling,relay,default), PS, NS tune the size; REPEAT (default 1) runs each samples2
# point that many times, with fresh ids each (the median).
set -uo pipefail
export PYTHONPATH=/tmp/site VLLM_USE_FLASHINFER_SAMPLER=0 PYTHONUNBUFFERED=1
out=${OUT:-/tmp/out}; mkdir -p "$out"
PS=${PS:-1024,16000}; NS=${NS:-64,256}; CONFIGS=${CONFIGS:-ceiling,relay,default}; REPEAT=${REPEAT:-1}
m2=$(python3 -m vllm_relay.testing build llama-2-7b-shape | tail -1 | cut -f2)
m3=$(python3 -m vllm_relay.testing build llama-3-8b-shape | tail -1 | cut -f2)
sb="python3 benchmarks/bench_sharing.py"
bt="python3 benchmarks/bench_throughput.py"
bs="python3 benchmarks/bench_serving.py"
for step in "$@"; do
  case $step in
    samples2) $sb --model "$m2" --workloads samples --prefix-lens "$PS" --ns "$NS" --configs "$CONFIGS" \
                --repeat "$REPEAT" --out "$out/sharing_samples_llama2.json" ;;
    samples3) $sb --model "$m3" --workloads samples --prefix-lens "$PS" --ns "$NS" --configs "$CONFIGS" \
                --out "$out/sharing_samples_llama3.json" ;;
    tree2) $sb --model "$m2" --workloads tree --configs "${TREE_CONFIGS:-ceiling,relay,relay-sysonly,default}" \
                --max-model-len 8192 --out "$out/sharing_tree_llama2.json" ;;
    plain3) $bt --model "$m3" --prefix-len 2048 --num-prompts 1000 --max-model-len 4096 --repeat 2 \
                --configs noprefix,noprefix-relay --out "$out/sharing_plain_llama3.json" ;;
    serve3p) $bs --model "$m3" --rates "${RATES:-1,4,8}" --duration "${DUR:-20}" --plain-fraction 1 \
                --configs default,relay-plain --out "$out/serving_plain_llama3.json" ;;
  esac
done
