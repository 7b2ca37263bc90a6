#!/usr/bin/env bash
# GPU host, after benchmarks/gpu/run_all.sh has installed the project: end-to-end relay runs.
# Usage: bash benchmarks/gpu/e2e.sh STEP...   with STEP one of
#   acc2 acc3           relay vs FLASH_ATTN logprobs/greedy agreement (Llama-2-7B / Llama-3-8B shapes)
#   tp2048 tp8192       throughput, relay vs default (Llama-2-7B shape), P = 2048 (1000 req) / 8192 (500 req)
#   ref2048             noprefix, v1 and `vllm bench throughput` references for P = 2048
#   noprefix            P = 0 with vLLM's default and with the relay backend (what relay costs there)
set -uo pipefail
export PYTHONPATH=/tmp/site VLLM_USE_FLASHINFER_SAMPLER=0 PYTHONUNBUFFERED=1
out=${OUT:-/tmp/out}; mkdir -p "$out"
m2=$(python3 -m vllm_relay.testing build llama-2-7b-shape | tail -1 | cut -f2)
m3=$(python3 -m vllm_relay.testing build llama-3-8b-shape | tail -1 | cut -f2)
bt="python3 benchmarks/bench_throughput.py"
for step in "$@"; do
  case $step in
    acc2) $bt --model "$m2" --accuracy --prefix-len 2048 --out "$out/acc_llama2.json" ;;
    acc3) $bt --model "$m3" --accuracy --prefix-len 2048 --out "$out/acc_llama3.json" ;;
    tp2048) $bt --model "$m2" --prefix-len 2048 --num-prompts 1000 --max-model-len 4096 \
              --configs default,relay --out "$out/tp_2048.json" ;;
    tp8192) $bt --model "$m2" --prefix-len 8192 --num-prompts 500 --max-model-len 9000 \
              --configs default,relay --out "$out/tp_8192.json" ;;
    ref2048) $bt --model "$m2" --prefix-len 2048 --num-prompts 1000 --max-model-len 4096 \
              --configs noprefix,v1,bench --out "$out/ref_2048.json" ;;
    noprefix) $bt --model "$m2" --prefix-len 2048 --num-prompts 1000 --max-model-len 4096 \
              --configs noprefix,noprefix-relay --out "$out/noprefix.json" ;;
    quick) $bt --model "$m2" --prefix-len 2048 --num-prompts 300 --max-model-len 4096 \
              --configs relay --out "$out/quick.json" ;;
  esac
done
