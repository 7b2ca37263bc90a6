#!/usr/bin/env bash
# GPU host: serve the Llama-2-7B-shaped config folder (dummy weights) with relay attention, send one
# chat completion, print the relay/backend log lines and the reply, stop the server.
# Usage: bash benchmarks/gpu/serve_smoke.sh [MODEL_NAME] [LOG]
set -euo pipefail
name=${1:-llama-2-7b-shape}
log=${2:-/tmp/serve_smoke.log}
model=$(python3 -m vllm_relay.testing build "$name" | tail -1 | cut -f2)
port=8765
python3 -m vllm.entrypoints.cli.main serve "$model" --load-format dummy --attention-backend relay \
  --served-model-name "$name" --host 127.0.0.1 --port $port --max-model-len 4096 >"$log" 2>&1 &
pid=$!
trap 'kill $pid 2>/dev/null; wait $pid 2>/dev/null || true' EXIT
for _ in $(seq 600); do
  curl -sf http://127.0.0.1:$port/health >/dev/null && break
  kill -0 $pid 2>/dev/null || { tail -50 "$log"; exit 1; }
  sleep 1
done
curl -sf http://127.0.0.1:$port/v1/chat/completions -H 'Content-Type: application/json' -d "{
  \"model\": \"$name\", \"max_tokens\": 16, \"temperature\": 0,
  \"messages\": [{\"role\": \"system\", \"content\": \"You are a terse assistant.\"},
                 {\"role\": \"user\", \"content\": \"Where is my parcel?\"}]}" | tee /tmp/serve_smoke_reply.json
echo
grep -E "vllm-relay|Using .* backend|attention backend|FlashAttention version" "$log" | head -20
