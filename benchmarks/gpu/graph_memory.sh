#!/usr/bin/env bash
# GPU host, after benchmarks/gpu/run_all.sh has installed the project: whether vLLM's estimate of a relay
# engine's CUDA-graph memory (which the KV cache leaves free) covers what the graphs take, and what the KV
# cache gets. One relay engine per shape (0.45 of the GPU, graphs up to 1024 with their levels twins) starts,
# runs 8 prompts x 4 samples, and vLLM's own lines are kept: "Profiling CUDA graph memory" (FULL must count
# the twins), "Estimated CUDA graph memory", "Available KV cache memory" and "CUDA graph pool memory: actual,
# estimated, difference".
# Usage: [SHAPES=llama-3-8b-shape,llama-2-7b-shape] [VARIANTS=VAR=value,...] bash benchmarks/gpu/graph_memory.sh
#   (<out>/graph_memory_<shape>.log, then <out>/graph_memory_<shape>_<VAR-value>.log with each variant set;
#   about 3 min an engine)
set -uo pipefail
export PYTHONPATH=/tmp/site VLLM_USE_FLASHINFER_SAMPLER=0 PYTHONUNBUFFERED=1
out=${OUT:-/tmp/out}; mkdir -p "$out"
engine() {  # MODEL LOG
  timeout 300 python3 - "$1" >"$2" 2>&1 <<'PY'
import sys

from vllm import LLM, SamplingParams

llm = LLM(model=sys.argv[1], load_format="dummy", max_model_len=4096, gpu_memory_utilization=0.45,
          attention_backend="relay", seed=0)
out = llm.generate([[1] + [100 + i for i in range(200)]] * 8, SamplingParams(n=4, max_tokens=32, ignore_eos=True))
print("completions", sum(len(o.outputs) for o in out))
PY
  echo "$2: exit $?"
  grep -E "Profiling CUDA graph memory|Estimated CUDA graph|CUDA graph pool memory|Available KV cache|completions|Error" \
    "$2" | cut -c1-230
}
IFS=, read -r -a shapes <<<"${SHAPES:-llama-3-8b-shape}"
IFS=, read -r -a variants <<<"${VARIANTS:-}"
for shape in "${shapes[@]}"; do
  m=$(python3 -m vllm_relay.testing build "$shape" | tail -1 | cut -f2)
  engine "$m" "$out/graph_memory_$shape.log"
  for v in "${variants[@]}"; do
    ( export "$v"; engine "$m" "$out/graph_memory_${shape}_${v/=/-}.log" )
  done
done
