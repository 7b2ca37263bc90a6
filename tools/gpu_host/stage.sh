#!/bin/bash
# Build an offline bundle of vLLM 0.33.0 for the GPU host, which has no package index and has
# Python 3.12.3, torch 2.11.0+cu130, triton 3.6.0 and torch 2.11's CUDA 13 libraries (see tools/README.md,
# "On a GPU host"). vLLM 0.33.0 pins torch==2.14.0, and torch 2.14.0 needs triton~=3.8.0 and an NCCL
# newer than the host's (its libtorch_cuda.so calls ncclCommSuspend/ncclCommGrow/..., absent from
# NCCL 2.28.9, which torch 2.11.0 pins), so the bundle also brings torch 2.14.0, triton 3.8.0,
# torchvision 0.29.0 (the one built for torch 2.14) and nvidia-nccl-cu13 2.30.7. The host's other
# CUDA 13 libraries (cuBLAS, cuDNN 9.19, cuSPARSELt, NVSHMEM, cudart, ...) are used as they are.
#
# Usage (from the repository's root):  bash tools/gpu_host/stage.sh [OUT_DIR]
# Writes OUT_DIR (default .gpu-stage-033/, which it adds to .git/info/exclude):
#   part_00, part_01, ...  pieces of one tar (each <= PIECE_MIB, default 48 MiB), to be copied to /tmp/gpu-parts/ on the host
#   install.sh             run on the host: reassembles the pieces, installs everything into /tmp/site
#   smoke.py               run on the host after it: a tiny Llama generate through vLLM (FLASH_ATTN)
# Downloads and the compressed components are cached in ~/.cache/vllm-relay-gpu-stage-033, so a
# second run takes seconds. The first took 16 minutes on 2 cores (xz -6 -T2 is the slow part).
# Set WITH_CUDNN=1 to also bring cuDNN 9.24.0.43 (torch 2.14's pin; +~450 MB): without it
# torch.backends.cudnn.version() raises "cuDNN version incompatibility" on the host (9.19 there);
# a dense decoder-only model in vLLM never calls cuDNN.
# XZ_THREADS (default 2) sets xz's threads here: about 100 MB of memory each at -6.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
out=${1:-.gpu-stage-033}
cache=${VLLM_RELAY_STAGE_CACHE:-$HOME/.cache/vllm-relay-gpu-stage-033}
xz_threads=${XZ_THREADS:-2}
with_cudnn=${WITH_CUDNN:-0}
vllm_version=0.33.0
torch_version=2.14.0
triton_version=3.8.0
torchvision_version=0.29.0
nccl_version=2.30.7
cudnn_version=9.24.0.43
mkdir -p "$cache" "$out"
if [ -d .git ] && ! grep -qx "/$out/" .git/info/exclude 2>/dev/null; then
  mkdir -p .git/info && echo "/$out/" >> .git/info/exclude
fi
platforms=()
for n in 17 18 24 25 27 28 31 34 35; do platforms+=(--platform "manylinux_2_${n}_x86_64"); done
platforms+=(--platform manylinux2014_x86_64 --platform manylinux2010_x86_64 --platform manylinux1_x86_64 --platform any)
# pip install --target for the host's Python (3.12, x86_64), run here: no compile, no scripts kept.
pip_target() {
  local dst=$1; shift
  python3 -m pip install -q --no-deps --no-index --no-compile --no-cache-dir --only-binary=:all: \
    --python-version 3.12 --implementation cp "${platforms[@]}" --target "$dst" "$@"
  rm -rf "$dst/bin"
}

# component NAME SPEC [PATTERN ...]: download SPEC's wheel, install it into an empty tree as the
# host's pip would, delete PATTERNs (globs relative to the tree), and keep the tree as NAME.tar.xz.
component() {
  local name=$1 spec=$2; shift 2
  local dst=$cache/$name.tar.xz
  [ -f "$dst" ] && return 0
  local dl=$cache/dl/${spec/==/-} tree
  mkdir -p "$dl"
  ls "$dl"/*.whl >/dev/null 2>&1 || python3 -m pip download -q --no-deps --only-binary=:all: \
    --python-version 3.12 --implementation cp "${platforms[@]}" -d "$dl" "$spec"
  tree=$(mktemp -d "$cache/tree.XXXXXX")
  pip_target "$tree" "$dl"/*.whl
  (cd "$tree" && for p in "$@"; do rm -rf -- $p; done)
  # xz of the unpacked files beats the wheels' zip: torch 555 MB as a wheel, 437 MB here;
  # triton 248 -> 115 MB (with the cuts below), NCCL 216 -> 201 MB, the small deps 42 -> 24 MB.
  tar -C "$tree" --sort=name --owner=0 --group=0 --numeric-owner -cf - . |
    xz -T"$xz_threads" -6 > "$dst.partial"
  mv "$dst.partial" "$dst"
  rm -rf "$tree"
}

# 1. torch 2.14.0, whole: every library it ships is kept.
component torch "torch==$torch_version"
# 2. triton 3.8.0, less the link-time-only CUPTI archives (*_static.a: nothing loads an archive)
#    and the tools and CUPTI build that only Blackwell (sm_100+) uses.
component triton "triton==$triton_version" \
  'triton/backends/nvidia/lib/cupti/*_static.a' 'triton/backends/nvidia/lib/cupti-blackwell' \
  'triton/backends/nvidia/bin/ptxas-blackwell'
# 3. torchvision built for torch 2.14 (the host's 0.26 would fail to load against torch 2.14).
component torchvision "torchvision==$torchvision_version"
# 4. NCCL 2.30.7, torch 2.14's pin; /tmp/site/nvidia/nccl/lib is on libtorch_cuda.so's rpath.
component nccl "nvidia-nccl-cu13==$nccl_version"
if [ "$with_cudnn" = 1 ]; then
  component cudnn "nvidia-cudnn-cu13==$cudnn_version"
fi
# 5. vLLM itself, without what a dense model on Hopper never loads (FA2 build, MoE kernels,
#    the Rust frontend binary, CUTLASS headers, DeepGEMM headers).
component vllm "vllm==$vllm_version" \
  vllm/vllm_flash_attn/_vllm_fa2_C.abi3.so vllm/vllm-rs vllm/_moe_C_stable_libtorch.abi3.so \
  vllm/third_party/deep_gemm/include vllm/third_party/fmha_sm100/cutlass \
  'vllm/third_party/deep_gemm/_C.cpython-31[0134]-*.so'
# 6. The Python packages vLLM needs that the host lacks (pinned, Python 3.12 wheels), as one tree.
deps=$cache/deps.tar.xz
req_sum=$(sha256sum "$here/host-requirements.txt" | cut -c1-16)
if [ ! -f "$deps" ] || [ "$(cat "$cache/deps.req" 2>/dev/null)" != "$req_sum" ]; then
  wheels=$cache/dl/deps-$req_sum
  if [ ! -f "$wheels/.done" ]; then
    mkdir -p "$wheels"
    python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
      "${platforms[@]}" -d "$wheels" -r "$here/host-requirements.txt"
    touch "$wheels/.done"
  fi
  tree=$(mktemp -d "$cache/tree.XXXXXX")
  pip_target "$tree" "$wheels"/*.whl
  tar -C "$tree" --sort=name --owner=0 --group=0 --numeric-owner -cf - . |
    xz -T"$xz_threads" -6 > "$deps.partial"
  mv "$deps.partial" "$deps" && echo "$req_sum" > "$cache/deps.req"
  rm -rf "$tree"
fi

# 7. One tar (with a checksum list), cut into pieces that each fit a 64 MiB transfer together
#    with the source tree.
bundle=$(mktemp -d "$cache/bundle.XXXXXX")
names="torch triton torchvision nccl vllm deps"
[ "$with_cudnn" = 1 ] && names="$names cudnn"
for c in $names; do ln "$cache/$c.tar.xz" "$bundle/$c.tar.xz" 2>/dev/null || cp "$cache/$c.tar.xz" "$bundle/"; done
(cd "$bundle" && sha256sum -- *.tar.xz > SHA256SUMS)
rm -f "$out"/part_*
tar -C "$bundle" -cf "$bundle.tar" SHA256SUMS $(for c in $names; do echo "$c.tar.xz"; done)
size=$(stat -c %s "$bundle.tar")
# A call carries the repository's tracked files too (about 9 MiB, most of it benchmarks/results/) under
# the device tool's 64 MiB: pieces of 48 MiB leave room for them.
piece=$(( ${PIECE_MIB:-48} * 1024 * 1024 ))
n=$(( (size + piece - 1) / piece ))
split -n "$n" -d "$bundle.tar" "$out/part_"
rm -rf "$bundle" "$bundle.tar"
cp "$here/install.sh" "$here/smoke.py" "$out/"
ls -l "$out"
echo "staged $(ls "$out"/part_* | wc -l) parts ($size bytes) in $out"
