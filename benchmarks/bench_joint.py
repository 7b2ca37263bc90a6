"""A decode layer with the context and the system level in one FlashAttention-3 call (GPU, vllm==0.26.0).

Relay's decode layer runs two persistent FA3 kernels, the context call (bound by its reads) and the
level (bound by its FLOPs); in a graph replay the first fills the GPU and the second runs after it
(benchmarks/bench_margin.py). One varlen call can hold both: on a decode step every context
sequence has one query, so the call can be non-causal, and each level group becomes sequences of at
most `rows` query rows over the group's pages. FA3's varlen scheduler hands tiles out in batch order
(vLLM's build never sorts them), and with `seqused_q` a batch's rows may sit anywhere in q, so the
level's sequences can be spread among the context's: the SMs then run reads and FLOPs side by side,
balanced by the scheduler rather than by a fixed split of SMs.

Costs it adds: the context's queries are copied beside the level's (one gather of n + N rows, where
relay gathers N), and the call's tile size is set by its longest sequence (`rows` x query heads per
KV head above 64 takes FA3's two-warpgroup kernel for every tile).

Columns (graph us per layer, medians of do_bench, L2 flushed): `noprompt` the same requests with no
system prompt; `relay` the levels as their own call (VLLM_RELAY_JOINT=0: on the second stream);
`joint_{order}_{rows}` one call built here from relay's plan, the level's sequences of `rows` query
rows placed `first`, `last` or `mix` (spread evenly among the context's), then the LSE merge
(relay_fusion); `_s{cap}` with FA3's split cap (FA3 splits a sequence by its share of the work),
else one split; `lib` the backend's joint plan (planner and `relay_attention`) with FA3's split cap and
its own split choice, `libf` the same split call with every sequence forced to one split (what a graph
captured split runs on the steps the planner unsplits: FA3's combine still launched), `lib1` the call
unsplit (the unsplit twin graph, VLLM_RELAY_UNSPLIT_GRAPHS: no combine), `lib1e` the same call planned for
an eager step (no graph: no empty level sequences padding it to the graph's capacity, the step's own
longest key length); `err_*` the largest difference from relay's output. With `--kernels`, each
column's GPU time kernel by kernel as well (eager launches under the torch profiler,
`layer_kernels.kernels_of`): which kernel makes two columns differ.
Writes <out>/joint.{json,md}.
Usage: python3 benchmarks/bench_joint.py [--ns 256,1024] [--rows 64,128] [--orders mix,first] [--kernels]
       [--out DIR]
"""

import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench_layer import graph_ms, write_results  # noqa: E402
from bench_margin import add_point_args, decode_points, err_vs, run  # noqa: E402
from bench_ops import BLOCK, DTYPE, FA  # noqa: E402
from bench_ops import HEAD_DIM as D  # noqa: E402
from layer_kernels import kernels_of  # noqa: E402

from vllm_relay.attention.backend import LEVEL_STREAM_PRIORITY  # noqa: E402
from vllm_relay.ops.split_schedule import FA3_DYNAMIC_SPLIT_BATCHES, force_one_split  # noqa: E402
from vllm_relay.ops import relay_fusion  # noqa: E402


def fa3_fwd(q, k, v, out, cu_seqlens_q, seqused_q, seqused_k, max_seqlen_q, max_seqlen_k, block_table,
            softmax_scale, scheduler_metadata=None, num_splits=1):
    """FA3's varlen forward (vllm 0.26.0's op), non-causal, with `seqused_q`: (out, lse [H, total_q])."""
    out, lse, _, _ = torch.ops._vllm_fa3_C.fwd(
        q, k, v, None, None, None, out, cu_seqlens_q, None, None, seqused_q, seqused_k, max_seqlen_q, max_seqlen_k,
        block_table, None, None, None, None, None, None, None, None, softmax_scale, False, -1, -1, 0.0, True,
        scheduler_metadata, num_splits, None, 0, None, 1, 0, None)
    return out, lse


def fa3_schedule(batch, max_q, max_k, hq, hkv, seqused_k, cu_q, seqused_q, num_splits=1):
    """FA3's AOT schedule of such a call (`get_scheduler_metadata` with `seqused_q`)."""
    return torch.ops._vllm_fa3_C.get_scheduler_metadata(
        batch, max_q, max_k, hq, hkv, D, D, DTYPE, seqused_k, cu_q, None, None, seqused_q, None, BLOCK, 0, False,
        -1, -1, False, num_splits, None, 0)


def order_entries(n, chunks, order):
    """Batch order: ('c', b) for the context's sequence b, ('l', j) for the level's chunk j."""
    ctx = [("c", b) for b in range(n)]
    lvl = [("l", j) for j in range(len(chunks))]
    if order == "first":
        return lvl + ctx
    if order == "last":
        return ctx + lvl
    out, j = [], 0  # mix: chunk j after the context's sequence (j + 0.5) * n / J
    for b in range(n):
        out.append(("c", b))
        while j < len(chunks) and (j + 0.5) * n / len(chunks) <= b + 1:
            out.append(("l", j))
            j += 1
    return out + lvl[j:]


def joint(layer, plan, rows, order, splits=1):
    """The layer as one FA3 call for the context and the level, then the LSE merge (`splits`: FA3's
    cap on key splits; above 1, FA3 splits each sequence by its share of the call's work)."""
    ctx, level = plan.context, plan.shared[0]
    n, gqa = layer.n, layer.hq // layer.hkv
    per = max(1, rows // gqa)  # tokens per level sequence
    cu = level.call["cu_seqlens_q"].cpu().tolist()
    lens_k = level.call["seqused_k"].cpu().tolist()
    groups = len(lens_k)
    num = cu[groups]
    chunks = [(g, s, min(per, cu[g + 1] - s)) for g in range(groups) for s in range(cu[g], cu[g + 1], per)]
    ctx_k = ctx["seqused_k"].cpu().tolist()
    ctx_bt, lvl_bt = ctx["block_table"], level.call["block_table"]
    entries = order_entries(n, chunks, order)
    width = max(ctx_bt.shape[1], lvl_bt.shape[1])
    dev = layer.q.device
    bt = torch.zeros(len(entries), width, dtype=torch.int32, device=dev)
    starts, used_q, used_k, src = [], [], [], []
    for i, (kind, j) in enumerate(entries):
        if kind == "c":
            starts.append(j), used_q.append(1), used_k.append(ctx_k[j]), src.append(ctx_bt[j])
        else:
            g, s, r = chunks[j]
            starts.append(n + s), used_q.append(r), used_k.append(lens_k[g]), src.append(lvl_bt[g])
    for i, row in enumerate(src):
        bt[i, :row.shape[0]] = row
    cu_q = torch.tensor(starts + [n + num], dtype=torch.int32, device=dev)
    seq_q = torch.tensor(used_q, dtype=torch.int32, device=dev)
    seq_k = torch.tensor(used_k, dtype=torch.int32, device=dev)
    max_k = max(used_k)
    perm = torch.cat([torch.arange(n, dtype=torch.int32, device=dev), level.perm[:num].to(torch.int32)])
    jq = torch.empty(n + num, layer.hq, D, dtype=DTYPE, device=dev)
    jout = torch.empty_like(jq)
    sched = fa3_schedule(len(entries), per, max_k, layer.hq, layer.hkv, seq_k, cu_q, seq_q, splits)
    row_index = level.row_index if level.row_index.dim() == 1 else level.row_index[0]

    def fn():
        torch.index_select(layer.q, 0, perm, out=jq)
        _, lse = fa3_fwd(jq, layer.k_cache, layer.v_cache, jout, cu_q, seq_q, seq_k, per, max_k, bt, D ** -0.5,
                         scheduler_metadata=sched, num_splits=splits)
        relay_fusion(jout[n:], lse[:, n:], jout[:n], lse[:, :n], out=layer.out, sys_index=row_index[:n])
    return fn


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_point_args(p, "128,256,512,1024")
    p.add_argument("--rows", default="64,128", help="query rows (tokens x heads per KV head) per level sequence")
    p.add_argument("--orders", default="mix,first,last")
    p.add_argument("--splits", default="1", help="FA3's split caps (0: the backend's graph cap)")
    p.add_argument("--kernels", action="store_true", help="each column's GPU time kernel by kernel too")
    args = p.parse_args()
    fa = FA()
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    high = torch.cuda.Stream(priority=LEVEL_STREAM_PRIORITY)
    rows_list = [int(r) for r in args.rows.split(",")]
    orders = args.orders.split(",")
    split_list = [int(x) for x in args.splits.split(",")]
    sfx = lambda sp: "" if sp == 1 else f"_s{sp}"  # noqa: E731
    cols = ["noprompt", "relay", "lib", "libf", "lib1", "lib1e"] + [f"joint_{o}_{r}{sfx(sp)}" for o in orders
                                                           for r in rows_list for sp in split_list]
    rows, t0 = [], time.time()
    for layer, row, cap, hq, hkv in decode_points(args, fa, sms):
        row["kernels"] = {}

        def time_(col, fn):
            row[col] = graph_ms(fn) * 1e3
            if args.kernels:
                row["kernels"][col] = {k: us for k, (us, _) in kernels_of(fn).items()}

        os.environ["VLLM_RELAY_JOINT"] = "1"
        lib, _ = layer.plan("always", True, stream=high)
        eager, _ = layer.plan("always", False, stream=high)  # the same call without the graph's padding
        os.environ["VLLM_RELAY_JOINT"] = "0"
        plan, planner = layer.plan("always", True, stream=high)
        time_("relay", run(layer, plan))
        run(layer, plan)()
        ref = layer.out.clone()
        split = cap if lib.shared[0].call["seqused_k"].shape[0] <= FA3_DYNAMIC_SPLIT_BATCHES else 1
        for col, jp, sp in (("lib", lib, split), ("libf", lib, split), ("lib1", lib, 1), ("lib1e", eager, 1)):
            if not jp.shared or jp.shared[0].ctx_start is None:  # (a graph's plan is always joint)
                print(f"  {col}: the plan holds no joint call", flush=True)
                row[col] = row[f"err_{col}"] = float("nan")
                continue
            call = jp.shared[0].call
            call["num_splits"] = sp
            call["scheduler_metadata"] = fa.schedule(
                call["seqused_k"].shape[0], call["cu_seqlens_q"], call["max_seqlen_q"], call["seqused_k"],
                call["max_seqlen_k"], False, hq, hkv, sp)
            if col == "libf" and sp > 1:  # captured split, every step forced to one (ops.force_one_split)
                force_one_split(call["scheduler_metadata"], call["seqused_k"].shape[0])
            row[f"err_{col}"] = err_vs(layer, run(layer, jp), ref)
            time_(col, run(layer, jp))
        for o in orders:
            for r in rows_list:
                for sp in split_list:
                    col = f"{o}_{r}{sfx(sp)}"
                    try:
                        fn = joint(layer, plan, r, o, sp or cap)
                        row[f"err_{col}"] = err_vs(layer, fn, ref)
                        time_(f"joint_{col}", fn)
                    except Exception as e:  # noqa: BLE001 - report and go on
                        print(f"  joint {col} failed: {type(e).__name__}: {str(e)[:300]}", flush=True)
                        row[f"joint_{col}"] = row[f"err_{col}"] = float("nan")
        rows.append(row)
        print(" ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items()
                       if k != "kernels"), flush=True)
        del layer, plan, planner, lib, eager
    md = [f"# A decode layer as one FA3 call: {torch.cuda.get_device_name()} ({sms} SMs)", "",
          __doc__.split("\n\n")[3], "", "| model | S | n | c | " + " | ".join(cols) + " | max err |",
          "|---" * (5 + len(cols)) + "|"]
    md += [f"| {r['model']} | {r['S']} | {r['n']} | {r['c']} | " + " | ".join(f"{r[c]:.1f}" for c in cols) +
           f" | {max(v for k, v in r.items() if k.startswith('err_')):.4f} |" for r in rows]
    if args.kernels:
        md += ["", "Kernel by kernel (us per layer call, eager; kernels under 1 us left out):", "",
               "| model | S | n | c | column | total | kernels |", "|---|---|---|---|---|---|---|"]
        md += [f"| {r['model']} | {r['S']} | {r['n']} | {r['c']} | {col} | {sum(ks.values()):.1f} | "
               + ", ".join(f"{k} {us:.1f}" for k, us in sorted(ks.items(), key=lambda kv: -kv[1]) if us >= 1) + " |"
               for r in rows for col, ks in r["kernels"].items()]
    write_results(args.out, "joint", dict(sms=sms, seconds=time.time() - t0, rows=rows), "\n".join(md) + "\n")
    print("\n".join(md))


if __name__ == "__main__":
    main()
