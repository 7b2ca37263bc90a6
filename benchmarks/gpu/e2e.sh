#!/usr/bin/env bash
# GPU host, after benchmarks/gpu/run_all.sh has installed the project: end-to-end relay runs.
# Usage: bash benchmarks/gpu/e2e.sh STEP...   with STEP one of
#   acc2 acc3        relay vs FLASH_ATTN logprobs/greedy agreement (Llama-2-7B / Llama-3-8B shapes)
#   l2 l3            throughput, single (P=2048) and multi-prompt workloads, default / relay / no system
#                    prompt (+ relay backend without prompts on l3), and the decode-latency sweep
#   l3_n1000 l2_n1000  the acceptance size (1000 requests; results/archive/2026-11-22_h200_n1000/): Llama-3 run twice per engine
#                    with the relay backend without prompts, Llama-2 single and multi-prompt (about 8 min each)
#   l3_runners       no system prompt at 1000 requests, run twice per engine: vLLM's default and the relay
#                    backend with nothing registered, both on Model Runner V2
#   prof_l2 prof_l3  1000 requests, relay and no prompt, with vLLM's torch profiler over 8 decode steps
#                    after 100: each kernel's GPU time (<out>/prof_llama{2,3}.<config>.profile/), about 6 min
#   graphs_l3        Llama-3-8B, P=2048, 1000 requests: vLLM's default and relay with vLLM's largest CUDA graph
#                    (512: decode batches above it run eagerly) and with graphs up to 1024 (<out>/graphs_l3_*.json)
#   single2          the headline ratio to no prompt: Llama-2-7B shape, P=2048, 1000 requests, relay and no system prompt,
#                    each engine run twice (about 4 min); with VARIANTS (comma-separated VAR=value environment
#                    settings, e.g. VLLM_RELAY_UNSPLIT_GRAPHS=0), relay again under each into single_llama2_VAR-value.json
#                    (no "=": the device tool leaves such names behind): an A/B in one job (l2_8192 takes VARIANTS too)
#   single2r         single2 with the relay backend on the same requests without the prompt (noprefix-relay)
#                    beside: how much of relay's gap to no-prompt is the relay backend itself rather than relay's
#                    work (about 8 min)
#   single2m         single2, then relay with vLLM not taking its CUDA-graph memory estimate from the KV cache
#                    (VLLM_MEMORY_PROFILER_ESTIMATE_CUDAGRAPHS=0: a larger KV cache)
#   multi2 multi3    the multi-prompt workload (four system prompts, 20% plain requests), 1000 requests, each
#                    engine run twice: relay, no system prompt, vLLM's default (Llama-2-7B / Llama-3-8B shapes;
#                    CONFIGS=relay,noprefix leaves the default out: on the H100 the three outgrow a 570 s call)
#   l2_8192          throughput, P = 8192, default / relay / no system prompt (Llama-2-7B shape)
#   serve2 serve3    serving through the OpenAI server at Poisson rates, default vs relay
#   tp2048 tp8192 ref2048 noprefix   the earlier single-workload runs (see benchmarks/README.md)
# N (requests per throughput workload, default 500) and RATES (default 1,4,8,16,32) tune the size; l2 and l3
# take CONFIGS, REPEAT, LATENCY (set empty: no decode-latency sweep) and VARIANTS;
# l2_8192 also takes CONFIGS (default default,relay,noprefix) and REPEAT (runs per engine, default 1); single2
# takes CONFIGS (default relay,noprefix); serve3 SERVE_CONFIGS (default default,relay; relay-plain: nothing registered) and ROUNDS (above 1: the servers
# up at once on one GPU, the rates run on each in turn, ROUNDS times).
# BT_EXTRA: more bench_throughput.py options for every throughput step, e.g. BT_EXTRA=--triton-cache=/tmp/tc
# (a fresh Triton cache per configuration: the kernels compiled inside a timed run are named in its JSON).
set -uo pipefail
export PYTHONPATH=/tmp/site VLLM_USE_FLASHINFER_SAMPLER=0 PYTHONUNBUFFERED=1
out=${OUT:-/tmp/out}; mkdir -p "$out"
N=${N:-500}; RATES=${RATES:-1,4,8,16,32}; DUR=${DUR:-20}; VARIANTS=${VARIANTS:-}
m2=$(python3 -m vllm_relay.testing build llama-2-7b-shape | tail -1 | cut -f2)
m3=$(python3 -m vllm_relay.testing build llama-3-8b-shape | tail -1 | cut -f2)
bt="python3 benchmarks/bench_throughput.py ${BT_EXTRA:-}"
bs="python3 benchmarks/bench_serving.py"
variants() {  # ARGS NAME: relay again under each of $VARIANTS, into NAME_VAR-value.json
  for v in ${VARIANTS//,/ }; do env "$v" $bt $1 --configs relay --out "$out/${2}_${v/=/-}.json"; done
}
for step in "$@"; do
  case $step in
    acc2) $bt --model "$m2" --accuracy --prefix-len 2048 --out "$out/acc_llama2.json" ;;
    acc3) $bt --model "$m3" --accuracy --prefix-len 2048 --out "$out/acc_llama3.json" ;;
    l2|l3)
      m=$m2 name=llama2 configs=default,relay,noprefix
      [ $step = l3 ] && m=$m3 name=llama3 configs=default,relay,noprefix,noprefix-relay
      a="--model $m --prefix-len 2048 --num-prompts $N --max-model-len 5120 --workloads single,multi"
      a="$a ${LATENCY---latency} --repeat ${REPEAT:-1}"
      $bt $a --configs "${CONFIGS:-$configs}" --out "$out/e2e_$name.json" && variants "$a" "e2e_$name" ;;
    l3_n1000) $bt --model "$m3" --prefix-len 2048 --num-prompts 1000 --max-model-len 4096 --repeat 2 \
          --triton-cache /tmp/tc-l3 --configs relay,noprefix,noprefix-relay,default --out "$out/e2e_llama3_n1000.json" ;;
    l3_runners) $bt --model "$m3" --prefix-len 2048 --num-prompts 1000 --max-model-len 4096 --repeat 2 \
          --triton-cache /tmp/tc-l3r --configs noprefix,noprefix-relay --out "$out/e2e_llama3_runners.json" ;;
    l2_n1000) $bt --model "$m2" --prefix-len 2048 --num-prompts 1000 --max-model-len 5120 --workloads single,multi \
          --triton-cache /tmp/tc-l2 --configs relay,noprefix,default --out "$out/e2e_llama2_n1000.json" ;;
    prof_l2) $bt --model "$m2" --prefix-len 2048 --num-prompts 1000 --max-model-len 5120 --profile 100,8 \
          --configs relay,noprefix --out "$out/prof_llama2.json" ;;
    prof_l3) $bt --model "$m3" --prefix-len 2048 --num-prompts 1000 --max-model-len 4096 --profile 100,8 \
          --configs relay,noprefix --out "$out/prof_llama3.json" ;;
    graphs_l3)
      for g in 512 1024; do
        $bt --model "$m3" --prefix-len 2048 --num-prompts 1000 --max-model-len 4096 --max-cudagraph-capture-size $g \
            --configs default,relay --out "$out/graphs_l3_$g.json"
      done ;;
    single2|single2r)
      c=${CONFIGS:-relay,noprefix}; f=single_llama2; [ $step = single2r ] && c=$c,noprefix-relay && f=${f}_runners
      a="--model $m2 --prefix-len 2048 --num-prompts 1000 --max-model-len 5120 --repeat 2"
      $bt $a --configs $c --out "$out/$f.json" && variants "$a" $f ;;
    single2m)
      a="--model $m2 --prefix-len 2048 --num-prompts 1000 --max-model-len 5120 --repeat 2"
      f=single_llama2_graph_estimate
      $bt $a --configs relay,noprefix --out "$out/$f.json" &&
        env VLLM_MEMORY_PROFILER_ESTIMATE_CUDAGRAPHS=0 $bt $a --configs relay --out "$out/${f}0.json" ;;
    multi2|multi3)
      m=$m2; [ $step = multi3 ] && m=$m3
      $bt --model "$m" --prefix-len 2048 --num-prompts 1000 --max-model-len 5120 --workloads multi --repeat 2 \
          --configs "${CONFIGS:-relay,noprefix,default}" --out "$out/multi_llama${step#multi}.json" ;;
    l2_8192)
      a="--model $m2 --prefix-len 8192 --num-prompts $N --max-model-len 9000 --repeat ${REPEAT:-1}"
      $bt $a --configs "${CONFIGS:-default,relay,noprefix}" --out "$out/e2e_llama2_8192.json" &&
        variants "$a" e2e_llama2_8192 ;;
    serve2) $bs --model "$m2" --rates "$RATES" --duration "$DUR" --out "$out/serving_llama2.json" ;;
    serve3) $bs --model "$m3" --rates "$RATES" --duration "$DUR" --configs "${SERVE_CONFIGS:-default,relay}" \
              --rounds "${ROUNDS:-1}" --out "$out/serving_llama3.json" ;;
    tp2048) $bt --model "$m2" --prefix-len 2048 --num-prompts 1000 --max-model-len 4096 \
              --configs default,relay --out "$out/tp_2048.json" ;;
    tp8192) $bt --model "$m2" --prefix-len 8192 --num-prompts 500 --max-model-len 9000 \
              --configs default,relay --out "$out/tp_8192.json" ;;
    ref2048) $bt --model "$m2" --prefix-len 2048 --num-prompts 1000 --max-model-len 4096 \
              --configs noprefix,bench --out "$out/ref_2048.json" ;;
    noprefix) $bt --model "$m2" --prefix-len 2048 --num-prompts 1000 --max-model-len 4096 \
              --configs noprefix,noprefix-relay --out "$out/noprefix.json" ;;
  esac
done
