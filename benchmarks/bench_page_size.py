"""What the KV page size costs a shared level's FLOPs (GPU, vllm==0.26.0): FA3 loads paged keys with TMA
only when the page size is a multiple of its key tile (GPU only; the first step of a measurement).

A level is FLOP-bound: every row of the call attends to the same S system keys. FlashAttention-3 loads
paged K/V with TMA only when `page_size % kBlockN == 0` and `max_seqlen_q * (Hq / Hkv) > kBlockM`
(`get_pagedkv_tma`, hopper/flash_api.cpp; hdim 128: kBlockM 128, kBlockN 176 non-causal, 128 causal);
vLLM's pages hold 16 tokens, so every relay level runs FA3's non-TMA paged loads (cp.async by the
producer warps). The fifteenth session's accounting (H200, Llama-2-7B shape) puts the decode level at
about 580 TFLOP/s and the prompt chunks over the system keys at about 480.

Here the same keys are read two ways, in one varlen call of G groups of `rows` query rows, every
group over the whole system prompt (`seqused_k` = S):
  page16    vLLM's cache as it is, [NB, 16, Hkv, D], the prompt on consecutive pages
  pageN     the same memory viewed as [NB / (N/16), N, Hkv, D] (N = 176 non-causal, 128 causal): TMA
An unpaged call cannot read one run of keys for every group: its `cu_seqlens_k` gives each group
its own run, and vLLM's wrapper refuses `seqused_k` beside it (the first GPU run, 2026-11-28).
Measured (H200, benchmarks/results/ceiling_h100/session16/): the TMA view within 0-5% of page16
(Llama-2-7B shape, S=8192, 16384 rows: 4417 / 4302 us non-causal), so relay keeps 16-token pages.
Causal rows (`--causal`): each group is a prompt chunk of `rows` tokens after the S keys (the prefix
path: keys [system ; own], S + rows of them, bottom-right causal).

Columns: us per call (CUDA graph, median of do_bench), TFLOP/s (4 x rows x keys x D x Hq, halved on
the causal diagonal block), the largest difference from page16's output. The same table shows what a
level's rows per sequence cost: 64 query rows (FA3's one-warpgroup tile) run at 370-390 TFLOP/s where
128 and more reach 500-540 (Llama-2-7B shape); in the joint call the 128-row tile loses more on the
context's one-row sequences than it gains (rules.JOINT_ROWS).
Writes <out>/page_size.{json,md}.
Usage: python3 benchmarks/bench_page_size.py [--ns 256,1024,16384] [--rows 64,128,256] [--out DIR]
"""

import argparse
import math
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_layer  # noqa: E402
from bench_layer import graph_ms, write_results  # noqa: E402
from bench_ops import BLOCK as PAGE, DTYPE, FA, MODELS  # noqa: E402
from bench_ops import HEAD_DIM as D  # noqa: E402


def level_call(varlen, q, k, v, rows, S, extra, causal, view, pages_per_view):
    """One grouped call: (fn, out, flops). `view`: page16 / pageN."""
    n, hq = q.shape[0], q.shape[1]
    G = math.ceil(n / rows)
    cu_q = torch.tensor([min(g * rows, n) for g in range(G + 1)], dtype=torch.int32, device=q.device)
    keys = S + (rows if causal else 0)  # a causal chunk's own keys follow the prompt's
    seqused = torch.full((G,), keys, dtype=torch.int32, device=q.device)
    kw = dict(q=q, max_seqlen_q=rows, cu_seqlens_q=cu_q, max_seqlen_k=keys, seqused_k=seqused,
              softmax_scale=D ** -0.5, causal=causal, return_softmax_lse=True, **extra)
    per = pages_per_view if view != "page16" else 1
    nb = k.shape[0] // per * per
    kk, vv = (x[:nb].view(nb // per, per * PAGE, *x.shape[2:]) for x in (k, v))
    width = math.ceil(keys / (per * PAGE))
    table = torch.arange(width, dtype=torch.int32, device=q.device).expand(G, width).contiguous()
    kw.update(k=kk, v=vv, block_table=table)
    out = torch.empty_like(q)
    kw["out"] = out
    flops = 4 * n * S * D * hq + (2 * n * rows * D * hq if causal else 0)  # the own diagonal block: half

    def fn():
        return varlen(**kw)
    return fn, out, flops


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", default=",".join(MODELS))
    p.add_argument("--system-lens", default="2048,8192")
    p.add_argument("--ns", default="256,1024,16384", help="query rows of the call")
    p.add_argument("--rows", default="64,128,256", help="query rows per group")
    p.add_argument("--causal", action="store_true", help="prompt chunks on the prefix path instead of a level")
    p.add_argument("--rep", type=int, default=100)
    p.add_argument("--out", default="/tmp/out")
    args = p.parse_args()
    bench_layer.ARGS = argparse.Namespace(rep=args.rep)
    fa = FA()
    extra = {"fa_version": fa.version}
    big = 128 if args.causal else 176  # FA3's kBlockN for hdim 128
    views = ("page16", f"page{big}")
    torch.manual_seed(0)
    results, lines = [], []
    for model in args.models.split(","):
        hq, hkv = MODELS[model]
        for S in map(int, args.system_lens.split(",")):
            nb = math.ceil((S + 512) / big) * big // PAGE  # whole big pages, the keys at block 0
            k = torch.randn(nb, PAGE, hkv, D, dtype=DTYPE, device="cuda")
            v = torch.randn_like(k)
            for n in map(int, args.ns.split(",")):
                q = torch.randn(n, hq, D, dtype=DTYPE, device="cuda")
                for rows in map(int, args.rows.split(",")):
                    row = dict(model=model, S=S, n=n, rows=rows, causal=args.causal)
                    ref = None
                    for view in views:  # page16 first: the reference
                        fn, out, flops = level_call(fa.varlen, q, k, v, rows, S, extra, args.causal,
                                                    view, big // PAGE)
                        ms = graph_ms(fn)  # NaN, reported, where the call cannot run
                        row[f"{view}_us"] = ms * 1e3
                        row[f"{view}_tflops"] = flops / (ms * 1e-3) / 1e12
                        if math.isnan(ms):
                            row[f"{view}_err"] = float("nan")
                            continue
                        fn()
                        torch.cuda.synchronize()
                        if view == "page16":
                            ref = out.float().clone()
                        elif ref is not None:
                            row[f"{view}_err"] = (out.float() - ref).abs().max().item()
                    results.append(row)
                    print(row, flush=True)
    head = ["model", "S", "n", "rows"] + [f"{v}_{x}" for v in views for x in ("us", "tflops")] + \
        [f"{v}_err" for v in views[1:]]
    lines.append(f"# KV page size and a level's FLOP rate: {torch.cuda.get_device_name()}"
                 f"{' (causal prompt chunks)' if args.causal else ''}\n")
    lines.append("| " + " | ".join(head) + " |")
    lines.append("|" + "---|" * len(head))
    for r in results:
        lines.append("| " + " | ".join(f"{r[h]:.4g}" if isinstance(r[h], float) else str(r[h]) for h in head) + " |")
    stem = "page_size_causal" if args.causal else "page_size"
    write_results(args.out, stem, {"rows": results}, "\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
