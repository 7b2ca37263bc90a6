#!/bin/bash
# Run on the GPU host once every sg_part_* made by
# tools/gpu_host/sglang/stage.sh lies in /tmp/sglang-parts/ (or $1). Unpacks SGLang 0.5.23 into /tmp/site-sglang
# ($SGLANG_SITE) and writes $SGLANG_SITE/env.sh; a second run is a no-op.
# Overlay bundle (the default): install the vLLM 0.33 bundle first (install-0.33.sh -> /tmp/site);
# SGLang then runs on its torch 2.14.0 / triton 3.8.0 / NCCL 2.30.7 with /tmp/site-sglang in front.
# Afterwards:  . /tmp/site-sglang/env.sh   then e.g.
#   python3 -m sglang.launch_server --model-path MODEL --load-format dummy --attention-backend fa3 \
#     --sampling-backend pytorch ...
# (On an H200 a dense MHA model already defaults to fa3, i.e. sgl_kernel's FA3 build. The sampling
# backend defaults to flashinfer, whose kernels are JIT-compiled with nvcc on first use: pytorch avoids
# that. SGLang's own sglang.kernels.jit ops also compile with nvcc (CUDA_HOME, else nvcc on PATH).)
# (No pip, no index. The `sglang` console script is not installed: use python3 -m.)
set -euo pipefail
parts=${1:-/tmp/sglang-parts}
site=${SGLANG_SITE:-/tmp/site-sglang}
vsite=${VLLM_RELAY_SITE:-/tmp/site}
marker=$site/.sglang-0.5.23-ok
if [ -f "$marker" ]; then echo "already installed in $site"; exit 0; fi
if [ -d "$site" ] && [ -n "$(ls -A "$site")" ]; then
  old=$site.prev-$(date +%s); mv "$site" "$old"; echo "moved the earlier $site to $old"
fi
ls -l "$parts"
work=$(mktemp -d /tmp/sglang-stage-install.XXXXXX)
cat "$parts"/sg_part_* | tar -xf - -C "$work"
(cd "$work" && sha256sum -c --quiet SHA256SUMS) || { echo "a part is missing or damaged" >&2; exit 1; }
mode=$(cat "$work/MODE")
if [ "$mode" = overlay ] && ! PYTHONPATH=$vsite python3 -c 'import torch, sys; sys.exit(0 if torch.__version__.startswith("2.14.") else 1)' 2>/dev/null; then
  echo "overlay bundle: torch 2.14 not found in $vsite; run install-0.33.sh first" >&2; exit 1
fi
mkdir -p "$site"
pids=()
for c in "$work"/*.tar.xz; do (xz -dc -T0 "$c" | tar -xf - -C "$site") & pids+=($!); done
for p in "${pids[@]}"; do wait "$p"; done
cp "$work/host-assumed.txt" "$site/.host-assumed.txt"
rm -rf "$work"

# PYTHONPATH ignores .pth files, so add by hand what nvidia_cutlass_dsl_packages.pth would add.
pp=$site:$site/nvidia_cutlass_dsl/dsl_packages
[ "$mode" = overlay ] && pp=$pp:$vsite
cat > "$site/env.sh" <<EOF
export PYTHONPATH=$pp
export PATH=$site/bin:\$PATH
EOF
if [ -x "$site/nvidia/cu13/bin/nvcc" ]; then
  # WITH_NVCC bundle: FlashInfer's and SGLang's JIT builds use this nvcc (they look at CUDA_HOME first).
  echo "export CUDA_HOME=$site/nvidia/cu13" >> "$site/env.sh"
fi
# sglang/utils.py imports IPython.display (notebook helpers the engine never calls); the bundle leaves IPython
# out, so a stub that refuses when used.
if ! PYTHONPATH=$pp python3 -c 'import IPython' 2>/dev/null; then
  mkdir -p "$site/IPython" && touch "$site/IPython/__init__.py"
  cat > "$site/IPython/display.py" <<'EOF'
def display(*a, **k):
    raise RuntimeError("IPython is not installed")


class HTML:
    def __init__(self, *a, **k):
        raise RuntimeError("IPython is not installed")
EOF
fi
. "$site/env.sh"
echo "nvcc for JIT kernels: $(command -v nvcc || echo none) $( (nvcc --version 2>/dev/null || true) | grep -o 'release [0-9.]*' || true) CUDA_HOME=${CUDA_HOME:-unset}"

# Every requirement of what the bundle brought, checked against what this python now sees
# (a report, not a failure: the host-assumed list was inferred, not read from the host).
python3 - "$site" <<'EOF' || true
import sys, re, importlib.metadata as md, pathlib
from packaging.requirements import Requirement
from packaging.version import Version
site = pathlib.Path(sys.argv[1])
norm = lambda s: re.sub(r'[-_.]+', '-', s).lower()
have = {}
for d in md.distributions():
    n = norm(d.metadata['Name'])
    have.setdefault(n, d.version)          # first on sys.path wins, as for imports
ours = [md.Distribution.at(p) for p in site.glob('*.dist-info')]
optional = {'datasets', 'scipy', 'ipython', 'nvidia-cuda-nvcc', 'nvidia-cuda-cccl', 'nvidia-cutlass-dsl-libs-cu12', 'av', 'decord2'}
bad = set()
for d in ours:
    for r in d.requires or []:
        R = Requirement(r)
        if R.marker is not None and not R.marker.evaluate({'extra': ''}):
            continue
        n = norm(R.name)
        if n not in have:
            bad.add(f"missing   {R.name}  (for {d.metadata['Name']}{' - left out on purpose' if n in optional else ''})")
        elif not R.specifier.contains(Version(have[n]), prereleases=True):
            note = ''
            if n == 'torch' and have[n].startswith('2.14.0'):
                note = '  (expected with the overlay: 2.14.0 and 2.14.1 export the same symbols)'
            bad.add(f"version   {R.name}=={have[n]} but {d.metadata['Name']} wants {R.specifier}{note}")
print('\n'.join(sorted(bad)) if bad else 'all requirements present')
EOF
python3 - <<'EOF'
import importlib.metadata as md
import torch, triton, sglang, sgl_kernel, flashinfer, xgrammar, openai, transformers  # noqa: F401 (they import)
def version(name):
    try:
        return md.version(name)
    except md.PackageNotFoundError:
        return "?"
names = ("sglang", "sglang-kernel", "flashinfer-python", "torch", "triton", "transformers", "xgrammar", "openai")
print(*(f"{n} {version(n)}" for n in names), "nccl", torch.cuda.nccl.version())
EOF
touch "$marker"
