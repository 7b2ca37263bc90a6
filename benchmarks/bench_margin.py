"""A decode layer with the system level on its own SMs (GPU, vllm==0.26.0, FlashAttention-3).

A decode step's context call is bound by its reads, a system level by its FLOPs. On a second stream
the two still share the GPU poorly: both are persistent FA3 kernels sized to every SM, and in a graph
replay the context call (vLLM's branch; the level's starts with the gather) takes every SM first, so
the level runs after it. FA3's `sm_margin` sizes a call's persistent grid to `SMs - sm_margin`: with
the level on k SMs and the context call on the other SMs - k, both run at once, and the level is
hidden when its FLOPs on k SMs take no longer than the context's reads on the rest. vLLM's wrapper
passes 0; `fa3_varlen` calls FA3's op with the margin. Measured on the H100 (thirteenth session,
benchmarks/results/ceiling_h100/README.md): a gain only where the context is long against the level,
a loss elsewhere, and a graph fixes k at capture; not adopted.

Columns (graph us per layer, medians of do_bench, L2 flushed): `noprompt` the same requests with
no system prompt; `relay` the backend's plan with the levels as their own call (VLLM_RELAY_JOINT=0, on
the second stream; the joint call: bench_joint.py); `ctxm_k` the
context on SMs - k, the level as today (its CTAs past the k free SMs start as the context's end;
FA3's varlen scheduler hands out tiles as CTAs ask); `ctxv_k` the same with the context's schedule
made for every SM (vLLM's); `both_k` the level on k SMs and the context on the others; `level_k`
the level alone on k SMs; `ctx_k` the context call alone on SMs - k (`ctx_0`: on all); `splitF_k`
(with --fracs) the level's first F% of rows on k SMs beside the context, the rest on every SM after
it (`split_level`).
Writes <out>/margin.{json,md}.
Usage: python3 benchmarks/bench_margin.py [--ks 8,16] [--ns 256,512,1024] [--fracs 0.25,0.5] [--out DIR]
"""

import argparse
import dataclasses
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import bench_layer  # noqa: E402
from bench_layer import Layer, graph_ms, write_results  # noqa: E402
from bench_ops import FA, MODELS  # noqa: E402

from vllm_relay.attention.backend import LEVEL_STREAM_PRIORITY  # noqa: E402
from vllm_relay.ops import RelayPlan, graph_split_cap, relay_attention  # noqa: E402
from vllm_relay.ops.fuse_in_place import fuse_in_place  # noqa: E402
from vllm_relay.ops.gather_rows import gather_rows  # noqa: E402


def fa3_varlen(q, k, v, max_seqlen_q, cu_seqlens_q, max_seqlen_k, seqused_k=None, softmax_scale=None,
               causal=False, block_table=None, return_softmax_lse=False, out=None, scheduler_metadata=None,
               num_splits=0, sm_margin=0, fa_version=3):
    """vLLM's `flash_attn_varlen_func` (FA3 branch, vllm 0.26.0), with FA3's `sm_margin` passed on."""
    out, lse, _, _ = torch.ops._vllm_fa3_C.fwd(
        q, k, v, None, None, None, out, cu_seqlens_q, None, None, None, seqused_k, max_seqlen_q, max_seqlen_k,
        block_table, None, None, None, None, None, None, None, None, softmax_scale, causal, -1, -1, 0.0, True,
        scheduler_metadata, num_splits, None, sm_margin, None, 1, 0, None)
    return (out, lse) if return_softmax_lse else out


def schedule(fa, call, causal, hq, hkv, splits, margin):
    """FA3's schedule of one call of the plan (its keywords), for a grid of SMs - margin."""
    return fa.schedule(call["seqused_k"].shape[0], call["cu_seqlens_q"], max(call["max_seqlen_q"], 1),
                       call["seqused_k"], call["max_seqlen_k"], causal, hq, hkv, splits, sm_margin=margin)


def with_margins(fa, layer, plan, ctx_margin, level_margin, splits, ctx_schedule=True):
    """`plan` (relay's, levels on the second stream) with each call's grid cut by a margin, and its
    schedule made for it (the context's kept as made for every SM with `ctx_schedule=False`; a level
    with no margin kept as the plan has it)."""
    ctx = dict(plan.context, sm_margin=ctx_margin)
    if ctx_schedule:
        ctx["scheduler_metadata"] = schedule(fa, ctx, True, layer.hq, layer.hkv, splits, ctx_margin)
    level = plan.shared[0]
    if level_margin == 0:
        return RelayPlan(ctx, [level], level_stream=plan.level_stream)
    call = dict(level.call, sm_margin=level_margin)
    call["scheduler_metadata"] = schedule(fa, call, False, layer.hq, layer.hkv, splits, level_margin)
    level = dataclasses.replace(level, call=call)  # FA3's own split for its k SMs
    return RelayPlan(ctx, [level], level_stream=plan.level_stream)


def split_level(fa, layer, plan, k, frac, sms, splits, side):
    """The level's first `frac` of rows on k SMs beside the context call (on SMs - k), the rest on every
    SM after it, each part merged by its own LSE: what a planner splitting each step's level could
    reach (a prototype: one group, rows in token order)."""
    level = plan.shared[0]
    n = layer.n
    r = max(16, min(n - 16, int(round(frac * n / 16)) * 16))
    cu = level.call["cu_seqlens_q"]
    cu_a, cu_b = torch.full_like(cu, r), torch.full_like(cu, n)
    cu_a[0], cu_b[0] = 0, r
    call_a = dict(level.call, cu_seqlens_q=cu_a, max_seqlen_q=r, sm_margin=sms - k)
    call_b = dict(level.call, cu_seqlens_q=cu_b, max_seqlen_q=n - r, sm_margin=0)
    call_a["scheduler_metadata"] = schedule(fa, call_a, False, layer.hq, layer.hkv, splits, sms - k)
    call_b["scheduler_metadata"] = schedule(fa, call_b, False, layer.hq, layer.hkv, splits, 0)
    ctx = dict(plan.context, sm_margin=k)
    ctx["scheduler_metadata"] = schedule(fa, ctx, True, layer.hq, layer.hkv, splits, k)
    rows = level.row_index
    rows_a, rows_b = torch.where(rows < r, rows, -1), torch.where(rows >= r, rows, -1)
    scale = 128 ** -0.5

    def fn():
        caller = torch.cuda.current_stream()
        side.wait_stream(caller)
        with torch.cuda.stream(side):
            if level.num_rows is not None:
                qb = gather_rows(layer.q, level.perm, level.num_rows, level.q_buf)
            else:
                qb = torch.index_select(layer.q, 0, level.perm, out=level.q_buf)
            _, lse_a = fa3_varlen(q=qb, k=layer.k_cache, v=layer.v_cache, out=level.out_buf, softmax_scale=scale,
                                  causal=False, return_softmax_lse=True, **call_a)
        _, lse = fa3_varlen(q=layer.q, k=layer.k_cache, v=layer.v_cache, out=layer.out, softmax_scale=scale,
                            causal=True, return_softmax_lse=True, **ctx)
        caller.wait_stream(side)
        _, lse_b = fa3_varlen(q=level.q_buf, k=layer.k_cache, v=layer.v_cache, out=level.out_buf,
                              softmax_scale=scale, causal=False, return_softmax_lse=True, **call_b)
        fuse_in_place(layer.out, lse, level.out_buf, lse_a, rows_a, update_lse=True)
        fuse_in_place(layer.out, lse, level.out_buf, lse_b, rows_b, update_lse=False)
    return fn


def err_vs(layer, fn, ref):
    """Largest difference of `fn`'s output from `ref` (both eager)."""
    fn()
    torch.cuda.synchronize()
    return float((layer.out.float() - ref.float()).abs().max())


def run(layer, plan):
    return lambda: relay_attention(layer.q, layer.k_cache, layer.v_cache, plan, layer.out, 128 ** -0.5,
                                   fa3_varlen, {"fa_version": 3})


def level_only(layer, plan):
    level = plan.shared[0]
    q = layer.q
    return lambda: fa3_varlen(q=q, k=layer.k_cache, v=layer.v_cache, out=None, softmax_scale=128 ** -0.5,
                              causal=False, return_softmax_lse=True, **level.call)


def ctx_only(layer, plan):
    return lambda: fa3_varlen(q=layer.q, k=layer.k_cache, v=layer.v_cache, out=layer.out, softmax_scale=128 ** -0.5,
                              causal=True, return_softmax_lse=True, **plan.context)


def add_point_args(p, ns: str) -> None:
    """The decode points' options (comma-separated lists), --rep and --out, for this and bench_joint.py."""
    p.add_argument("--models", default="llama2-7b,llama3-8b")
    p.add_argument("--ns", default=ns)
    p.add_argument("--contexts", default="128,320")
    p.add_argument("--system-lens", default="2048,8192")
    p.add_argument("--rep", type=int, default=40)
    p.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results"))


def decode_points(args, fa, sms):
    """(Layer, its row with the no-prompt layer's graph us, the backend's split cap, hq, hkv) for each
    model, S, n and c of `args`, planned with graphs as large as the batch. The caller drops its
    references at the end of its turn; the GPU memory is given back before the next point is built."""
    bench_layer.ARGS = args
    cap_config = bench_layer.config

    def config(hq, hkv, shared_path, max_seqs, full_graphs=True):  # graphs as large as the batch
        cfg = cap_config(hq, hkv, shared_path, max_seqs, full_graphs)
        cfg.compilation_config.max_cudagraph_capture_size = max(512, max_seqs)
        cfg.scheduler_config.max_num_batched_tokens = max(8192, max_seqs)
        return cfg

    bench_layer.config = config
    for name in args.models.split(","):
        hq, hkv = MODELS[name]
        cap = bench_layer.GRAPH_SPLITS = graph_split_cap(32, sms, hkv)  # the backend's cap
        for S in map(int, args.system_lens.split(",")):
            for n in map(int, args.ns.split(",")):
                for c in map(int, args.contexts.split(",")):
                    layer = Layer(fa, hq, hkv, n, S, c)
                    row = dict(model=name, S=S, n=n, c=c)
                    row["noprompt"] = graph_ms(run(layer, layer.plan("never", True, plain=True)[0])) * 1e3
                    yield layer, row, cap, hq, hkv
                    del layer
                    torch.cuda.empty_cache()


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_point_args(p, "256,512,768,1024")
    p.add_argument("--ks", default="4,8,16,24")
    p.add_argument("--fracs", default="", help="split columns: the level's share of rows on the k SMs")
    args = p.parse_args()
    os.environ["VLLM_RELAY_JOINT"] = "0"  # the levels as their own call: the form this splits across SMs
    fa = FA()
    print(torch.ops._vllm_fa3_C.fwd.default._schema, flush=True)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    high = torch.cuda.Stream(priority=LEVEL_STREAM_PRIORITY)
    ks = [int(k) for k in args.ks.split(",")]
    fracs = [float(f) for f in args.fracs.split(",") if f]
    rows, t0 = [], time.time()
    for layer, row, splits, _, _ in decode_points(args, fa, sms):
        plan, planner = layer.plan("always", True, stream=high)
        row["relay"] = graph_ms(run(layer, plan)) * 1e3
        run(layer, plan)()
        ref = layer.out.clone()
        row["ctx_0"] = graph_ms(ctx_only(layer, with_margins(fa, layer, plan, 0, 0, splits))) * 1e3
        for k in ks:
            both = with_margins(fa, layer, plan, k, sms - k, splits)
            row[f"both_{k}"] = graph_ms(run(layer, both)) * 1e3
            row[f"ctxm_{k}"] = graph_ms(run(layer, with_margins(fa, layer, plan, k, 0, splits))) * 1e3
            row[f"ctxv_{k}"] = graph_ms(run(layer, with_margins(fa, layer, plan, k, 0, splits,
                                                                ctx_schedule=False))) * 1e3
            row[f"level_{k}"] = graph_ms(level_only(layer, both)) * 1e3
            row[f"err_both_{k}"] = err_vs(layer, run(layer, both), ref)
            for f in fracs:
                fn = split_level(fa, layer, plan, k, f, sms, splits, high)
                row[f"split{int(f * 100)}_{k}"] = graph_ms(fn) * 1e3
                row[f"err_split{int(f * 100)}_{k}"] = err_vs(layer, fn, ref)
            row[f"ctx_{k}"] = graph_ms(ctx_only(layer, both)) * 1e3
        rows.append(row)
        print(" ".join(f"{k}={v:.1f}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items()),
              flush=True)
        del layer, plan, planner
    cols = ["noprompt", "relay"] + [f"{c}_{k}" for c in ("ctxm", "ctxv", "both") for k in ks] + ["ctx_0"] + \
        [f"ctx_{k}" for k in ks] + [f"level_{k}" for k in ks] + \
        [f"split{int(f * 100)}_{k}" for k in ks for f in fracs]
    md = [f"# A decode layer with the level on its own SMs: {torch.cuda.get_device_name()} ({sms} SMs)", "",
          __doc__.split("\n\n")[2], "", "| model | S | n | c | " + " | ".join(cols) + " |",
          "|---" * (4 + len(cols)) + "|"]
    md += [f"| {r['model']} | {r['S']} | {r['n']} | {r['c']} | " + " | ".join(f"{r[c]:.1f}" for c in cols) + " |"
           for r in rows]
    write_results(args.out, "margin", dict(sms=sms, seconds=time.time() - t0, rows=rows), "\n".join(md) + "\n")
    print("\n".join(md))


if __name__ == "__main__":
    main()
