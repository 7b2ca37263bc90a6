"""Does a shared latent level pay for MLA? One decode step's attention over a shared prompt, kernel level.

DeepSeek's multi-head latent attention (MLA) caches one latent vector a token: kv_lora_rank 512 values and
64 rotary ones, 576 in all, 1152 bytes in bf16; on decode every query head (absorbed: 576 values) reads it,
the first 512 values serving as V: MQA with one KV head. A token costs each query head 2 x (576 + 512) FLOPs
and the request 1152 bytes, whatever its heads: 30 FLOPs a byte with 16 query heads on the GPU
(DeepSeek-V2-Lite, or DeepSeek-V3 at tensor parallel 8), 242 with 128 (DeepSeek-V3 on one). An H200 does
about 200 bf16 FLOPs in the time it moves a byte, so 16 heads' decode is bound by memory and 128 heads' by
compute. Reading a shared prompt once for n requests saves bytes, not FLOPs: a latent level pays only where
the step is memory-bound. This measures it.

n requests share a P-token prompt and own 1..c tokens each after it; bf16, FlashMLA's 64-token pages,
shuffled. Four ways of one step's attention:
  flashmla  FlashMLA's dense decode over each request's whole table (vLLM's FLASHMLA backend's call);
  relay     the prompt as one level: FlashMLA over its pages with the n requests as one sequence of n query
            tokens, not causal (all n x H query rows read the prompt once); each request's own tokens with
            FlashMLA; the two merged by their LSEs (`relay_fusion`);
  fa3       FlashAttention-3's MLA form over each request's whole table (vLLM's FLASH_ATTN_MLA backend's
            call, ranked first on Hopper): rotary q and k, latent q_v and v;
  relay_fa3 `relay_attention` over the latent cache with FlashAttention-3 (`ops.latent_varlen`): the prompt as
            one level of n rows, each request's own pages in its context call, merged in place.
The last two with FA3's own choice of splits; and as full CUDA graphs run them in the engine, each call with
FA3's ahead-of-time schedule and vLLM's split cap for graphs (`GRAPH_SPLITS`), the level on a stream of its
own (relay's `level_stream`): `fa3_graph`, `relay_fa3_graph`, and `relay_fa3_ctx1`, the same with the
context call (each request's own 1..c tokens) unsplit.
Each checked first against an fp32 reference (`reference`), then timed (CUDA-graph replays, median, L2
flushed). The bound of each: its bytes at the card's copy bandwidth or its FLOPs at its bf16 matmul rate,
whichever takes longer (`bound_ms`).

Usage (GPU host, Hopper): python3 benchmarks/bench_mla.py [--quick] [--out DIR]   (mla_ops.json, mla_ops.md)
"""

import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import graph_ms, kernel_args, measure_card  # noqa: E402
from vllm_relay.ops import RelayPlan, SharedLevel, latent_varlen, relay_attention, relay_fusion  # noqa: E402

LATENT, ROPE = 512, 64  # DeepSeek's kv_lora_rank and qk_rope_head_dim
D_QK = LATENT + ROPE
SCALE = (128 + ROPE) ** -0.5  # 1 / sqrt(qk_nope_head_dim + qk_rope_head_dim), as DeepSeek's attention
BLOCK = 64  # FlashMLA's page
BYTES = 2  # bf16
HEADS = {"deepseek-v2-lite": 16, "deepseek-v3-tp2": 64, "deepseek-v3-tp1": 128}  # query heads on one GPU
# vLLM's `flash_attn_max_num_splits_for_cuda_graph`: the split cap FLASH_ATTN_MLA's decode calls (and relay's
# levels and contexts) run with in full CUDA graphs, their split buffers sized for it at capture.
GRAPH_SPLITS = 32


def step_cost(heads: int, P: int, own: list[int]) -> dict:
    """The fewest bytes each way moves and the FLOPs both do, for one layer's decode step of len(own)
    requests sharing P prompt tokens. FLOPs: QK^T over 576 values and PV over 512, per head per key.
    Bytes: the latent keys read (flashmla: every request its whole sequence; relay: the prompt once and
    each request's own tokens), queries read and outputs written (relay: queries twice, two partial
    outputs and their LSEs written, read again by the fusion, and the output written)."""
    n = len(own)
    keys = n * P + sum(own)
    flops = 2 * heads * keys * (D_QK + LATENT)
    q, o, lse = n * heads * D_QK * BYTES, n * heads * LATENT * BYTES, n * heads * 4
    return {"flops": flops,
            "flashmla_bytes": keys * D_QK * BYTES + q + o,
            "relay_bytes": (P + sum(own)) * D_QK * BYTES + 2 * q + 2 * (2 * o + 2 * lse) + o}


def bound_ms(bytes_: float, flops: float, card: dict) -> float:
    """The least time an op of these bytes and FLOPs takes on this card: memory or compute, the larger."""
    return max(bytes_ / card["copy_bytes_per_s"], flops / card["bf16_flop_per_s"]) * 1e3


def _keys(latent, blocks, n: int) -> torch.Tensor:
    """The first `n` latent tokens of these blocks, fp32 [n, 576]."""
    return latent[blocks].reshape(-1, D_QK)[:n].float()


def _attend(q, kv) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 attention of query heads q [..., 576] over latent keys kv [K, 576], V their first 512 values:
    (output [..., 512], natural-log LSE [...])."""
    s = q.float() @ kv.T * SCALE
    return torch.softmax(s, -1) @ kv[:, :LATENT], torch.logsumexp(s, -1)


def reference(q, latent, tables, seqlens) -> torch.Tensor:
    """fp32 MLA decode: each request's query heads [H, 576] over its keys, V the first 512 values."""
    return torch.stack([_attend(q[i], _keys(latent, table, n))[0]
                        for i, (table, n) in enumerate(zip(tables.tolist(), seqlens.tolist(), strict=True))])


def split_reference(q, latent, prompt_blocks, own_tables, P, own):
    """The same through relay's split, in fp32: the prompt as one level (every request's query rows at
    once), each request's own tokens, merged by the LSEs (`relay_fusion`'s torch path on the CPU)."""
    o_sys, lse_sys = _attend(q, _keys(latent, prompt_blocks, P))
    own_parts = [_attend(q[i], _keys(latent, table, n))
                 for i, (table, n) in enumerate(zip(own_tables.tolist(), own, strict=True))]
    o_ctx, lse_ctx = (torch.stack(x) for x in zip(*own_parts, strict=True))
    return relay_fusion(o_sys, lse_sys, o_ctx, lse_ctx, lse_layout="th")


def case(heads: int, n: int, P: int, c: int, device: str = "cuda", seed: int = 0):
    """One step's inputs: queries [n, H, 576], the latent cache [blocks, 64, 576], the prompt's blocks,
    each request's own blocks and own token count (1..c), and each request's whole table."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    n_sys, n_own = P // BLOCK, -(-c // BLOCK)
    latent = torch.randn(n_sys + n * n_own, BLOCK, D_QK, generator=g).to(device, torch.bfloat16)
    perm = torch.randperm(latent.shape[0], generator=g).to(device, torch.int32)
    prompt, own_tables = perm[:n_sys], perm[n_sys:].view(n, n_own)
    own = torch.randint(1, c + 1, (n,), generator=g).tolist()
    q = torch.randn(n, heads, D_QK, generator=g).to(device, torch.bfloat16)
    tables = torch.cat([prompt.expand(n, n_sys), own_tables], dim=1).contiguous()
    return q, latent, prompt, own_tables, own, tables


def ops(q, latent, prompt, own_tables, own, tables, P):
    """The two ways and relay's level call alone, each returning its output [n, H, 512] (FlashMLA allocates
    its outputs: its `out` argument takes the kernel's inner layout, not the one it returns)."""
    from vllm.v1.attention.ops.flashmla import flash_mla_with_kvcache, get_mla_metadata

    n, heads, _ = q.shape
    dev = q.device
    cache = latent.unsqueeze(2)  # [blocks, 64, 1 KV head, 576]
    whole_lens = torch.tensor([P + o for o in own], device=dev, dtype=torch.int32)
    own_lens = torch.tensor(own, device=dev, dtype=torch.int32)
    sys_lens = torch.tensor([P], device=dev, dtype=torch.int32)
    meta_whole, meta_sys, meta_own = (get_mla_metadata()[0] for _ in range(3))
    out_relay = torch.empty(n, heads, LATENT, device=dev, dtype=q.dtype)
    prompt_table = prompt[None].contiguous()

    def call(query, table, lens, meta):  # (out [b, s_q, H, 512], lse [b, H, s_q])
        return flash_mla_with_kvcache(q=query, k_cache=cache, block_table=table, cache_seqlens=lens,
                                      head_dim_v=LATENT, tile_scheduler_metadata=meta, softmax_scale=SCALE,
                                      causal=False, is_fp8_kvcache=False)

    def flashmla():
        return call(q.unsqueeze(1), tables, whole_lens, meta_whole)[0][:, 0]

    def level():  # the n requests as one sequence of n query tokens over the prompt's pages
        return call(q.unsqueeze(0), prompt_table, sys_lens, meta_sys)

    def relay():
        out_sys, lse_sys = level()  # [1, n, H, 512], [1, H, n]
        out_own, lse_own = call(q.unsqueeze(1), own_tables, own_lens, meta_own)  # [n, 1, H, 512], [n, H, 1]
        return relay_fusion(out_sys[0], lse_sys[0].t(), out_own[:, 0], lse_own[:, :, 0], out=out_relay,
                            lse_layout="th")

    from vllm.vllm_flash_attn import flash_attn_varlen_func

    fa = latent_varlen(flash_attn_varlen_func, LATENT)
    rows = torch.arange(n, device=dev, dtype=torch.int32)
    cu_n = torch.arange(n + 1, device=dev, dtype=torch.int32)
    own_max, values = max(own), cache[..., :LATENT]
    out_fa3, out_relay_fa3 = (torch.empty(n, heads, LATENT, device=dev, dtype=q.dtype) for _ in range(2))

    def fa3():
        return fa(q=q, k=cache, v=values, out=out_fa3, cu_seqlens_q=cu_n, max_seqlen_q=1, seqused_k=whole_lens,
                  max_seqlen_k=P + own_max, block_table=tables, softmax_scale=SCALE, causal=True, fa_version=3)

    plan = RelayPlan(
        context=dict(cu_seqlens_q=cu_n, seqused_k=own_lens, max_seqlen_q=1, max_seqlen_k=own_max,
                     block_table=own_tables),
        shared=[SharedLevel(perm=rows, row_index=rows.clone(),
                            call=dict(cu_seqlens_q=torch.tensor([0, n], device=dev, dtype=torch.int32),
                                      seqused_k=sys_lens, max_seqlen_q=n, max_seqlen_k=P, block_table=prompt_table))])

    def relay_fa3():
        return relay_attention(q, cache, values, plan, out_relay_fa3, SCALE, fa, attn_kwargs={"fa_version": 3})

    from vllm.v1.attention.backends.fa_utils import get_scheduler_metadata

    def schedule(batch, max_q, max_k, lens, cu, causal, splits):  # as FLASH_ATTN_MLA's builder schedules a call
        return get_scheduler_metadata(batch_size=batch, max_seqlen_q=max_q, max_seqlen_k=max_k, num_heads_q=heads,
                                      num_heads_kv=1, headdim=ROPE, cache_seqlens=lens, qkv_dtype=q.dtype,
                                      headdim_v=LATENT, page_size=BLOCK, cu_seqlens_q=cu, causal=causal,
                                      num_splits=splits)

    dense = schedule(n, 1, P + own_max, whole_lens, cu_n, True, GRAPH_SPLITS)
    out_fa3_graph = torch.empty_like(out_fa3)

    def fa3_graph():
        return fa(q=q, k=cache, v=values, out=out_fa3_graph, cu_seqlens_q=cu_n, max_seqlen_q=1, seqused_k=whole_lens,
                  max_seqlen_k=P + own_max, block_table=tables, softmax_scale=SCALE, causal=True, fa_version=3,
                  scheduler_metadata=dense, num_splits=GRAPH_SPLITS)

    side = torch.cuda.Stream(dev)

    def graph_plan(ctx_splits):
        level_call = dict(plan.shared[0].call, num_splits=GRAPH_SPLITS,
                          scheduler_metadata=schedule(1, n, P, sys_lens, plan.shared[0].call["cu_seqlens_q"], False,
                                                      GRAPH_SPLITS))
        context = dict(plan.context, num_splits=ctx_splits,
                       scheduler_metadata=schedule(n, 1, own_max, own_lens, cu_n, True, ctx_splits))
        return RelayPlan(context=context, level_stream=side,
                         shared=[SharedLevel(perm=rows, row_index=rows.clone(), call=level_call)])

    graph_plans = {GRAPH_SPLITS: graph_plan(GRAPH_SPLITS), 1: graph_plan(1)}
    out_graph = {k: torch.empty_like(out_relay_fa3) for k in graph_plans}

    def relay_graph(ctx_splits):
        return lambda: relay_attention(q, cache, values, graph_plans[ctx_splits], out_graph[ctx_splits], SCALE, fa,
                                       attn_kwargs={"fa_version": 3})

    return dict(flashmla=flashmla, relay=relay, level=level, fa3=fa3, relay_fa3=relay_fa3, fa3_graph=fa3_graph,
                relay_fa3_graph=relay_graph(GRAPH_SPLITS), relay_fa3_ctx1=relay_graph(1))


FA3_WAYS = ("fa3", "relay_fa3")
GRAPH_WAYS = ("fa3_graph", "relay_fa3_graph", "relay_fa3_ctx1")  # FA3 as full graphs run it


def check(heads: int) -> dict:
    """Each way against the fp32 reference on a small step: its largest error, or why it failed (a string)."""
    q, latent, prompt, own_tables, own, tables = case(heads, n=5, P=4 * BLOCK, c=100, seed=1)
    ref = reference(q, latent, tables, torch.tensor([4 * BLOCK + o for o in own]))
    fns = ops(q, latent, prompt, own_tables, own, tables, 4 * BLOCK)
    errors = {}
    for k in ("flashmla", "relay", *FA3_WAYS, *GRAPH_WAYS):
        try:
            out = fns[k]()
            torch.cuda.synchronize()
            errors[k] = (out.float() - ref).abs().max().item()
        except Exception as e:  # noqa: BLE001 - FA3's MLA form may refuse a shape: reported, the rest run
            if k not in FA3_WAYS + GRAPH_WAYS:
                raise
            errors[k] = f"{type(e).__name__}: {e}"
    return errors


def point(name, heads, n, P, c, card, rep, fa3: bool = True, graph: bool = True) -> dict:
    """One timed point: the ways checked against FlashMLA's, then timed, with their bounds (`fa3`: FA3's
    MLA form too, `graph`: as full graphs run it; without, their columns stay empty)."""
    q, latent, prompt, own_tables, own, tables = case(heads, n, P, c)
    fns = ops(q, latent, prompt, own_tables, own, tables, P)
    left_out = (FA3_WAYS if not fa3 else ()) + (GRAPH_WAYS if not (fa3 and graph) else ())
    fns = {k: fn for k, fn in fns.items() if k not in left_out}
    out_whole = fns["flashmla"]()
    diff = max((out_whole.float() - fns[k]().float()).abs().max().item()
               for k in ("relay", *FA3_WAYS, *GRAPH_WAYS) if k in fns)
    t = {k: graph_ms(fn, rep, eager_fallback=k in FA3_WAYS + GRAPH_WAYS)[0] for k, fn in fns.items()}
    cost = step_cost(heads, P, own)
    fa3_cols = dict(fa3_us=t["fa3"] * 1e3, relay_fa3_us=t["relay_fa3"] * 1e3,
                    fa3_over_relay_fa3=t["fa3"] / t["relay_fa3"]) if fa3 else {}
    if "fa3_graph" in t:
        fa3_cols.update(fa3_graph_us=t["fa3_graph"] * 1e3, relay_fa3_graph_us=t["relay_fa3_graph"] * 1e3,
                        relay_fa3_ctx1_us=t["relay_fa3_ctx1"] * 1e3,
                        fa3_graph_over_relay_fa3_graph=t["fa3_graph"] / t["relay_fa3_graph"])
    return dict(shape=name, heads=heads, n=n, P=P, c=c, flashmla_us=t["flashmla"] * 1e3, relay_us=t["relay"] * 1e3,
                level_us=t["level"] * 1e3, flashmla_over_relay=t["flashmla"] / t["relay"], **fa3_cols,
                flashmla_bound_us=bound_ms(cost["flashmla_bytes"], cost["flops"], card) * 1e3,
                relay_bound_us=bound_ms(cost["relay_bytes"], cost["flops"], card) * 1e3,
                relay_tflops=cost["flops"] / t["relay"] / 1e9, flashmla_gbs=cost["flashmla_bytes"] / t["flashmla"] / 1e6,
                max_abs_diff=diff, **cost)


def main():
    args = kernel_args(__doc__, "fewer points")
    if not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9:
        sys.exit("bench_mla.py needs a Hopper GPU (FlashMLA's dense decode)")
    card = measure_card()
    rows = []
    for name, heads in HEADS.items():
        if args.quick and heads == 64:
            continue
        errors = check(heads)
        if not max(errors["flashmla"], errors["relay"]) < 3e-2:
            sys.exit(f"ABORT: {name}: FlashMLA or relay's split over it differs from the fp32 reference: {errors}")
        fa3 = all(isinstance(errors[k], float) and errors[k] < 3e-2 for k in FA3_WAYS)
        graph = all(isinstance(errors[k], float) and errors[k] < 3e-2 for k in GRAPH_WAYS)
        if not (fa3 and graph):
            print(f"{name}: FlashAttention-3's MLA form left out{' as graphs run it' if fa3 else ''} "
                  f"(its check: {errors})", flush=True)
        for P in (4096, 16000):
            for n in ((8, 64, 256) if args.quick else (8, 16, 64, 256, 1024)):
                try:
                    rows.append(point(name, heads, n, P, 256, card, args.rep, fa3, graph))
                except Exception as e:  # noqa: BLE001 - a point FlashMLA refuses is reported, the rest run
                    rows.append(dict(shape=name, heads=heads, n=n, P=P, error=f"{type(e).__name__}: {e}"))
                r = rows[-1]
                print(f"{name} n={n:5d} P={P:5d}: " + (r.get("error") or
                      f"flashmla {r['flashmla_us']:8.1f} us (bound {r['flashmla_bound_us']:7.1f})  relay "
                      f"{r['relay_us']:8.1f} us (bound {r['relay_bound_us']:7.1f}; its level {r['level_us']:.1f})"
                      f"  flashmla/relay {r['flashmla_over_relay']:.2f}x" + (
                          f"  fa3 {r['fa3_us']:8.1f} us  relay_fa3 {r['relay_fa3_us']:8.1f} us  fa3/relay_fa3 "
                          f"{r['fa3_over_relay_fa3']:.2f}x" if "fa3_us" in r else "") + (
                          f"; as graphs: fa3 {r['fa3_graph_us']:.1f} us  relay_fa3 {r['relay_fa3_graph_us']:.1f} us "
                          f"(context unsplit {r['relay_fa3_ctx1_us']:.1f})" if "fa3_graph_us" in r else "")),
                      flush=True)
                torch.cuda.empty_cache()
                write(args.out, card, rows)  # each point as it comes: a fault in a later one keeps these
    with open(os.path.join(args.out, "mla_ops.md")) as f:
        print(f.read())


def _row(r: dict) -> str:
    """One point's line of mla_ops.md (FA3's columns empty where its form was left out)."""
    head = f"| {r['shape']} | {r['heads']} | {r['P']} | {r['n']} | "
    if "error" in r:
        return head + f"{r['error']} |"
    fa3 = (f"{r['fa3_us']:.1f} | {r['relay_fa3_us']:.1f} | {r['fa3_over_relay_fa3']:.2f}x" if "fa3_us" in r
           else " | | ")
    fa3 += (f" | {r['fa3_graph_us']:.1f} | {r['relay_fa3_graph_us']:.1f} | {r['relay_fa3_ctx1_us']:.1f} | "
            f"{r['fa3_graph_over_relay_fa3_graph']:.2f}x" if "fa3_graph_us" in r else " | | | | ")
    return (head + f"{r['flashmla_us']:.1f} | {r['flashmla_bound_us']:.1f} | {r['relay_us']:.1f} | "
            f"{r['relay_bound_us']:.1f} | {r['flashmla_over_relay']:.2f}x | {r['relay_tflops']:.0f} | "
            f"{r['flashmla_gbs']:.0f} | {fa3} | {r['max_abs_diff']:.3g} |")


def write(out: str, card: dict, rows: list[dict]) -> None:
    """mla_ops.json and mla_ops.md under `out`."""
    lines = [f"# MLA decode step over a shared prompt: {card['device']}", "",
             f"bf16, 64-token pages, own tokens 1..256 a request; copy {card['copy_bytes_per_s'] / 1e12:.2f} TB/s, "
             f"bf16 matmul {card['bf16_flop_per_s'] / 1e12:.0f} TFLOP/s; medians of CUDA-graph replays, L2 flushed. "
             "Bounds: bytes at the copy rate or FLOPs at the matmul rate, the larger.", "",
             "| shape | heads | P | n | FlashMLA us | bound | relay us | bound | FlashMLA/relay | relay TFLOP/s "
             "| FlashMLA GB/s | FA3 us | relay FA3 us | FA3/relay FA3 | FA3 as a graph runs it (splits capped at "
             f"{GRAPH_SPLITS}) us | relay FA3 so | the same, its context unsplit | FA3/relay FA3 so | max diff |",
             "|---|" + "---|" * 18]
    lines += [_row(r) for r in rows]
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "mla_ops.json"), "w") as f:
        json.dump(dict(card=card, rows=rows), f, indent=1)
    with open(os.path.join(out, "mla_ops.md"), "w") as f:
        f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
