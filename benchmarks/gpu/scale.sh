#!/usr/bin/env bash
# GPU hosts, after `bash benchmarks/gpu/acceptance.sh install` put the project into /tmp/site: relay
# under tensor and data parallelism, and many concurrent streams. Logs and JSON go under $OUT.
# Usage: bash benchmarks/gpu/scale.sh STEP...   with STEP one of (host kind; rough minutes)
#   exact-tp2-mha exact-tp2-gqa   relay vs FLASH_ATTN at TP=2, tiny MHA / GQA model (the gpu
#                     test's rules: graphs and eager relay, TRITON_ATTN as yardstick)          h200-x2; ~4 each
#   exact-dp2-mha exact-dp2-gqa   the same at DP=2 (two engine cores behind an AsyncLLM)   h200-x2; ~4 each
#   exact-tp4         the same at TP=4, GQA model (its 2 KV heads replicated)                 h200-x4; ~5
#   streams           `vllm serve --attention-backend relay` (Llama-2-7B shape, a 2k-token chat system
#                     prompt) and 1024 concurrent streams, each checked; relay's counters     h200;     ~5
set -uo pipefail
export PYTHONPATH=/tmp/site VLLM_USE_FLASHINFER_SAMPLER=0 PYTHONUNBUFFERED=1
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1  # the hosts' rule
out=${OUT:-/tmp/out}; mkdir -p "$out"
model() { python3 -m vllm_relay.testing build "$1" | tail -1 | cut -f2; }
gpu_tests() {  # $1: the pytest -k expression, $2: the log name
  timeout 520 python3 -m pytest -m gpu -q -s -p no:cacheprovider tests/e2e/test_gpu_relay.py -k "$1" 2>&1 \
    | tee "$out/$2.txt" | grep -E "relay vs FA|relay stats|passed|failed|skipped|Error" | tail -20
}
for step in "$@"; do
  case $step in
    exact-tp2-mha|exact-tp2-gqa|exact-dp2-mha|exact-dp2-gqa)
      par=${step#exact-}; gpu_tests "${par%-*} and ${par#*-}" "exact_${par%-*}_${par#*-}" ;;
    exact-tp4) gpu_tests "tp4 and gqa" exact_tp4_gqa ;;
    streams)
      m=$(model llama-2-7b-shape); port=8766; log="$out/streams_server.log"
      python3 -c "from vllm_relay.testing.tokenizer import SYSTEM_MESSAGE as m; print(' '.join([m] * 28), end='')" \
        > "$out/system.txt"  # about 2,050 tokens
      python3 -c "import json,sys; print(json.dumps({'support': {'chat_system': open(sys.argv[1]).read()}}))" \
        "$out/system.txt" > "$out/prompts.json"
      ulimit -n 65536 2>/dev/null || true
      VLLM_RELAY_SYSTEM_PROMPTS_FILE="$out/prompts.json" python3 -m vllm.entrypoints.cli.main serve "$m" \
        --load-format dummy --attention-backend relay --served-model-name llama-2-7b-shape --host 127.0.0.1 \
        --port $port --max-model-len 4096 --max-num-seqs 1024 --additional-config \
        '{"relay": {"max_prompts": 1, "max_prompt_tokens": 2304, "log_stats_interval_s": 1}}' \
        >"$log" 2>&1 &
      pid=$!
      for _ in $(seq 400); do
        curl -sf http://127.0.0.1:$port/health >/dev/null && break
        kill -0 $pid 2>/dev/null || { tail -40 "$log"; break; }
        sleep 1
      done
      timeout 400 python3 -m vllm_relay.testing.streams --url http://127.0.0.1:$port --model llama-2-7b-shape \
        --system "$(cat "$out/system.txt")" --streams 1024 --max-tokens 64 --drop 32 --server-log "$log" \
        --out "$out/streams.json" > "$out/streams.txt" 2>&1
      echo "streams check exit code $?"; grep -v '^ *"' "$out/streams.txt" | tail -3
      python3 -c "import json; s = json.load(open('$out/streams.json')); print({k: s[k] for k in ('streams', 'answered', 'dropped', 'lost', 'duplicated', 'num_problems', 'relay_sent', 'relay_counted', 'elapsed_s', 'completion_tokens_per_s')})"
      grep -E "vllm-relay: (system prompts ready|prompts:)" "$log" | tail -2
      kill -INT $pid 2>/dev/null; wait $pid 2>/dev/null || true ;;
    *) echo "unknown step $step"; exit 2 ;;
  esac
done
