"""The levels' FlashAttention call inside a CUDA graph: does a padded batch cost it its key splits?

A full CUDA graph fixes the levels' call at the capture's group capacity (thousands of groups, most
of them empty in any step). FlashAttention-3 sizes its split-K from an ahead-of-time schedule; this
times one level (n rows over S shared keys, one layer) in graphs:
  one      a batch of exactly one group, the schedule's split cap 32 (vLLM 0.26's for CUDA graphs)
  padded   the same group first in a batch of C groups, the others empty (the twin graph), for each
           capacity C of --capacities (2050: one capacity for every graph; 514 and 130: what the
           graphs of 256 and 64 decode rows need, 2 slots + rows x 4 levels / 2; 66 and 34: a slot and
           the planner's cap of a graph's levels, GRAPH_LEVELS = 64, or 32)
  chunksK  the group's keys cut into K groups of S/K keys in the padded batch, the queries repeated
           (split-K done by the plan; the fusion merges the K rows of each token)
  unsplit  the padded batch with one split and no schedule (no split combine over the padding)
  forced1  the padded batch captured with the split cap, its schedule's split counts set to 1 per step
           (ops.force_one_split: what the planner's graph_one_split does)
Capping a graph's groups (fewer than 2 + rows x 4 / 2; the tree keeps its shallowest levels) is what a
small capacity here measures: FA3's combine runs over every padded group.
Times are medians of graph replays (triton.testing.do_bench); TFLOP/s counts 4 n S Hq D.
With --eager-rows R,...: the level of an eager step instead (a prompt-chunk step: one group of R rows
over S keys, launched from Python as the backend does): FA3's own split heuristic (the backend's
schedule with num_splits 0, vLLM's choice for steps above its graph sizes), the graph cap's 32
(vLLM's choice for steps within them), and one split.
Usage (GPU host): python3 benchmarks/bench_level_batch.py [--eager-rows 512,4096] [--out DIR]
"""

import argparse
import os
import sys

import torch
import triton

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_layer import write_results  # noqa: E402
from bench_ops import BLOCK, DTYPE, FA, GRAPH_SPLITS, MODELS, capture_graph  # noqa: E402
from bench_ops import HEAD_DIM as D  # noqa: E402

from vllm_relay.ops import force_one_split  # noqa: E402


def level_ms(fa, hq, hkv, n, S, groups, chunks, capacity, splits=GRAPH_SPLITS, one=False):
    pages = triton.cdiv(S, BLOCK)
    kv = torch.randn(pages + 8, BLOCK, hkv, 2 * D, device="cuda", dtype=DTYPE)
    k_cache, v_cache = kv[..., :D], kv[..., D:]
    per = triton.cdiv(pages, chunks)
    width = triton.cdiv(16384, BLOCK) + 8
    table = torch.zeros(capacity, width, dtype=torch.int32, device="cuda")
    lens = torch.zeros(capacity, dtype=torch.int32, device="cuda")
    for c in range(chunks):
        lo, hi = c * per, min(pages, (c + 1) * per)
        table[c, : hi - lo] = torch.arange(lo, hi, dtype=torch.int32)
        lens[c] = (hi - lo) * BLOCK
    cu = torch.zeros(capacity + 1, dtype=torch.int32, device="cuda")
    cu[1: chunks + 1] = torch.arange(1, chunks + 1, dtype=torch.int32) * n
    cu[chunks + 1:] = chunks * n
    batch = capacity if groups == "padded" else chunks
    # A padded graph's gathered queries: its row capacity, 4 levels x n tokens (rows past the groups unused).
    q = torch.randn(max(chunks, 4 if groups == "padded" else 1) * n, hq, D, device="cuda", dtype=DTYPE)
    out = torch.empty_like(q)
    sched = None  # one split: no schedule (as VLLM_RELAY_LEVEL_SPLITS runs it)
    if splits > 1:
        sched = fa.schedule(batch, cu[: batch + 1], n, lens[:batch], 16384, False, hq, hkv, splits)
        if one and not force_one_split(sched, batch):
            raise RuntimeError("FA3's schedule has no dynamic split vector")

    def run():
        fa.varlen(q=q, k=k_cache, v=v_cache, out=out, cu_seqlens_q=cu[: batch + 1], seqused_k=lens[:batch],
                  max_seqlen_q=n, max_seqlen_k=16384, softmax_scale=D ** -0.5, causal=False,
                  block_table=table[:batch], return_softmax_lse=True, scheduler_metadata=sched,
                  num_splits=splits,
                  fa_version=fa.version)

    run()
    torch.cuda.synchronize()
    return triton.testing.do_bench(capture_graph(run).replay, warmup=20, rep=100, return_mode="median")


def eager_level_us(fa, hq, hkv, R, S, splits):
    """One group of R rows over S keys, eager: `splits` 0 (FA3's heuristic) or a cap, each with the
    backend's ahead-of-time schedule; None: one split, no schedule."""
    pages = triton.cdiv(S, BLOCK)
    kv = torch.randn(pages + 8, BLOCK, hkv, 2 * D, device="cuda", dtype=DTYPE)
    table = torch.arange(pages, dtype=torch.int32, device="cuda").view(1, -1)
    lens = torch.tensor([S], dtype=torch.int32, device="cuda")
    cu = torch.tensor([0, R], dtype=torch.int32, device="cuda")
    q = torch.randn(R, hq, D, device="cuda", dtype=DTYPE)
    out = torch.empty_like(q)
    sched = None if splits is None else fa.schedule(1, cu, R, lens, S, False, hq, hkv, splits)

    def run():
        fa.varlen(q=q, k=kv[..., :D], v=kv[..., D:], out=out, cu_seqlens_q=cu, seqused_k=lens, max_seqlen_q=R,
                  max_seqlen_k=S, softmax_scale=D ** -0.5, causal=False, block_table=table,
                  return_softmax_lse=True, scheduler_metadata=sched, num_splits=1 if splits is None else splits,
                  fa_version=fa.version)

    return triton.testing.do_bench(run, warmup=20, rep=100, return_mode="median") * 1e3


def eager_main(args, fa):
    rows, variants = [], {"heuristic": 0, "cap32": GRAPH_SPLITS, "unsplit": None}
    for model in ("llama2-7b", "llama3-8b"):
        hq, hkv = MODELS[model]
        for S in (2048, 16000):
            for R in map(int, args.eager_rows.split(",")):
                row = dict(model=model, S=S, R=R)
                for name, splits in variants.items():
                    us = eager_level_us(fa, hq, hkv, R, S, splits)
                    row[f"{name}_us"], row[f"{name}_tflops"] = us, 4 * R * S * hq * D / us / 1e6
                rows.append(row)
                print(f"{model} S={S:5d} R={R:5d}: " + " ".join(
                    f"{k} {row[k + '_us']:.0f} us ({row[k + '_tflops']:.0f} TF/s)" for k in variants), flush=True)
    md = ["| model | S | R | " + " | ".join(variants) + " |", "|---|---|---|" + "---|" * len(variants)]
    md += [f"| {r['model']} | {r['S']} | {r['R']} | " + " | ".join(
        f"{r[v + '_us']:.0f} us ({r[v + '_tflops']:.0f} TF/s)" for v in variants) + " |" for r in rows]
    print("\n".join(md))
    if args.out:
        write_results(args.out, "level_eager", {"rows": rows}, "\n".join(md) + "\n")


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out")
    p.add_argument("--capacities", default="2050,514,130")
    p.add_argument("--ns", default="16,64,256")
    p.add_argument("--eager-rows", help="the eager level of a prompt-chunk step instead, for these row counts")
    args = p.parse_args()
    fa, rows = FA(), []
    if args.eager_rows:
        return eager_main(args, fa)
    variants = [("one", "one", 1, 1, GRAPH_SPLITS, False)]
    for cap in map(int, args.capacities.split(",")):
        variants += [(f"padded@{cap}", "padded", 1, cap, GRAPH_SPLITS, False)]
        variants += [(f"unsplit@{cap}", "padded", 1, cap, 1, False)]
        variants += [(f"forced1@{cap}", "padded", 1, cap, GRAPH_SPLITS, True)]
        variants += [(f"chunks{k}@{cap}", "padded", k, cap, GRAPH_SPLITS, False) for k in (2, 4)]
    for model in ("llama2-7b", "llama3-8b"):
        hq, hkv = MODELS[model]
        for S in (2048, 16000):
            for n in map(int, args.ns.split(",")):
                row = dict(model=model, S=S, n=n)
                for name, groups, chunks, capacity, splits, one in variants:
                    ms = level_ms(fa, hq, hkv, n, S, groups, chunks, capacity, splits, one)
                    row[f"{name}_us"] = ms * 1e3
                    row[f"{name}_tflops"] = 4 * n * S * hq * D / ms / 1e9
                rows.append(row)
                print(f"{model} S={S:5d} n={n:3d}: " + " ".join(
                    f"{k[:-3]} {v:.0f} us" for k, v in row.items() if k.endswith("_us")), flush=True)
    md = ["| model | S | n | " + " | ".join(v for v, *_ in variants) + " |",
          "|---|---|---|" + "---|" * len(variants)]
    md += [f"| {r['model']} | {r['S']} | {r['n']} | " + " | ".join(
        f"{r[v + '_us']:.0f} us ({r[v + '_tflops']:.0f} TF/s)" for v, *_ in variants) + " |" for r in rows]
    print("\n".join(md))
    if args.out:
        write_results(args.out, "level_batch", {"capacities": args.capacities, "rows": rows}, "\n".join(md) + "\n")


if __name__ == "__main__":
    main()
