"""Where a layer's time goes, kernel by kernel (GPU, vllm==0.26.0).

For n decode requests of one slot (S system tokens, c=128 own tokens each), the plans the relay
planner writes for a full-CUDA-graph step (`bench_layer.Layer`): no system prompt (the ceiling),
plain requests in a graph that holds the level ('empty'), and the shared path with each level
kernel. Each plan is launched eagerly under the torch profiler (the same kernels, with the same
padded shapes, that a graph replays) and every CUDA kernel's time is summed per layer call, so the
shared path's cost over the ceiling splits into its parts: the context call with LSE, the gather,
the level's attention and its split combine, the fusion.

Writes <out>/layer_kernels.{json,md}.
Usage: python3 benchmarks/layer_kernels.py [--models llama3-8b,llama2-7b] [--ns 64,256,1024]
       [--system-lens 2048] [--out DIR]
"""

import argparse
import os
import re
import sys
from collections import defaultdict

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_layer import add_grid_args, layer_grid, write_results  # noqa: E402
from bench_ops import FA  # noqa: E402

# label: (shared_path, plain requests, level kernel)
VARIANTS = {"no prompt": ("never", True, "flash"), "empty flash": ("always", True, "flash"),
            "empty triton": ("always", True, "triton"), "shared flash": ("always", False, "flash"),
            "shared triton": ("always", False, "triton")}
CALLS = 20


def short(name: str) -> str:
    """A kernel's name without template arguments, at most 60 characters; FlashAttention-3's
    kernels (all `cutlass::device_kernel<...>`) by their class: the forward and the split combine."""
    fa = re.search(r"flash::(FlashAttn\w+)", name)
    if fa:
        return f"flash::{fa.group(1)}"
    return name.split("<", 1)[0].split("(", 1)[0].strip()[:60]


def kernels_of(fn) -> dict[str, list[float]]:
    """{kernel: [us per layer call, launches per layer call]} over CALLS eager calls."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(CALLS):
            fn()
        torch.cuda.synchronize()
    per = defaultdict(lambda: [0.0, 0.0])
    for e in prof.events():
        if e.device_type.name == "CUDA":
            per[short(e.name)][0] += e.device_time_total / CALLS
            per[short(e.name)][1] += 1 / CALLS
    return dict(per)


def main(args) -> None:
    rows = []
    grid = layer_grid(FA(), args.models.split(","), list(map(int, args.system_lens.split(","))),
                      list(map(int, args.ns.split(","))))
    for model, S, n, layer in grid:
        for label, (path, plain, kernel) in VARIANTS.items():
            os.environ["VLLM_RELAY_LEVEL_KERNEL"] = kernel
            per = kernels_of(layer.call(layer.plan(path, True, plain=plain)[0]))
            total = sum(us for us, _ in per.values())
            rows.append(dict(model=model, S=S, n=n, variant=label, total_us=total,
                             kernels={k: dict(us=us, launches=c) for k, (us, c) in per.items()}))
            print(f"{model} S={S} n={n} {label}: {total:.1f} us, "
                  + ", ".join(f"{k} {us:.1f}" for k, (us, _) in sorted(per.items(), key=lambda kv: -kv[1][0])),
                  flush=True)
        del layer
    lines = [f"# Kernel time per layer call: {torch.cuda.get_device_name()}", "",
             "Eager launches of the plans a full CUDA graph replays (torch profiler, GPU time of each "
             f"kernel, mean of {CALLS} calls); c=128 own tokens per request.", "",
             "| model | S | n | variant | total us | kernel | us | launches |", "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        for i, (k, v) in enumerate(sorted(r["kernels"].items(), key=lambda kv: -kv[1]["us"])):
            head = f"| {r['model']} | {r['S']} | {r['n']} | {r['variant']} | {r['total_us']:.1f} |" if i == 0 \
                else "| | | | | |"
            lines.append(f"{head} {k} | {v['us']:.1f} | {v['launches']:.0f} |")
    write_results(args.out, "layer_kernels", dict(gpu=torch.cuda.get_device_name(), calls=CALLS, rows=rows),
                  "\n".join(lines) + "\n")


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_grid_args(p, models="llama3-8b,llama2-7b", ns="64,256,1024", system_lens="2048")
    main(p.parse_args())
