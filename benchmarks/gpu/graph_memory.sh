#!/usr/bin/env bash
# GPU host, after benchmarks/gpu/run_all.sh has installed the project: whether vLLM's estimate of a relay
# engine's CUDA-graph memory (which the KV cache leaves free) covers what the graphs take. One relay engine
# (Llama-3-8B shape, 0.45 of the GPU, graphs up to 1024 with their levels twins) starts, runs 8 prompts x 4
# samples, and vLLM's own lines are kept: "Profiling CUDA graph memory" (FULL must count the twins),
# "Estimated CUDA graph memory" and "CUDA graph pool memory: actual, estimated, difference".
# Usage: bash benchmarks/gpu/graph_memory.sh   (<out>/graph_memory.log; about 3 min)
set -uo pipefail
export PYTHONPATH=/tmp/site VLLM_USE_FLASHINFER_SAMPLER=0 PYTHONUNBUFFERED=1
out=${OUT:-/tmp/out}; mkdir -p "$out"
m=$(python3 -m vllm_relay.testing build llama-3-8b-shape | tail -1 | cut -f2)
timeout 300 python3 - "$m" >"$out/graph_memory.log" 2>&1 <<'PY'
import sys

from vllm import LLM, SamplingParams

llm = LLM(model=sys.argv[1], load_format="dummy", max_model_len=4096, gpu_memory_utilization=0.45,
          attention_backend="relay", seed=0)
out = llm.generate([[1] + [100 + i for i in range(200)]] * 8, SamplingParams(n=4, max_tokens=32, ignore_eos=True))
print("completions", sum(len(o.outputs) for o in out))
PY
echo "exit $?"
grep -E "Profiling CUDA graph memory|Estimated CUDA graph|CUDA graph pool memory|Available KV cache|completions|Error" \
  "$out/graph_memory.log" | cut -c1-230
