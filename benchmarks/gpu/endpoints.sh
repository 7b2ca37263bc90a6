#!/usr/bin/env bash
# GPU host: serve the Llama-2-7B-shaped config folder (dummy weights) with relay attention and the
# relay endpoint plugin (VLLM_PLUGINS=relay), run the endpoint tests (tests/entrypoints/test_server.py)
# against it, keep the server log, the test output and the relay /metrics lines under $OUT.
# Usage, after `benchmarks/gpu/acceptance.sh install` put the project into /tmp/site:
#   bash benchmarks/gpu/endpoints.sh [MODEL_NAME]
set -uo pipefail
export PYTHONPATH=/tmp/site VLLM_USE_FLASHINFER_SAMPLER=0 PYTHONUNBUFFERED=1
out=${OUT:-/tmp/out}; mkdir -p "$out"
name=${1:-llama-2-7b-shape}
model=$(python3 -m vllm_relay.testing build "$name" | tail -1 | cut -f2)
config=$(python3 -m tests.entrypoints.server)  # the relay configuration the tests expect
port=8766
key=relay-test-key
VLLM_PLUGINS=relay VLLM_SERVER_DEV_MODE=1 python3 -m vllm.entrypoints.cli.main serve "$model" --load-format dummy \
  --attention-backend relay --served-model-name "$name" --host 127.0.0.1 --port $port --max-model-len 4096 \
  --api-key $key --enable-prompt-tokens-details --additional-config "$config" >"$out/endpoints_server.log" 2>&1 &
pid=$!
trap 'kill $pid 2>/dev/null; wait $pid 2>/dev/null || true' EXIT
for _ in $(seq 300); do
  curl -sf http://127.0.0.1:$port/health >/dev/null && break
  kill -0 $pid 2>/dev/null || { tail -50 "$out/endpoints_server.log"; exit 1; }
  sleep 1
done
VLLM_RELAY_TEST_SERVER=http://127.0.0.1:$port VLLM_RELAY_TEST_API_KEY=$key timeout 240 \
  python3 -m pytest -v -p no:cacheprovider tests/entrypoints/test_server.py 2>&1 | tee "$out/endpoints_tests.txt"
rc=${PIPESTATUS[0]}
curl -s http://127.0.0.1:$port/metrics | grep '^vllm_relay_' >"$out/endpoints_metrics.txt"
curl -s -H "Authorization: Bearer $key" http://127.0.0.1:$port/v1/relay/system_prompts >"$out/endpoints_prompts.json"
grep -E "vllm-relay|endpoint plugin" "$out/endpoints_server.log" | head -20
exit $rc
