#!/usr/bin/env bash
# Manage a relay server's system prompts with curl: list, register (text, chat messages, token ids,
# without waiting), read one, delete (the prompt drains: running requests finish on it).
# The server: VLLM_PLUGINS=relay vllm serve MODEL --attention-backend relay [--api-key KEY]
# Usage: BASE_URL=http://localhost:8000 API_KEY=KEY bash examples/manage_prompts.sh
set -euo pipefail
base=${BASE_URL:-http://localhost:8000}/v1/relay/system_prompts
auth=(); [[ -n ${API_KEY:-} ]] && auth=(-H "Authorization: Bearer $API_KEY")

call() {  # METHOD PATH [JSON]: prints the HTTP status and the JSON answer
  local method=$1 path=$2 data=${3:-}
  echo "> $method ${path:-/v1/relay/system_prompts} ${data}"
  curl -sS -X "$method" "${auth[@]}" -H 'Content-Type: application/json' ${data:+-d "$data"} \
    -w '\n< HTTP %{http_code}\n' "$base$path"
}

call GET ""
# A chat system message, rendered with the server's own chat template (201 once its KV is filled).
call POST "" '{"name": "support", "messages": [{"role": "system", "content": "You are the support assistant of a shipping company. Answer briefly, and ask for the tracking number when you need it."}]}'
# Completion text (tokenized like a completion prompt), registered without waiting: 202, "filling".
call POST "" '{"name": "manual", "text": "Shipping manual, chapter 1: parcels, their sizes and weights, how to pack them, and what each of them costs to send.", "wait": false}'
call GET /manual
# The same name again: 409. Token ids work too.
call POST "" '{"name": "support", "token_ids": [1, 2, 3]}'
call GET ""
# Delete: new requests stop using it at once; the slot is freed when its running requests finish.
call DELETE /support
call DELETE /manual
call DELETE /support   # 404 now
