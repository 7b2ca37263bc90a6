"""Ops benchmark on one GPU (written for an H200 with vllm==0.26.0): relay attention vs vLLM.

Decode steps of Llama-2-7B (32 q / 32 kv heads) and Llama-3-8B (32 q / 8 kv heads), D=128, bf16,
block size 16, every request sharing one S-token system prompt and owning c context tokens:
  (a) relay_attention on the shared path: context attention over each request's own pages + one
      grouped system call over the system prompt's pages (in the same paged cache) + relay_fusion
      (plan built outside the timed region);
  (b) plain FlashAttention varlen decode over each request's full paged KV (the shared system
      blocks, then its own blocks), called as vLLM's FlashAttention backend calls it;
  (c) vLLM 0.26 cascade attention (`vllm.v1.attention.backends.flash_attn.cascade_attention`);
  (d) relay_fusion alone vs vLLM's `merge_attn_states` (CUDA op and Triton kernel).
Each op is captured in a CUDA graph and its replay timed with triton.testing.do_bench (median,
L2 flushed between replays). Copy bandwidth is measured in the same run. Results go to
<out>/ops.json and <out>/ops.md; the markdown table is printed last.

Usage: python3 benchmarks/bench_ops.py [--quick] [--decode MODEL:B:S:c,...] [--out DIR]
(--decode: only these decode steps, e.g. llama2-7b:256:16000:128, n=256 samples of a 16000-token prompt
128 tokens in; relay's TFLOP/s are its attention's, four a head dimension a query-key pair, against the
card's bf16 matmul rate.)
"""

import json
import os
import sys
import time

import numpy as np
import torch
import triton

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import graph_ms, kernel_args, measure_card  # noqa: E402
from vllm_relay.ops import RelayPlan, SharedLevel, relay_attention, relay_fusion  # noqa: E402

MODELS = {"llama2-7b": (32, 32), "llama3-8b": (32, 8)}  # (Hq, Hkv)
HEAD_DIM = 128
BLOCK = 16
# vLLM 0.26's cap on FlashAttention's key splits in CUDA graphs (flash_attn_max_num_splits_for_cuda_graph)
GRAPH_SPLITS = 32
DTYPE = torch.bfloat16


def time_op(fn):
    """Median ms of `fn` replayed from a CUDA graph (eager launches where it cannot be captured), and how."""
    return graph_ms(fn, ARGS.rep, eager_fallback=True)


class FA:
    """vLLM's FlashAttention entry points, called as vllm/v1/attention/backends/flash_attn.py does."""

    def __init__(self):
        from vllm.v1.attention.backends.fa_utils import get_flash_attn_version
        from vllm.vllm_flash_attn import flash_attn_varlen_func, get_scheduler_metadata

        self.varlen = flash_attn_varlen_func
        self.get_scheduler_metadata = get_scheduler_metadata
        self.version = get_flash_attn_version() or 3
        try:
            from vllm.v1.attention.backends.flash_attn import cascade_attention
        except Exception as e:  # noqa: BLE001
            print(f"cascade_attention not importable ({e}); (c) is skipped")
            cascade_attention = None
        self.cascade = cascade_attention

    def schedule(self, batch, cu_q, max_q, seqlens, max_k, causal, hq, hkv, num_splits=0, sm_margin=0):
        """FlashAttention-3's AOT schedule, as FlashAttentionMetadataBuilder.build computes it
        (`num_splits`: its cap on key splits, 0 for FlashAttention's own heuristic; `sm_margin`: the
        SMs the call leaves free, as the call itself must be given)."""
        if self.version != 3:
            return None
        return self.get_scheduler_metadata(
            batch_size=batch, max_seqlen_q=max_q, max_seqlen_k=max_k, num_heads_q=hq, num_heads_kv=hkv,
            headdim=HEAD_DIM, cache_seqlens=seqlens, qkv_dtype=DTYPE, cu_seqlens_q=cu_q, page_size=BLOCK,
            causal=causal, window_size=(-1, -1), num_splits=num_splits, sm_margin=sm_margin)


def decode_case(fa, hq, hkv, B, S, c):
    """Build the inputs of one decode step and return the three ops as closures."""
    dev = "cuda"
    n_sys, n_ctx = S // BLOCK, triton.cdiv(c, BLOCK)
    num_blocks = n_sys + B * n_ctx
    # FlashAttention's cache: physically [blocks, block_size, Hkv, 2D], K and V packed in the last dim.
    kv = torch.randn(num_blocks, BLOCK, hkv, 2 * HEAD_DIM, device=dev, dtype=DTYPE)
    k_cache, v_cache = kv[..., :HEAD_DIM], kv[..., HEAD_DIM:]
    perm = torch.randperm(num_blocks, device=dev, dtype=torch.int32)  # shuffled physical blocks
    sys_blocks = perm[:n_sys]
    ctx_blocks = perm[n_sys:].view(B, n_ctx)
    full_table = torch.cat([sys_blocks.expand(B, n_sys), ctx_blocks], dim=1).contiguous()
    q = torch.randn(B, hq, HEAD_DIM, device=dev, dtype=DTYPE)
    scale = HEAD_DIM ** -0.5
    cu_q = torch.arange(B + 1, device=dev, dtype=torch.int32)
    full_lens = torch.full((B,), S + c, device=dev, dtype=torch.int32)
    ctx_lens = torch.full((B,), c, device=dev, dtype=torch.int32)
    fa_kw = {"fa_version": fa.version, "num_splits": 0}

    # (a) relay, shared path: the system prompt's pages read once for all B tokens, each request's own.
    cu_sys = torch.tensor([0, B], device=dev, dtype=torch.int32)
    sys_lens = torch.tensor([S], device=dev, dtype=torch.int32)
    level = SharedLevel(
        perm=torch.arange(B, device=dev, dtype=torch.int32), row_index=torch.arange(B, device=dev, dtype=torch.int32),
        call=dict(cu_seqlens_q=cu_sys, seqused_k=sys_lens, max_seqlen_q=B, max_seqlen_k=S,
                  block_table=sys_blocks[None].contiguous(),
                  scheduler_metadata=fa.schedule(1, cu_sys, B, sys_lens, S, False, hq, hkv)),
        q_buf=torch.empty_like(q), out_buf=torch.empty_like(q))
    plan = RelayPlan(context=dict(cu_seqlens_q=cu_q, seqused_k=ctx_lens, max_seqlen_q=1, max_seqlen_k=c,
                                  block_table=ctx_blocks.contiguous(),
                                  scheduler_metadata=fa.schedule(B, cu_q, 1, ctx_lens, c, True, hq, hkv)),
                     shared=[level])
    out_a = torch.empty_like(q)

    def relay():
        relay_attention(q, k_cache, v_cache, plan, out_a, scale, fa.varlen, attn_kwargs=fa_kw)

    def level_with(splits: int):
        """The level's call alone (its B rows over the S-token prompt, not causal), FA3 scheduled with
        `splits` key splits at most (0: FA3's own heuristic)."""
        call = {**level.call, "num_splits": splits,
                "scheduler_metadata": fa.schedule(1, cu_sys, B, sys_lens, S, False, hq, hkv, num_splits=splits)}
        out = torch.empty_like(q)
        return lambda: fa.varlen(q=q, k=k_cache, v=v_cache, out=out, softmax_scale=scale, causal=False,
                                 fa_version=fa.version, **call)

    # (b) plain FA decode over the full paged KV, as FlashAttentionImpl.forward calls it.
    sched_b = fa.schedule(B, cu_q, 1, full_lens, S + c, True, hq, hkv)
    out_b = torch.empty_like(q)

    def plain():
        fa.varlen(q=q, k=k_cache, v=v_cache, out=out_b, cu_seqlens_q=cu_q, max_seqlen_q=1,
                  seqused_k=full_lens, max_seqlen_k=S + c, softmax_scale=scale, causal=True,
                  alibi_slopes=None, window_size=None, block_table=full_table, softcap=0.0,
                  scheduler_metadata=sched_b, fa_version=fa.version, q_descale=None, k_descale=None,
                  v_descale=None, num_splits=0, s_aux=None)

    # (c) vLLM's cascade attention, with the metadata its builder would make.
    cascade = None
    out_c = torch.empty_like(q)
    if fa.cascade is not None:
        cu_prefix = torch.tensor([0, B], device=dev, dtype=torch.int32)
        prefix_lens = torch.tensor([S], device=dev, dtype=torch.int32)
        sched_p = fa.schedule(1, cu_prefix, B, prefix_lens, S, False, hq, hkv)
        sched_s = fa.schedule(B, cu_q, 1, ctx_lens, c, True, hq, hkv)

        def cascade():
            fa.cascade(out_c, q, k_cache, v_cache, cu_q, 1, cu_prefix, prefix_lens, ctx_lens, S + c, scale,
                       None, (-1, -1), 0.0, full_table, S, 0, fa.version,
                       prefix_scheduler_metadata=sched_p, suffix_scheduler_metadata=sched_s)

    def joint_with(rows_per_seq: int, splits: int):
        """Relay's decode step as the planner makes it (ops/joint.py): one call over the level's rows in
        sequences of `rows_per_seq` query rows (tokens x query heads per KV head, as `rules.joint_tokens`)
        and a sequence per token over its own pages, then `fuse_joint`;
        FA3 capped at `splits` key splits (1: unsplit; 0: its dynamic split). (The op, its output.)"""
        from vllm_relay.ops.joint import joint_layout

        tokens_per_seq = max(1, rows_per_seq // (hq // hkv))
        _, cu_joint = joint_layout(np.array([0, B]), tokens_per_seq, B)
        J = len(cu_joint) - 1 - B
        width = max(n_sys, n_ctx)
        table = torch.zeros(J + B, width, device=dev, dtype=torch.int32)
        table[:J, :n_sys] = sys_blocks
        table[J:, :n_ctx] = ctx_blocks
        lens = torch.cat([torch.full((J,), S, device=dev, dtype=torch.int32), ctx_lens])
        cu = torch.from_numpy(cu_joint).to(dev)
        rows = torch.arange(B, device=dev, dtype=torch.int32)
        joint = SharedLevel(
            perm=torch.cat([rows, rows]), row_index=rows.clone(), ctx_start=torch.tensor([B], device=dev,
                                                                                         dtype=torch.int32),
            call=dict(cu_seqlens_q=cu, seqused_k=lens, max_seqlen_q=tokens_per_seq, max_seqlen_k=S,
                      block_table=table, num_splits=splits,
                      scheduler_metadata=fa.schedule(J + B, cu, tokens_per_seq, lens, S, False, hq, hkv,
                                                     num_splits=splits)),
            q_buf=torch.empty(2 * B, hq, HEAD_DIM, device=dev, dtype=DTYPE),
            out_buf=torch.empty(2 * B, hq, HEAD_DIM, device=dev, dtype=DTYPE))
        joint_plan = RelayPlan(context={}, shared=[joint])
        out = torch.empty_like(q)
        kw = {"fa_version": fa.version}
        return (lambda: relay_attention(q, k_cache, v_cache, joint_plan, out, scale, fa.varlen, attn_kwargs=kw)), out

    return relay, plain, cascade, (out_a, out_b, out_c), (level_with, joint_with)


def check_decode(fa) -> bool:
    """(a) and (c) must match (b) before anything is timed; whether relay's joint calls match it too
    (timed only then)."""
    joint_right = True
    for name, (hq, hkv) in MODELS.items():
        relay, plain, cascade, (out_a, out_b, out_c), (_, joint_with) = decode_case(fa, hq, hkv, 64, 2048, 200)
        relay()
        plain()
        if cascade is not None:
            cascade()
        torch.cuda.synchronize()
        for label, o in (("relay", out_a), ("cascade", out_c if cascade is not None else out_b)):
            err = (o.float() - out_b.float()).abs().max().item()
            if not err < 2e-2 or torch.isnan(o).any():
                sys.exit(f"ABORT: {label} differs from plain FlashAttention on {name}: max |diff| = {err}")
        print(f"correctness ({name}, B=64, S=2048, c=200): relay and cascade match plain FA")
        for rows, splits in ((64, 1), (128, 0)):  # the joint call, timed only with --decode: left out if wrong
            try:
                fn, o = joint_with(rows, splits)
                fn()
                torch.cuda.synchronize()
                err = (o.float() - out_b.float()).abs().max().item()
            except Exception as e:  # noqa: BLE001
                err = f"{type(e).__name__}: {e}"
            if not (isinstance(err, float) and err < 2e-2 and not torch.isnan(o).any()):
                joint_right = False
                print(f"relay's joint call differs from plain FlashAttention or failed ({name}, {rows} rows, "
                      f"splits {splits}: {err}): its forms are not timed")
    return joint_right


def decode_points(quick: bool, decode: str | None) -> list[tuple]:
    """(model, B, S, c) of each decode step timed: `decode`'s (MODEL:B:S:c,...) or the grid."""
    if decode:
        points = [tuple(p.split(":")) for p in decode.split(",")]
        if any(len(p) != 4 or p[0] not in MODELS or not all(x.isdigit() for x in p[1:]) for p in points):
            sys.exit(f"--decode takes MODEL:B:S:c,... with MODEL one of {sorted(MODELS)} and B, S, c counts: "
                     f"{decode!r}")
        return [(m, int(B), int(S), int(c)) for m, B, S, c in points]
    Bs, Ss, cs = ((32, 512), (2048,), (128,)) if quick else ((32, 128, 512), (512, 2048, 8192), (128, 512))
    return [(name, B, S, c) for name in MODELS for B in Bs for S in Ss for c in cs]


def bench_decode(fa, card, quick, decode=None, joint=True):
    copy_bw = card["copy_bytes_per_s"] / 1e9
    rows = []
    for name, B, S, c in decode_points(quick, decode):
        hq, hkv = MODELS[name]
        relay, plain, cascade, _, (level_with, joint_with) = decode_case(fa, hq, hkv, B, S, c)
        t_a, mode = time_op(relay)
        t_b, _ = time_op(plain)
        # Eager launches too: with piecewise CUDA graphs vLLM runs attention eagerly.
        e_a = triton.testing.do_bench(relay, warmup=25, rep=ARGS.rep, return_mode="median")
        e_b = triton.testing.do_bench(plain, warmup=25, rep=ARGS.rep, return_mode="median")
        t_c = time_op(cascade)[0] if cascade is not None else float("nan")
        kv_tok = 2 * hkv * HEAD_DIM * 2  # K and V bytes per token
        qo = 2 * B * hq * HEAD_DIM * 2
        bytes_relay = qo + (S + B * c) * kv_tok
        bytes_plain = qo + B * (S + c) * kv_tok
        theory = (S + c + 2) / (S / B + c + 7)
        row = dict(model=name, B=B, S=S, c=c, timing=mode,
                   relay_us=t_a * 1e3, plain_fa_us=t_b * 1e3, cascade_us=t_c * 1e3,
                   relay_eager_us=e_a * 1e3, plain_fa_eager_us=e_b * 1e3,
                   relay_gbs=bytes_relay / t_a / 1e6, plain_fa_gbs=bytes_plain / t_b / 1e6,
                   cascade_gbs=bytes_relay / t_c / 1e6,
                   speedup_plain_over_relay=t_b / t_a, speedup_cascade_over_relay=t_c / t_a,
                   theory_speedup=theory, measured_over_theory=(t_b / t_a) / theory)
        row["relay_pct_copy"] = 100 * row["relay_gbs"] / copy_bw
        row["plain_fa_pct_copy"] = 100 * row["plain_fa_gbs"] / copy_bw
        row["relay_tflops"] = 4 * B * hq * HEAD_DIM * (S + c) / t_a / 1e9  # QK^T and PV, 2 a multiply-add
        row["relay_pct_matmul"] = 100 * row["relay_tflops"] * 1e12 / card["bf16_flop_per_s"]
        if decode:  # the steps asked for: their level's and joint call's forms (a failure reported, not fatal)
            try:
                row.update(forms(level_with, joint_with if joint else None, 4 * B * hq * HEAD_DIM * S, card))
            except Exception as e:  # noqa: BLE001
                print(f"  (the level's forms failed: {type(e).__name__}: {e})")
        rows.append(row)
        print(f"{name} B={B:4d} S={S:5d} c={c:4d}: relay {row['relay_us']:8.1f} us  "
              f"FA {row['plain_fa_us']:8.1f} us  cascade {row['cascade_us']:8.1f} us  "
              f"FA/relay {row['speedup_plain_over_relay']:.2f}x (theory {theory:.2f}x)  relay "
              f"{row['relay_tflops']:.0f} TFLOP/s ({row['relay_pct_matmul']:.0f}% of matmul)")
        del relay, plain, cascade
        torch.cuda.empty_cache()
    return rows


def forms(level_with, joint_with, level_flops: float, card: dict) -> dict:
    """A decode step's level alone by its cap on FA3's key splits (us, TFLOP/s, % of the matmul rate), and
    relay's joint call of the step by its level sequences' rows and split (us; none without `joint_with`)."""
    level = {}
    for splits in (0, 1, 2, 4, 8, 16):
        ms = time_op(level_with(splits))[0]
        level[splits] = dict(us=ms * 1e3, tflops=level_flops / ms / 1e9,
                             pct_matmul=100 * level_flops / ms * 1e3 / card["bf16_flop_per_s"])
    print("  the level alone, by FA3's split cap (0: its heuristic): " + ", ".join(
        f"{k}: {v['us']:.0f} us {v['tflops']:.0f} TFLOP/s" for k, v in level.items()))
    if joint_with is None:  # (check_decode found it wrong)
        return {"level": level, "joint": {}}
    joint = {f"{rows}x{splits}": time_op(joint_with(rows, splits)[0])[0] * 1e3
             for rows in (64, 128) for splits in (1, 0)}
    print("  the joint call (level sequences of 64 / 128 rows, unsplit x1 / FA3's dynamic split x0): "
          + ", ".join(f"{k}: {v:.0f} us" for k, v in joint.items()))
    return {"level": level, "joint": joint}


def bench_fusion(copy_bw, quick):
    from vllm._custom_ops import merge_attn_states as merge_cuda
    from vllm.v1.attention.ops.triton_merge_attn_states import merge_attn_states as merge_triton

    H, D = 32, HEAD_DIM
    Ts = (512, 65536) if quick else (32, 128, 512, 8192, 65536)
    rows = []
    for T in Ts:
        o_sys = torch.randn(T, H, D, device="cuda", dtype=DTYPE)
        o_ctx = torch.randn(T, H, D, device="cuda", dtype=DTYPE)
        lse_sys = torch.randn(H, T, device="cuda") * 3
        lse_ctx = torch.randn(H, T, device="cuda") * 3
        out = torch.empty_like(o_ctx)
        ours = relay_fusion(o_sys, lse_sys, o_ctx, lse_ctx, out=out)
        ref = torch.empty_like(out)
        merge_cuda(ref, o_sys, lse_sys, o_ctx, lse_ctx)
        err = (ours.float() - ref.float()).abs().max().item()
        if not err < 2e-2:
            sys.exit(f"ABORT: relay_fusion differs from vLLM merge_attn_states at T={T}: {err}")
        ctx_copy = o_ctx.clone()
        times = {
            "relay_fusion": time_op(lambda: relay_fusion(o_sys, lse_sys, o_ctx, lse_ctx, out=out))[0],
            "relay_fusion_inplace": time_op(
                lambda: relay_fusion(o_sys, lse_sys, ctx_copy, lse_ctx, out=ctx_copy))[0],
            "vllm_cuda": time_op(lambda: merge_cuda(out, o_sys, lse_sys, o_ctx, lse_ctx))[0],
            "vllm_triton": time_op(lambda: merge_triton(out, o_sys, lse_sys, o_ctx, lse_ctx))[0],
        }
        nbytes = 3 * T * H * D * 2 + 2 * T * H * 4  # read o_sys, o_ctx, 2 LSEs; write out
        row = dict(T=T, H=H, D=D, bytes=nbytes)
        for k, ms in times.items():
            row[f"{k}_us"] = ms * 1e3
            row[f"{k}_gbs"] = nbytes / ms / 1e6
            row[f"{k}_pct_copy"] = 100 * nbytes / ms / 1e6 / copy_bw
        row["speedup_vs_vllm_cuda"] = times["vllm_cuda"] / times["relay_fusion"]
        rows.append(row)
        print(f"fusion T={T:6d}: ours {row['relay_fusion_us']:8.1f} us "
              f"({row['relay_fusion_pct_copy']:.0f}% copy)  vLLM CUDA {row['vllm_cuda_us']:8.1f} us  "
              f"vLLM Triton {row['vllm_triton_us']:8.1f} us")
    return rows


def markdown(env, decode_rows, fusion_rows):
    lines = [f"# Ops benchmark: {env['gpu']}", "",
             f"torch {env['torch']}, triton {env['triton']}, vLLM {env['vllm']} "
             f"(FA{env['fa_version']}), bf16, "
             f"D=128, block size 16. Copy bandwidth (read+write): {env['copy_gbs']:.0f} GB/s, bf16 matmul "
             f"{env.get('matmul_tflops', float('nan')):.0f} TFLOP/s. "
             "Times are medians of CUDA-graph replays with L2 flushed; 'eager' columns launch from Python "
             "(host overhead included), as attention runs under vLLM's piecewise CUDA graphs.", "",
             "## Decode step: (a) relay vs (b) plain FlashAttention vs (c) vLLM cascade", "",
             "| model | B | S | c | relay us | FA us | cascade us | relay eager us | FA eager us | "
             "relay GB/s | relay % copy | relay TFLOP/s | relay % matmul | FA/relay | cascade/relay | theory | "
             "measured/theory |", "|---|" + "---|" * 16]
    for r in decode_rows:
        lines.append(f"| {r['model']} | {r['B']} | {r['S']} | {r['c']} | {r['relay_us']:.1f} | "
                     f"{r['plain_fa_us']:.1f} | {r['cascade_us']:.1f} | {r['relay_eager_us']:.1f} | "
                     f"{r['plain_fa_eager_us']:.1f} | {r['relay_gbs']:.0f} | "
                     f"{r['relay_pct_copy']:.0f}% | {r['relay_tflops']:.0f} | {r['relay_pct_matmul']:.0f}% | "
                     f"{r['speedup_plain_over_relay']:.2f}x | "
                     f"{r['speedup_cascade_over_relay']:.2f}x | {r['theory_speedup']:.2f}x | "
                     f"{r['measured_over_theory']:.2f} |")
    split_rows = [r for r in decode_rows if "level" in r]
    if split_rows:
        caps, forms = list(split_rows[0]["level"]), list(split_rows[0]["joint"])
        lines += ["", "The level's call alone (its B rows over the S-token prompt), us and TFLOP/s by FA3's cap on key "
                  "splits (0: FA3's heuristic); relay's joint call of the whole step (level sequences of 64 / 128 "
                  "query rows, x1 unsplit, x0 FA3's dynamic split), us:", "",
                  "| " + " | ".join(["model", "B", "S", *(f"cap {k}" for k in caps), *(f"joint {k}" for k in forms)])
                  + " |", "|---|---|---|" + "---|" * (len(caps) + len(forms))]
        lines += ["| " + " | ".join([r["model"], str(r["B"]), str(r["S"]),
                                     *(f"{r['level'][k]['us']:.0f} us, {r['level'][k]['tflops']:.0f}" for k in caps),
                                     *(f"{r['joint'][k]:.0f}" for k in forms)]) + " |" for r in split_rows]
    lines += ["", "GB/s count the fewest bytes each op must move: relay and cascade read the system KV once, "
              "plain FA reads it once per request (so its GB/s can exceed HBM bandwidth through L2 hits). "
              "Theory: the RelayAttention paper's (s + c + 2) / (s/b + c + 7), which assumes MHA.", "",
              "## relay_fusion vs vLLM merge_attn_states (H=32, D=128)", "",
              "| T | ours us | ours GB/s | ours % copy | ours in place us | vLLM CUDA us | "
              "vLLM CUDA % copy | vLLM Triton us | CUDA/ours |",
              "|---|---|---|---|---|---|---|---|---|"]
    for r in fusion_rows:
        lines.append(f"| {r['T']} | {r['relay_fusion_us']:.1f} | {r['relay_fusion_gbs']:.0f} | "
                     f"{r['relay_fusion_pct_copy']:.0f}% | {r['relay_fusion_inplace_us']:.1f} | "
                     f"{r['vllm_cuda_us']:.1f} | {r['vllm_cuda_pct_copy']:.0f}% | "
                     f"{r['vllm_triton_us']:.1f} | {r['speedup_vs_vllm_cuda']:.2f}x |")
    return "\n".join(lines) + "\n"


def main():
    start = time.time()
    if not torch.cuda.is_available():
        sys.exit("bench_ops.py needs a CUDA GPU")
    import vllm

    torch.manual_seed(0)
    fa = FA()
    card = measure_card()
    copy_bw = card["copy_bytes_per_s"] / 1e9
    env = dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__,
               vllm=vllm.__version__, fa_version=fa.version, copy_gbs=copy_bw,
               matmul_tflops=card["bf16_flop_per_s"] / 1e12, quick=ARGS.quick, decode=ARGS.decode)
    print(f"{env['gpu']}: copy bandwidth {copy_bw:.0f} GB/s (read+write), FA{fa.version}")
    joint_right = check_decode(fa)
    fusion_rows = bench_fusion(copy_bw, ARGS.quick)
    decode_rows = bench_decode(fa, card, ARGS.quick, ARGS.decode, joint_right)
    env["seconds"] = time.time() - start
    os.makedirs(ARGS.out, exist_ok=True)
    with open(os.path.join(ARGS.out, "ops.json"), "w") as f:
        json.dump(dict(env=env, decode=decode_rows, fusion=fusion_rows), f, indent=1)
    md = markdown(env, decode_rows, fusion_rows)
    with open(os.path.join(ARGS.out, "ops.md"), "w") as f:
        f.write(md)
    print(f"\n(total {env['seconds']:.0f} s; wrote {ARGS.out}/ops.json and ops.md)\n")
    print(md)


if __name__ == "__main__":
    ARGS = kernel_args(__doc__, "a subset of the configurations",
                       os.path.join(os.path.dirname(os.path.abspath(__file__)), "results"),
                       more=lambda p: p.add_argument("--decode", help="MODEL:B:S:c,...: only these decode steps"))
    main()
