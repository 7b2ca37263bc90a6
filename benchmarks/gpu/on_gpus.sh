#!/usr/bin/env bash
# A multi-GPU host, after benchmarks/gpu/run_all.sh has installed the project: single-GPU steps of the
# other scripts side by side, one GPU each, so one device call does the work of several.
# Usage: bash benchmarks/gpu/on_gpus.sh "JOB" ...   with JOB as "[VAR=value ...] SCRIPT STEP...", e.g.
#   bash benchmarks/gpu/on_gpus.sh "sharing.sh prof1024" "N=1000 e2e.sh prof_l2" "sharing.sh plain3"
# Job i runs `bash benchmarks/gpu/SCRIPT STEP...` with CUDA_VISIBLE_DEVICES=i, OUT=$OUT/gpu<i> and its own
# vLLM cache folder (no two engines compile into one), its output in $OUT/gpu<i>/job.log, for at most
# JOB_TIMEOUT seconds (default 560). Ratios count within a job only: each job's configurations share a GPU.
# PACK=1 then packs all of $OUT into $OUT/results.tgz (the device tool brings back at most 8 files),
# leaving out files over 15 MB (profiler traces).
set -uo pipefail
out=${OUT:-/tmp/out}; limit=${JOB_TIMEOUT:-560}
gpus=$(nvidia-smi -L | wc -l)
[ $# -le "$gpus" ] || { echo "$# jobs for $gpus GPUs"; exit 2; }
i=0
for job in "$@"; do
  read -r -a words <<<"$job"
  vars=()
  while [[ ${words[0]} == *=* ]]; do vars+=("${words[0]}"); words=("${words[@]:1}"); done
  mkdir -p "$out/gpu$i"
  ( env "${vars[@]}" CUDA_VISIBLE_DEVICES=$i OUT="$out/gpu$i" VLLM_CACHE_ROOT="/tmp/vllm-cache-gpu$i" \
      timeout "$limit" bash "benchmarks/gpu/${words[0]}" "${words[@]:1}" >"$out/gpu$i/job.log" 2>&1
    echo "gpu$i [$job] exit $?" ) &
  i=$((i + 1))
done
wait
if [ "${PACK:-0}" = 1 ]; then
  tar -czf /tmp/results.tgz -C "$out" --exclude=results.tgz \
    $(cd "$out" && find . -type f -size -15M | sed 's|^\./||') && rm -rf "${out:?}"/* && mv /tmp/results.tgz "$out/"
  ls -l "$out"
fi
