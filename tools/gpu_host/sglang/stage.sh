#!/bin/bash
# Build an offline bundle of SGLang 0.5.23 for the GPU host (x86_64, Python 3.12.3, torch 2.11.0+cu130,
# no index), modelled on tools/gpu_host/stage.sh; run there on an H200 and an H100
# (benchmarks/results/2026-12-04_h200_vllm033_sglang, 2026-12-06_h100_vllm033_samples_sglang).
#
# SGLang 0.5.23 pins torch==2.14.1, sglang-kernel==0.4.10 (the renamed sgl-kernel; sgl-kernel itself
# stops at 0.3.21 and is not what 0.5.23 asks for), flashinfer_python[cu13]==0.7.2 and ~200 packages
# in all (the resolved list: sglang-0.5.23-*.txt beside this file, from `pip install --dry-run
# --report` for cp312/manylinux x86_64).
#
# MODE=overlay (default): the bundle goes BESIDE the vLLM 0.33 bundle (install-0.33.sh, /tmp/site).
#   It reuses that bundle's torch 2.14.0, triton 3.8.0, torchvision 0.29.0, NCCL 2.30.7 and the 35
#   small packages both need, and installs only what SGLang adds into /tmp/site-sglang, which goes
#   first on PYTHONPATH (PYTHONPATH=/tmp/site-sglang:...:/tmp/site). torch 2.14.0 instead of the
#   pinned 2.14.1: libtorch*/libc10* of 2.14.0 and 2.14.1 export the same dynamic symbols (97,821
#   each; the only 3 that differ are anonymous-namespace nvshmem-extension internals), and every
#   torch symbol that sgl_kernel, flash_mla, deep_gemm, deep_ep, torchcodec, torchvision and sglang's
#   own .so files import is defined in 2.14.0. SGLang checks only minimum versions at run time.
#   Five packages are brought in SGLang's version and shadow the vLLM bundle's while the overlay is
#   first on the path: openai 2.8.0 (vLLM: 3.57.0), xgrammar 0.2.7 (0.2.8), compressed-tensors 0.18.0
#   (0.17.0), outlines_core 0.1.26 (0.2.14, for outlines 0.1.11), openai-harmony 0.0.4 (vLLM's
#   oss-harmony 0.0.11 ships the same module, openai_harmony). So never put /tmp/site-sglang on
#   vLLM's path.
# MODE=standalone: no vLLM bundle needed. Adds torch 2.14.1, triton 3.8.0, torchvision 0.29.1,
#   NCCL 2.30.7 and those 35 packages (sglang-0.5.23-from-vllm033.txt) to the same site.
#
# Left out, by design (see the lists): the host's torch 2.11 CUDA libraries and the general Python
#   packages the host already has (sglang-0.5.23-host-assumed.txt; install-sglang.sh reports any that
#   turn out to be missing), the cu12 flavour of the CUTLASS DSL (never chosen when the cu13 one is
#   there and the driver is CUDA 13), sgl_kernel's sm100 build and its cp310-only infllm_ops, and
#   sglang/multimodal_gen (diffusion). WITH_NVCC=1 adds the CUDA 13.5 nvcc/crt/nvvm/cccl wheels
#   (FlashInfer's and SGLang's JIT kernels otherwise use the host's nvcc); WITH_EXTRAS=1 adds scipy,
#   datasets/pyarrow/pandas and IPython, which the serving path does not import at start-up.
#   WITH_CUDNN=1 (standalone only) adds cuDNN 9.24.0.43. No flashinfer-cubin/flashinfer-jit-cache:
#   neither exists for 0.7.2 on the indexes reachable here, so FlashInfer JIT-compiles on the host.
#
# Usage:  bash tools/gpu_host/sglang/stage.sh [OUT_DIR]        (default .gpu-stage-sglang/)
# Writes OUT_DIR/sg_part_00, sg_part_01, ... (each <= PIECE_MIB, default 45 MiB: a call carries the working
# tree and one piece, 64 MiB in all) to be copied to
# /tmp/sglang-parts/ on the host (NOT /tmp/gpu-parts: install-0.33.sh cats every part_* there), and
# install-sglang.sh. Cache: $SGLANG_STAGE_CACHE (default ~/.cache/vllm-relay-gpu-stage-sglang). XZ_THREADS (default 2).
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
out=${1:-.gpu-stage-sglang}
cache=${SGLANG_STAGE_CACHE:-$HOME/.cache/vllm-relay-gpu-stage-sglang}
vllm_cache=${VLLM_RELAY_STAGE_CACHE:-$HOME/.cache/vllm-relay-gpu-stage-033}
mode=${MODE:-overlay}
xz_threads=${XZ_THREADS:-2}
piece=$(( ${PIECE_MIB:-45} * 1024 * 1024 ))
case $mode in overlay|standalone) ;; *) echo "MODE must be overlay or standalone" >&2; exit 2;; esac
mkdir -p "$cache" "$out"
# The machine's pip constraints file caps torch; it must not filter these pinned downloads.
export PIP_CONSTRAINT=
platforms=()
for n in 17 18 24 25 27 28 31 34 35; do platforms+=(--platform "manylinux_2_${n}_x86_64"); done
platforms+=(--platform manylinux2014_x86_64 --platform manylinux2010_x86_64 --platform manylinux1_x86_64 --platform any)
# sglang 0.5.23 exists only as cp311/cp312/cp313 manylinux_2_34 wheels (no py3-none-any); pip does
# not widen a --platform tag, so manylinux_2_34 must be named (it is, above).
pyargs=(--python-version 3.12 --implementation cp --abi cp312 --abi abi3 --abi none)

pip_target() {
  local dst=$1; shift
  python3 -m pip install -q --no-deps --no-index --no-compile --no-cache-dir --only-binary=:all: \
    "${pyargs[@]}" "${platforms[@]}" --target "$dst" "$@"
  # Keep only real executables in bin/ (ninja, py-spy); console scripts carry this machine's shebang.
  if [ -d "$dst/bin" ]; then
    for f in "$dst"/bin/*; do head -c 4 "$f" | grep -q 'ELF' || rm -f "$f"; done
    rmdir "$dst/bin" 2>/dev/null || true
  fi
}

# component NAME "PIP ARGS" [PATTERN ...]: download (PIP ARGS: one spec, or -r FILE), install into an
# empty tree as the host's pip would, delete PATTERNs, keep the tree as NAME.tar.xz.
component() {
  local name=$1 spec=$2; shift 2
  local dst=$cache/$name.tar.xz key dl tree
  key=$(echo "$spec" | sha256sum | cut -c1-12)
  case $spec in -r\ *) key=$key-$(sha256sum "${spec#-r }" | cut -c1-12);; esac
  if [ -f "$dst" ] && [ "$(cat "$cache/$name.key" 2>/dev/null)" = "$key" ]; then return 0; fi
  dl=$cache/dl/$name-$key
  mkdir -p "$dl"
  if [ ! -f "$dl/.done" ]; then
    # shellcheck disable=SC2086
    python3 -m pip download -q --no-deps --only-binary=:all: "${pyargs[@]}" "${platforms[@]}" -d "$dl" $spec
    touch "$dl/.done"
  fi
  tree=$(mktemp -d "$cache/tree.XXXXXX")
  pip_target "$tree" "$dl"/*.whl
  (cd "$tree" && for p in "$@"; do rm -rf -- $p; done)
  tar -C "$tree" --sort=name --owner=0 --group=0 --numeric-owner -cf - . |
    xz -T"$xz_threads" -6 > "$dst.partial"
  mv "$dst.partial" "$dst" && echo "$key" > "$cache/$name.key"
  rm -rf "$tree"
  echo "component $name: $(stat -c %s "$dst") bytes"
}

# 1. sglang-kernel 0.4.10 (FA3 flash_ops 1.1 GB unpacked, common_ops, flashmla_ops): the sm90 build
#    only; sm100/ is what it loads on any other GPU, infllm_ops is a CPython 3.10-only extension.
component sglkernel "sglang-kernel==0.4.10" \
  sgl_kernel/sm100 'sgl_kernel/infllm_ops.cpython-310-*.so'
# 2. SGLang itself, without the diffusion runtime.
component sglang "sglang==0.5.23" sglang/multimodal_gen
# 3. FlashInfer 0.7.2 (sources and headers it JIT-compiles from; no AOT cubins exist for 0.7.2).
component flashinfer "flashinfer-python==0.7.2"
# 4. The other compiled GPU packages SGLang imports: CUTLASS DSL (cu13 flavour), quack, FA4, cuda-python,
#    tilelang (+z3), humming, deep_gemm/deep_ep/flash_mla, torch_memory_saver, torchaudio/torchcodec, numba.
component kernels "-r $here/sglang-0.5.23-kernels.txt" \
  'nvidia_cutlass_dsl/cu13/lib/stubs' 'nvidia_cutlass_dsl/cu13/lib/*_static.a'
# 5. Python packages SGLang needs beyond the host and the vLLM bundle, incl. the five it pins differently.
component deps "-r $here/sglang-0.5.23-deps.txt"
names="sglkernel sglang flashinfer kernels deps"
if [ "${WITH_NVCC:-0}" = 1 ]; then component nvcc "-r $here/sglang-0.5.23-nvcc.txt"; names="$names nvcc"; fi
if [ "${WITH_EXTRAS:-0}" = 1 ]; then component extras "-r $here/sglang-0.5.23-extras.txt"; names="$names extras"; fi
if [ "$mode" = standalone ]; then
  # triton 3.8.0 and NCCL 2.30.7 are the vLLM 0.33 bundle's own versions: reuse its compressed trees.
  for c in triton nccl; do
    [ -f "$cache/$c.tar.xz" ] || { [ -f "$vllm_cache/$c.tar.xz" ] && cp "$vllm_cache/$c.tar.xz" "$cache/"; }
  done
  [ -f "$cache/triton.tar.xz" ] || component triton "triton==3.8.0" \
    'triton/backends/nvidia/lib/cupti/*_static.a' 'triton/backends/nvidia/lib/cupti-blackwell' \
    'triton/backends/nvidia/bin/ptxas-blackwell'
  [ -f "$cache/nccl.tar.xz" ] || component nccl "nvidia-nccl-cu13==2.30.7"
  component torch "torch==2.14.1"
  component torchvision "torchvision==0.29.1"
  grep -vE '^(torch|torchvision|triton|nvidia-nccl-cu13)==' "$here/sglang-0.5.23-from-vllm033.txt" > "$cache/shared-deps.txt"
  component shareddeps "-r $cache/shared-deps.txt"
  names="$names torch triton torchvision nccl shareddeps"
  if [ "${WITH_CUDNN:-0}" = 1 ]; then component cudnn "nvidia-cudnn-cu13==9.24.0.43"; names="$names cudnn"; fi
fi

# 6. One tar (checksums + mode), cut into pieces.
bundle=$(mktemp -d "$cache/bundle.XXXXXX")
for c in $names; do ln "$cache/$c.tar.xz" "$bundle/$c.tar.xz" 2>/dev/null || cp "$cache/$c.tar.xz" "$bundle/"; done
echo "$mode" > "$bundle/MODE"
cp "$here/sglang-0.5.23-host-assumed.txt" "$bundle/host-assumed.txt"
(cd "$bundle" && sha256sum -- *.tar.xz MODE host-assumed.txt > SHA256SUMS)
rm -f "$out"/sg_part_*
tar -C "$bundle" -cf "$bundle.tar" SHA256SUMS MODE host-assumed.txt $(for c in $names; do echo "$c.tar.xz"; done)
size=$(stat -c %s "$bundle.tar")
n=$(( (size + piece - 1) / piece ))
split -n "$n" -d "$bundle.tar" "$out/sg_part_"
rm -rf "$bundle" "$bundle.tar"
cp "$here/install.sh" "$out/install-sglang.sh"
ls -l "$out"
echo "staged $(ls "$out"/sg_part_* | wc -l) parts ($size bytes, mode $mode: $names) in $out"
