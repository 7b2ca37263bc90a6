#!/usr/bin/env bash
# GPU host, after benchmarks/gpu/run_all.sh has installed the project: shared prefixes nobody
# registered, relay against vLLM's default, the ceiling and the bound.
# Usage: bash benchmarks/gpu/sharing.sh STEP...   with STEP one of
#   samples2    Hydragen's sweep on the Llama-2-7B shape: P in $PS, n in $NS, 128 output tokens; with VARIANTS
#               (comma-separated VAR=value tuning knobs), relay again under each into
#               sharing_samples_llama2_VAR-value.json: an A/B in one job (samples2x: the same step)
#   samples3    the same on the Llama-3-8B shape
#   latency2    decode-step latency against n at contexts $CS (bifurcated attention's figure)
#   tree2       a 2048-token system prompt over 8 documents x 4 questions x 8 samples: relay, relay
#               with the registered prompt only, default, ceiling (TREE_CONFIGS: a subset)
#   plain3      nothing shared: 1000 requests (128 in / 256 out), vLLM's default and the relay backend,
#               each run twice on its engine (bench_throughput.py noprefix, noprefix-relay)
#   serve3p     nothing shared, served: every request without a system prompt (--plain-fraction 1), streamed
#               through the OpenAI server at Poisson rates $RATES (default 1,4,8) for $DUR s each (default 20):
#               vLLM's default server and the relay backend with nothing registered (TTFT, TPOT p50)
#   acct16k     where relay's time goes at P=16000, n=256 (ACCT_P, ACCT_N): relay and the ceiling, each one's first run
#               under vLLM's torch profiler whole (--profile 0,0; its kernel table in
#               <out>/acct16k.CONFIG.profile/), then a second run unprofiled
#   prof1024    where relay's time goes at n=1024 (P=$PPROF, default 4096): vLLM's torch profiler over
#               6 decode steps after 40 and the per-step log (<out>/prof1024.*)
#   single3     the registered single-prompt workload (P=2048, 1000 requests): default, relay, no prompt
#   spy2        where the engine's host time goes on one samples point ($PS, $NS; each of $CONFIGS in
#               turn, vLLM's per-step log on): py-spy over every process, idle stacks included, raw
#               into $OUT/spy_CONFIG.txt (PYSPY: the py-spy binary)
# CONFIGS (default ceiling,relay,default), PS, NS, CS tune the size; REPEAT (default 1) runs each samples2
# point that many times, with fresh ids each (the median).
set -uo pipefail
export PYTHONPATH=/tmp/site VLLM_USE_FLASHINFER_SAMPLER=0 PYTHONUNBUFFERED=1
out=${OUT:-/tmp/out}; mkdir -p "$out"
PS=${PS:-1024,16000}; NS=${NS:-64,256}; CS=${CS:-8192}; CONFIGS=${CONFIGS:-ceiling,relay,default}
REPEAT=${REPEAT:-1}; VARIANTS=${VARIANTS:-}
m2=$(python3 -m vllm_relay.testing build llama-2-7b-shape | tail -1 | cut -f2)
m3=$(python3 -m vllm_relay.testing build llama-3-8b-shape | tail -1 | cut -f2)
sb="python3 benchmarks/bench_sharing.py"
bt="python3 benchmarks/bench_throughput.py"
bs="python3 benchmarks/bench_serving.py"
for step in "$@"; do
  case $step in
    samples2|samples2x) $sb --model "$m2" --workloads samples --prefix-lens "$PS" --ns "$NS" --configs "$CONFIGS" \
                --repeat "$REPEAT" --out "$out/sharing_samples_llama2.json"
               for v in ${VARIANTS//,/ }; do
                 env "$v" $sb --model "$m2" --workloads samples --prefix-lens "$PS" --ns "$NS" --configs relay \
                   --repeat "$REPEAT" --out "$out/sharing_samples_llama2_${v/=/-}.json"
               done ;;
    samples3) $sb --model "$m3" --workloads samples --prefix-lens "$PS" --ns "$NS" --configs "$CONFIGS" \
                --out "$out/sharing_samples_llama3.json" ;;
    latency2) $sb --model "$m2" --workloads latency --contexts "$CS" --latency-ns 1,8,64 --configs relay,default \
                --out "$out/sharing_latency_llama2.json" ;;
    tree2) $sb --model "$m2" --workloads tree --configs "${TREE_CONFIGS:-ceiling,relay,relay-sysonly,default}" \
                --max-model-len 8192 --out "$out/sharing_tree_llama2.json" ;;
    plain3) $bt --model "$m3" --prefix-len 2048 --num-prompts 1000 --max-model-len 4096 --repeat 2 \
                --configs noprefix,noprefix-relay --out "$out/sharing_plain_llama3.json" ;;
    serve3p) $bs --model "$m3" --rates "${RATES:-1,4,8}" --duration "${DUR:-20}" --plain-fraction 1 \
                --configs default,relay-plain --out "$out/serving_plain_llama3.json" ;;
    acct16k) VLLM_CUSTOM_SCOPES_FOR_PROFILING=1 $sb --model "$m2" --workloads samples --prefix-lens "${ACCT_P:-16000}" \
                --ns "${ACCT_N:-256}" --configs ceiling,relay --repeat 2 --profile 0,0 --out "$out/acct16k.json" ;;
    prof1024) $sb --model "$m2" --workloads samples --prefix-lens "${PPROF:-4096}" --ns 1024 --configs relay \
                --iteration-details --profile 40,6 --out "$out/prof1024.json" ;;
    spy2) for c in ${CONFIGS//,/ }; do
            timeout 300 "${PYSPY:-py-spy}" record -r 50 --idle --threads --subprocesses -f raw -o "$out/spy_$c.txt" -- \
              $sb --model "$m2" --workloads samples --prefix-lens "$PS" --ns "$NS" --worker "$c" --iteration-details \
              >"$out/spy_$c.log" 2>&1
            grep -E "tok/s|Error" "$out/spy_$c.log" | cut -c1-200
          done ;;
    single3) $bt --model "$m3" --prefix-len 2048 --num-prompts 1000 --max-model-len 4096 \
                --configs default,relay,noprefix --out "$out/sharing_single_llama3.json" ;;
  esac
done
