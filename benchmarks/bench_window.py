"""One decode step of a sliding-window layer over a shared prompt, kernel level: relay against FlashAttention.

Every request of a batch of B shares an S-token prompt and owns c tokens after it; the layer's window is W
tokens (a request at position p sees keys p - W + 1 .. p). Two ops, bf16, block size 16, shuffled blocks:
  relay   the prompt as one level, each request reading it from its window on (`ops/window_level.py`:
          one call for all B rows, each with its first visible key), its own c tokens with FlashAttention's
          window, the two merged by their LSEs (`relay_fusion`);
  FA      FlashAttention's window over each request's whole table, as vLLM's backend calls it.
Each op is captured in a CUDA graph and its replay timed with triton.testing.do_bench (median, L2
flushed). GB/s count the fewest bytes each op must move (relay: the prompt's keys any window reaches,
once, and each request's own; FA: each request's window). Shapes: Gemma-3-12B's window layers (16 query /
8 KV heads, D=256, W=1024) and gpt-oss's (64 / 8, D=64, W=128).

Then the level call alone at each tile shape and key-range split, against the launch the kernel's rules pick.

Usage: python3 benchmarks/bench_window.py [--quick] [--tiles-only] [--out DIR]   (writes window_ops.json, .md)
"""

import json
import os
import sys

import torch
import triton

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import graph_ms, kernel_args, measure_card  # noqa: E402
from vllm_relay.ops import RelayPlan, SharedLevel, relay_attention  # noqa: E402
from vllm_relay.ops.window_level import window_level_attention  # noqa: E402

SHAPES = {"gemma-3-12b": (16, 8, 256, 1024), "gpt-oss": (64, 8, 64, 128)}  # Hq, Hkv, D, W
BLOCK, DTYPE = 16, torch.bfloat16


def case(varlen, hq, hkv, d, w, B, S, c):
    """The two ops of one decode step (closures) and their outputs."""
    dev = "cuda"
    n_sys, n_own = S // BLOCK, triton.cdiv(c, BLOCK)
    kv = torch.randn(n_sys + B * n_own, BLOCK, hkv, 2 * d, device=dev, dtype=DTYPE)
    k, v = kv[..., :d], kv[..., d:]
    perm = torch.randperm(kv.shape[0], device=dev, dtype=torch.int32)
    sys_blocks, own_blocks = perm[:n_sys], perm[n_sys:].view(B, n_own)
    full = torch.cat([sys_blocks.expand(B, n_sys), own_blocks], dim=1).contiguous()
    own = torch.randint(1, c + 1, (B,), device=dev, dtype=torch.int32)  # each request's own tokens so far
    q = torch.randn(B, hq, d, device=dev, dtype=DTYPE)
    scale, window = d ** -0.5, (w - 1, 0)
    cu = torch.arange(B + 1, device=dev, dtype=torch.int32)
    level = SharedLevel(
        perm=torch.arange(B, device=dev, dtype=torch.int32), row_index=torch.arange(B, device=dev, dtype=torch.int32),
        call=dict(cu_seqlens_q=torch.tensor([0, B], device=dev, dtype=torch.int32),
                  seqused_k=torch.tensor([S], device=dev, dtype=torch.int32), max_seqlen_q=B,
                  max_seqlen_k=min(S, w),  # (the most keys a row reads, as relay's planner passes it)
                  block_table=sys_blocks[None].contiguous(), key_start=S + own - 1 - (w - 1)),
        q_buf=torch.empty_like(q), out_buf=torch.empty_like(q), attn_fn=window_level_attention)
    plan = RelayPlan(context=dict(cu_seqlens_q=cu, seqused_k=own, max_seqlen_q=1, max_seqlen_k=c,
                                  block_table=own_blocks.contiguous()), shared=[level])
    out_relay, out_fa = torch.empty_like(q), torch.empty_like(q)

    def relay():
        relay_attention(q, k, v, plan, out_relay, scale, varlen, attn_kwargs={"fa_version": 3},
                        context_kwargs={"window_size": window})

    def fa():
        varlen(q=q, k=k, v=v, out=out_fa, cu_seqlens_q=cu, max_seqlen_q=1, seqused_k=S + own, max_seqlen_k=S + c,
               softmax_scale=scale, causal=True, window_size=window, block_table=full, fa_version=3)

    seen = (S - (S + own - w).clamp(min=0)).clamp(min=0)  # prompt keys each request's window reaches
    kv_tok = 2 * hkv * d * 2
    bytes_relay = 4 * B * hq * d + (int(seen.max()) + int(own.sum())) * kv_tok
    bytes_fa = 2 * B * hq * d * 2 + int((S + own).clamp(max=w).sum()) * kv_tok
    level_call = dict(q=q, k=k, v=v, out=level.out_buf, softmax_scale=scale, causal=False, **level.call)
    return relay, fa, out_relay, out_fa, bytes_relay, bytes_fa, level_call


def tile_sweep(rep: int, quick: bool = False) -> list[dict]:
    """The level call alone (`window_level_attention`) at each tile (rows x heads, keys, warps), its keys
    whole (one range a program) and cut into the ranges `window_launch.num_splits` picks of
    MIN_SPLIT_KEYS = 64, 128 and 256 keys at least, against the launch the kernel's rules pick: the data
    those rules are held to.
    Decode steps of B = 8, 64 and 256 over a 2048-token prompt, 64 own tokens a request at most (8: a
    level of few rows is few programs, each over the whole window). `quick`: the tiles that matter."""
    from vllm_relay.ops import window_launch as wl

    rules = wl.tiles, wl.num_splits, wl.MIN_SPLIT_KEYS
    rows = []
    for name, (hq, hkv, d, w) in SHAPES.items():
        group = hq // hkv
        for B in (8, 64, 256):
            *_, call = case(None, hq, hkv, d, w, B, 2048, 64)
            chosen = (*rules[0](B, group, d), rules[2])
            tiles = [(m, n, warps) for m in (16, 32, 64) for n in (16, 32, 64) for warps in (4, 8)
                     if m >= group]
            if quick:
                tiles = [t for t in tiles if t[2] == chosen[3] and (t[0] == 16 or t[:2] == chosen[:2])]
            for block_m, block_n, warps in tiles:
                for min_keys in (None, 64, 128, 256):  # None: one range
                    wl.tiles = lambda *_, c=(block_m, block_n, chosen[2], warps): c
                    wl.num_splits = rules[1] if min_keys else (lambda *_: 1)
                    wl.MIN_SPLIT_KEYS = min_keys or rules[2]
                    try:  # (the ranges as the call makes them)
                        splits = wl.launch(B, group, hkv, d, 1, B, call["max_seqlen_k"],
                                           wl.sm_count(call["q"].device))[1]["SPLITS"]
                        us = graph_ms(lambda call=call: window_level_attention(**call), rep)[0] * 1e3
                    finally:
                        wl.tiles, wl.num_splits, wl.MIN_SPLIT_KEYS = rules
                    rows.append(dict(shape=name, B=B, block_m=block_m, block_n=block_n, warps=warps,
                                     splits=splits, min_split_keys=min_keys, us=us,
                                     chosen=(block_m, block_n, chosen[2], warps, min_keys) == chosen))
                    print(" ".join(f"{k}={v:.1f}" if k == "us" else f"{k}={v}" for k, v in rows[-1].items()))
    return rows


def padded(call: dict, groups: int) -> dict:
    """The level call as a CUDA graph holds it: its group, then `groups - 1` empty ones (no rows, no keys)."""
    cu, lens, table = call["cu_seqlens_q"], call["seqused_k"], call["block_table"]
    pad = groups - lens.shape[0]
    return dict(call, cu_seqlens_q=torch.cat([cu, cu[-1:].expand(pad)]),
                seqused_k=torch.cat([lens, lens.new_zeros(pad)]),
                block_table=torch.cat([table, table[:1].expand(pad, -1)]).contiguous())


def graph_groups(rep: int) -> list[dict]:
    """The level call with the kernel's own rules, alone in its call and padded to the groups a decode graph
    of B tokens holds (`RelayPlanner.graph_capacity`: 2 system-prompt slots, `max_prompts`' default, and
    min(2 B, GRAPH_LEVELS = 64) levels): every empty group's programs are launched too, and the rules
    choose tiles and ranges for the grid they make; alone and padded, also as the compact grid (a few
    programs a multiprocessor looping over the real tiles: `window_launch.COMPACT_FROM_GROUPS`)."""
    from vllm_relay.ops import window_launch

    rows = []
    for name, (hq, hkv, d, w) in SHAPES.items():
        for B in (8, 64, 256):
            *_, call = case(None, hq, hkv, d, w, B, 2048, 64)
            graph = 2 + min(2 * B, 64)
            for groups, compact in ((1, None), (1, 1), (graph, None), (graph, 2)):
                one, rule = padded(call, groups), window_launch.COMPACT_FROM_GROUPS
                window_launch.COMPACT_FROM_GROUPS = compact
                try:
                    us = graph_ms(lambda one=one: window_level_attention(**one), rep)[0] * 1e3
                finally:
                    window_launch.COMPACT_FROM_GROUPS = rule
                rows.append(dict(shape=name, B=B, groups=groups, compact=compact is not None, us=us))
                print(f"{name} B={B} groups={groups} compact={compact is not None}: {us:.1f} us")
    return rows


def main():
    args = kernel_args(__doc__, "fewer batch sizes and tiles", more=lambda p: p.add_argument(
        "--tiles-only", action="store_true",
        help="the level call's tiles alone (no FlashAttention: no vLLM needed)"))
    if not torch.cuda.is_available():
        sys.exit("bench_window.py needs a CUDA GPU")
    torch.manual_seed(0)
    copy_gbs = measure_card()["copy_bytes_per_s"] / 1e9
    rows = []
    shapes = {} if args.tiles_only else SHAPES
    if shapes:
        from vllm.vllm_flash_attn import flash_attn_varlen_func as varlen
    for name, (hq, hkv, d, w) in shapes.items():
        for B in ((8, 64, 256) if args.quick else (8, 16, 32, 64, 128, 256)):  # 8, 16: small serving batches
            for S, c in ((2048, 64), (2048, 512), (8192, 64)):
                relay, fa, out_relay, out_fa, b_relay, b_fa, _ = case(varlen, hq, hkv, d, w, B, S, c)
                relay()
                fa()
                err = (out_relay.float() - out_fa.float()).abs().max().item()
                if not err < 3e-2:
                    sys.exit(f"ABORT: relay differs from FlashAttention ({name}, B={B}, S={S}, c={c}): {err}")
                t_relay, t_fa = graph_ms(relay, args.rep)[0], graph_ms(fa, args.rep)[0]
                row = dict(shape=name, B=B, S=S, c=c, W=w, relay_us=t_relay * 1e3, fa_us=t_fa * 1e3,
                           fa_over_relay=t_fa / t_relay, relay_gbs=b_relay / t_relay / 1e6,
                           fa_gbs=b_fa / t_fa / 1e6, max_abs_diff=err)
                rows.append(row)
                print(f"{name} B={B:4d} S={S:5d} c={c:4d}: relay {row['relay_us']:7.1f} us "
                      f"({row['relay_gbs']:5.0f} GB/s)  FA {row['fa_us']:7.1f} us ({row['fa_gbs']:5.0f} GB/s)  "
                      f"FA/relay {row['fa_over_relay']:.2f}x")
    tiles = tile_sweep(args.rep, args.quick)
    padded_rows = graph_groups(args.rep)
    gpu = torch.cuda.get_device_name()
    lines = [f"# Sliding-window decode step over a shared prompt: {gpu}", "",
             f"bf16, block size 16, copy bandwidth (read+write) {copy_gbs:.0f} GB/s; medians of CUDA-graph "
             "replays with L2 flushed.", "",
             "| shape | W | B | S | c | relay us | FA us | FA/relay | relay GB/s | FA GB/s | max diff |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    lines += [f"| {r['shape']} | {r['W']} | {r['B']} | {r['S']} | {r['c']} | {r['relay_us']:.1f} | {r['fa_us']:.1f} "
              f"| {r['fa_over_relay']:.2f}x | {r['relay_gbs']:.0f} | {r['fa_gbs']:.0f} | {r['max_abs_diff']:.3g} |"
              for r in rows]
    lines += ["", "The level call alone by tile (rows x heads, keys, warps) and key ranges (a program's keys "
              "whole, or cut into `splits` ranges of at least `min keys`); * marks the launch the rules pick "
              "(S=2048, c <= 64):", "", "| shape | B | BLOCK_M | BLOCK_N | warps | splits | min keys | us |",
              "|---|---|---|---|---|---|---|---|"]
    lines += [f"| {r['shape']} | {r['B']} | {r['block_m']} | {r['block_n']} | {r['warps']} | {r['splits']} | "
              f"{r['min_split_keys'] or ''} | {r['us']:.1f}{' *' if r['chosen'] else ''} |" for r in tiles]
    lines += ["", "The level call with the kernel's rules, alone and among the groups a CUDA graph of B "
              "decode tokens holds (the rest empty, their programs launched all the same), and that as the "
              "compact grid:", "", "| shape | B | groups | grid | us |", "|---|---|---|---|---|"]
    lines += [f"| {r['shape']} | {r['B']} | {r['groups']} | {'compact' if r['compact'] else 'by group'} | "
              f"{r['us']:.1f} |" for r in padded_rows]
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "window_ops.json"), "w") as f:
        json.dump(dict(gpu=gpu, copy_gbs=copy_gbs, rows=rows, tiles=tiles, graph_groups=padded_rows), f,
                  indent=1)
    with open(os.path.join(args.out, "window_ops.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
