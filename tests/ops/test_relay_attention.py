"""Decomposition property: relay attention == plain causal attention over [shared K/V ; own K/V].

System prompts live in pages of the same paged cache as the requests' own KV, and requests share
runs of their own pages as vLLM's prefix cache lays them out (a document under a system prompt,
the samples of one prompt, plain requests over a common prefix). The plan reads every shared run
as a level or in the context, by any rule: the result must equal the dense reference.
"""

import numpy as np
import pytest
import torch

from tests.ops.reference import (DTYPES, assert_close, attention_ref, cache_to, cu_seqlens, make_paged_cache,
                                 on_grid)
from vllm_relay.ops import RelayPlan, SharedLevel, prefix_block_table, relay_attention, varlen_attention_torch
from vllm_relay.ops.level_tree import LevelRule, find_levels, level_rows

# (slot or -1, own context length incl. this step's tokens, query length, parent row or -1, pages of
# the parent's own table it shares): decode steps and prefill chunks of relay requests on two
# slots, mixed with plain requests; below slot 1 a document (row 8) read by two more requests, one
# of them a sample sharing a page more; two plain decodes over a common prefix.
MIXED_BATCH = [
    (0, 1, 1, -1, 0),      # relay decode, own context of one token
    (1, 300, 1, -1, 0),    # relay decode
    (-1, 15, 1, -1, 0),    # plain decode
    (0, 15, 7, -1, 0),     # relay chunked prefill: 8 own tokens cached, 7 new
    (-1, 33, 33, -1, 0),   # plain prefill
    (1, 20, 20, -1, 0),    # relay first prefill chunk (own tokens only; the system part is in its pages)
    (0, 16, 1, -1, 0),     # relay decode
    (1, 5, 1, -1, 0),      # relay decode
    (1, 190, 1, 1, 9),     # relay decode over row 1's first pages (a document)
    (1, 170, 1, 8, 9),     # the same document
    (1, 200, 1, 8, 10),    # the same document and one more page of row 8 (a sibling sample)
    (-1, 64, 1, -1, 0),    # plain decode
    (1, 180, 12, 1, 9),    # relay prompt chunk over the document of row 1 (cached), 12 new tokens
    (-1, 70, 20, 11, 3),   # plain prompt chunk over the 3 pages of row 11 (a prefix-cache hit)
    (-1, 70, 1, 11, 3),    # plain decodes sharing row 11's first pages
    (-1, 99, 1, 11, 3),
]
RULES = {
    "none": None,  # every shared run in the context
    "permissive": LevelRule(min_rows_root=1, min_rows=2, max_depth=4),
    "measured_like": LevelRule(min_rows_root=2, min_rows=2, min_saved_pages=3, max_depth=2),
    "one_level": LevelRule(min_rows_root=3, min_rows=3, max_depth=1, max_groups=2),
}


FP8 = torch.float8_e4m3fn


def build(batch, sys_pages, h_kv, group, d, block_size, dtype, device="cpu", softcap=0.0, sinks=None,
          grid=None):
    """Random inputs in one paged cache and the dense reference output of `batch`.

    `grid` (q, k, v scales, powers of two): every query, key and value on the FP8 grid of its scale,
    so a cache of K / k_scale and V / v_scale in FP8 (and queries of q / q_scale) hold them exactly.

    A row with a parent holds the parent's page ids for its first shared pages (at most the whole
    pages before either one's query); its own copies of those pages are overwritten with garbage,
    so a plan that read them would be wrong. Returns (q, k_cache, v_cache), own (table, lens),
    slot_pages, scale, reference.
    """
    hq = h_kv * group
    q_lens = [row[2] for row in batch]
    snap = (lambda x, i: x) if grid is None else (lambda x, i: on_grid(x, grid[i]).to(x.dtype))  # noqa: E731
    q = snap(torch.randn(sum(q_lens), hq, d).to(dtype), 0)
    ks = [snap(torch.randn(cl, h_kv, d).to(dtype), 1) for _, cl, _, _, _ in batch]
    vs = [snap(torch.randn(cl, h_kv, d).to(dtype), 2) for _, cl, _, _, _ in batch]
    shared_pages = []
    for r, (_, cl, ql, parent, pages) in enumerate(batch):
        if parent >= 0:
            pages = min(pages, (cl - ql) // block_size, (batch[parent][1] - batch[parent][2]) // block_size)
            n = pages * block_size
            ks[r][:n], vs[r][:n] = ks[parent][:n], vs[parent][:n]
        shared_pages.append(max(pages, 0) if parent >= 0 else 0)
    sys_kv = [(snap(torch.randn(n * block_size, h_kv, d).to(dtype), 1),
               snap(torch.randn(n * block_size, h_kv, d).to(dtype), 2)) for n in sys_pages]
    k_cache, v_cache, table, lens = make_paged_cache(ks + [k for k, _ in sys_kv], vs + [v for _, v in sys_kv],
                                                     block_size, dtype)
    B = len(batch)
    for r, (_, _, _, parent, _) in enumerate(batch):
        n = shared_pages[r]
        if n:
            k_cache[table[r, :n].long()] = torch.randn_like(k_cache[table[r, :n].long()])  # never read
            table[r, :n] = table[parent, :n]
    # As vLLM's: wide enough for any request's prefix pages and own pages together.
    width = max(-(-row[1] // block_size) for row in batch) + max(sys_pages)
    slot_pages = table[B:, : max(sys_pages)].contiguous()
    scale = d ** -0.5
    ref = torch.zeros(q.shape)
    cu = cu_seqlens(q_lens)
    for b, (slot, _, _, _, _) in enumerate(batch):
        rows = slice(int(cu[b]), int(cu[b + 1]))
        k, v = ks[b], vs[b]
        if slot >= 0:  # the full sequence the request would have without relay
            k, v = torch.cat([sys_kv[slot][0], k]), torch.cat([sys_kv[slot][1], v])
        ref[rows], _ = attention_ref(q[rows], k, v, scale, causal=True, softcap=softcap, sinks=sinks)
    own_table = torch.randint(0, table.shape[0], (B, width), dtype=torch.int32)  # stale entries
    own_table[:, : table.shape[1]] = table[:B]
    moved = [q.to(device), *cache_to(k_cache, v_cache, device)]
    return moved, (own_table.to(device), lens[:B].to(device)), slot_pages.to(device), scale, ref


def make_plan(batch, own, slot_pages, sys_pages, block_size, rule, device="cpu"):
    """The plan a relay planner makes: the levels `rule` finds in the rows' tables (the whole pages
    before each row's first query token), each read by one grouped call for all the query tokens
    of its rows; every request's context is its pages past its levels, with its slot's pages in
    front when no level read them (the prefix path)."""
    table, lens = own
    root = np.array([row[0] for row in batch], dtype=np.int32)
    q_lens = np.array([row[2] for row in batch])
    own_lens = lens.cpu().numpy()
    root_pages = np.array(sys_pages, dtype=np.int32)
    front = np.where(root >= 0, root_pages[np.maximum(root, 0)], 0).astype(np.int32)
    skip = np.zeros(len(batch), dtype=np.int32)
    shared = []
    if rule is not None:
        shareable = (own_lens - q_lens) // block_size
        tree = find_levels(table.cpu().numpy(), shareable, root, root_pages, rule)
        front = tree.row_front.astype(np.int32)
        skip = tree.row_skip
        if tree.num_groups:
            perm, cu, row_index = level_rows(tree, cu_seqlens(list(q_lens))[:-1].numpy(), int(q_lens.sum()), q_lens)
            G = tree.num_groups
            level_table = torch.zeros(G, table.shape[1], dtype=torch.int32, device=device)
            t = lambda x: torch.from_numpy(np.ascontiguousarray(x, dtype=np.int32)).to(device)  # noqa: E731
            prefix_block_table(table, t((tree.start + tree.pages) * block_size), t(tree.front), t(tree.slot),
                               slot_pages, block_size, level_table, torch.zeros(G, dtype=torch.int32, device=device),
                               src_row=t(tree.row), start=t(tree.start))
            group_lens = (tree.front + tree.pages) * block_size
            shared = [SharedLevel(perm=t(perm), row_index=t(row_index),
                                  call=dict(cu_seqlens_q=t(cu), seqused_k=t(group_lens),
                                            max_seqlen_q=int(np.diff(cu).max()), max_seqlen_k=int(group_lens.max()),
                                            block_table=level_table))]
    ctx_table, ctx_lens = torch.empty_like(table), torch.empty_like(lens)
    prefix_block_table(table, lens, torch.from_numpy(front).to(device), torch.from_numpy(root).to(device),
                       slot_pages, block_size, ctx_table, ctx_lens, start=torch.from_numpy(skip).to(device))
    context = dict(cu_seqlens_q=cu_seqlens(list(q_lens)).to(device), seqused_k=ctx_lens,
                   max_seqlen_q=int(q_lens.max()), max_seqlen_k=int(ctx_lens.max()), block_table=ctx_table)
    return RelayPlan(context=context, shared=shared)


@pytest.mark.parametrize("rule", RULES)
@pytest.mark.parametrize("sys_pages", [(1, 63), (5, 2)], ids=["pages1_63", "pages5_2"])
@pytest.mark.parametrize("group", [1, 4, 8])
@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_relay_equals_attention_over_concatenated_kv(rule, sys_pages, group, block_size, dtype):
    (q, k_cache, v_cache), own, slot_pages, scale, ref = build(MIXED_BATCH, sys_pages, 2, group, 64,
                                                               block_size, dtype)
    plan = make_plan(MIXED_BATCH, own, slot_pages, sys_pages, block_size, RULES[rule])
    if rule == "permissive" and block_size == 16:  # slot 1 -> document -> sample: three levels
        levels = (plan.shared[0].row_index >= 0).sum(dim=0)
        assert levels.max() == 3
        # The prompt chunks read their cached shared pages as levels too, every one of their tokens.
        first = cu_seqlens([row[2] for row in MIXED_BATCH])
        assert (levels[first[12]: first[13]] == 2).all() and (levels[first[13]: first[14]] == 1).all()
    out = torch.full_like(q, float("nan"))
    got = relay_attention(q, k_cache, v_cache, plan, out, scale, varlen_attention_torch)
    assert got is out
    assert_close(out, ref, dtype)


@pytest.mark.parametrize("seed", range(6))
def test_random_trees_of_sharing(seed):
    """Random batches whose rows copy random prefixes of earlier rows' pages, any depth."""
    rng = np.random.default_rng(seed)
    batch = []
    for r in range(int(rng.integers(1, 24))):
        q_len = 1 if rng.random() < 0.8 else int(rng.integers(2, 30))
        own = q_len + int(rng.integers(0, 200))
        parent = int(rng.integers(0, r)) if r and rng.random() < 0.7 else -1
        slot = batch[parent][0] if parent >= 0 else int(rng.integers(-1, 2))
        batch.append((slot, own, q_len, parent, int(rng.integers(1, 14))))
    (q, k_cache, v_cache), own, slot_pages, scale, ref = build(batch, (2, 3), 2, 4, 32, 16, torch.float32)
    plan = make_plan(batch, own, slot_pages, (2, 3), 16, RULES["permissive"])
    out = torch.full_like(q, float("nan"))
    relay_attention(q, k_cache, v_cache, plan, out, scale, varlen_attention_torch)
    assert_close(out, ref, torch.float32)


@pytest.mark.parametrize("rule", ["permissive", "one_level"])
def test_softcap_and_sinks(rule):
    """Soft-capping in every call, sinks in the context call only (its LSE carries them into the
    merge): the dense attention with both, over the mixed batch's levels up to three deep."""
    sinks = torch.linspace(0.5, 4.0, 8)
    (q, k_cache, v_cache), own, slot_pages, scale, ref = build(MIXED_BATCH, (1, 63), 2, 4, 64, 16, torch.float32,
                                                               softcap=2.0, sinks=sinks)
    plan = make_plan(MIXED_BATCH, own, slot_pages, (1, 63), 16, RULES[rule])
    assert plan.shared
    out = torch.empty_like(q)
    relay_attention(q, k_cache, v_cache, plan, out, scale, varlen_attention_torch, {"softcap": 2.0},
                    {"s_aux": sinks})
    assert_close(out, ref, torch.float32)
    plain = torch.empty_like(q)  # the same without them: far from it (they matter on these inputs)
    relay_attention(q, k_cache, v_cache, plan, plain, scale, varlen_attention_torch)
    assert (plain - ref).abs().max() > 0.05


def test_long_prefill_chunk_and_odd_head_size():
    """T ~ 1000: a long relay prefill chunk next to decodes, D = 59."""
    batch = [(1, 900, 900, -1, 0), (0, 40, 1, -1, 0), (-1, 77, 60, -1, 0), (0, 300, 39, -1, 0), (0, 3, 1, -1, 0),
             (0, 290, 1, 3, 30)]
    (q, k_cache, v_cache), own, slot_pages, scale, ref = build(batch, (62, 1), 1, 4, 59, 16, torch.bfloat16)
    plan = make_plan(batch, own, slot_pages, (62, 1), 16, RULES["measured_like"])
    out = torch.empty_like(q)
    relay_attention(q, k_cache, v_cache, plan, out, scale, varlen_attention_torch)
    assert_close(out, ref, torch.bfloat16)


def test_torch_fusion_path(monkeypatch):
    """The CPU backend runs without TRITON_INTERPRET: relay_fusion falls back to torch."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    (q, k_cache, v_cache), own, slot_pages, scale, ref = build(MIXED_BATCH, (1, 63), 2, 4, 64, 16,
                                                               torch.float16)
    plan = make_plan(MIXED_BATCH, own, slot_pages, (1, 63), 16, RULES["permissive"])
    out = torch.empty_like(q)
    relay_attention(q, k_cache, v_cache, plan, out, scale, varlen_attention_torch)
    assert_close(out, ref, torch.float16)


class Recorder:
    def __init__(self):
        self.calls = []

    def __call__(self, **kwargs):
        self.calls.append(dict(kwargs))
        kwargs.pop("scheduler_metadata", None)
        return varlen_attention_torch(**kwargs)


def test_prefix_only_step_is_one_call_into_out():
    (q, k_cache, v_cache), own, slot_pages, scale, ref = build(MIXED_BATCH, (1, 63), 2, 4, 64, 16,
                                                               torch.float32)
    plan = make_plan(MIXED_BATCH, own, slot_pages, (1, 63), 16, RULES["none"])
    attn = Recorder()
    out = torch.empty_like(q)
    assert relay_attention(q, k_cache, v_cache, plan, out, scale, attn) is out
    assert len(attn.calls) == 1
    assert attn.calls[0]["out"] is out and attn.calls[0]["return_softmax_lse"] is False
    assert_close(out, ref, torch.float32)


def test_forwards_attn_kwargs_buffers_and_scheduler_metadata():
    (q, k_cache, v_cache), own, slot_pages, scale, ref = build(MIXED_BATCH, (1, 63), 2, 1, 64, 16,
                                                               torch.float32)
    plan = make_plan(MIXED_BATCH, own, slot_pages, (1, 63), 16, RULES["permissive"])
    plan.context["scheduler_metadata"] = torch.zeros(4, dtype=torch.int32)
    level = plan.shared[0]
    level.call["scheduler_metadata"] = torch.ones(4, dtype=torch.int32)
    n = level.perm.shape[0]
    level.q_buf, level.out_buf = torch.empty(n, *q.shape[1:]), torch.empty(n, *q.shape[1:])
    attn = Recorder()
    out = torch.empty_like(q)
    relay_attention(q, k_cache, v_cache, plan, out, scale, attn, attn_kwargs={"fa_version": 3})
    ctx_call, sys_call = attn.calls
    assert ctx_call["causal"] is True and ctx_call["return_softmax_lse"] is True and ctx_call["out"] is out
    assert ctx_call["scheduler_metadata"] is plan.context["scheduler_metadata"]
    assert sys_call["causal"] is False and sys_call["scheduler_metadata"] is level.call["scheduler_metadata"]
    assert sys_call["q"] is level.q_buf and sys_call["out"] is level.out_buf
    assert ctx_call["fa_version"] == sys_call["fa_version"] == 3
    assert_close(out, ref, torch.float32)


def test_padded_rows_and_empty_groups_are_harmless():
    """A CUDA-graph step: padded level rows point at token 0, trailing groups are empty, the
    fusion loops over more depths than any token has, padded requests have no KV; real tokens are
    still exact and nothing becomes NaN."""
    batch = MIXED_BATCH + [(-1, 0, 0, -1, 0), (-1, 0, 0, -1, 0)]  # two padding requests (no tokens, no KV)
    (q, k_cache, v_cache), own, slot_pages, scale, ref = build(batch, (1, 63, 4), 2, 4, 64, 16,
                                                               torch.float32)
    plan = make_plan(batch, own, slot_pages, (1, 63, 4), 16, RULES["measured_like"])
    level = plan.shared[0]
    n, G = level.perm.shape[0], level.call["seqused_k"].shape[0]
    level.perm = torch.cat([level.perm, torch.zeros(5, dtype=torch.int32)])  # padded rows
    level.row_index = torch.cat([level.row_index, torch.full((2, q.shape[0]), -1, dtype=torch.int32)])
    call = level.call
    call["cu_seqlens_q"] = torch.cat([call["cu_seqlens_q"], call["cu_seqlens_q"][-1:].repeat(3)])  # empty groups
    call["seqused_k"] = torch.cat([call["seqused_k"], torch.zeros(3, dtype=torch.int32)])
    call["block_table"] = torch.cat([call["block_table"], torch.zeros(3, call["block_table"].shape[1],
                                                                      dtype=torch.int32)])
    assert call["seqused_k"].shape[0] == G + 3
    level.q_buf, level.out_buf = torch.empty(n + 5, *q.shape[1:]), torch.empty(n + 5, *q.shape[1:])
    call["max_seqlen_q"] = n + 5  # captured graphs use upper bounds
    out = torch.empty_like(q)
    relay_attention(q, k_cache, v_cache, plan, out, scale, varlen_attention_torch)
    assert not out.isnan().any()
    assert_close(out, ref, torch.float32)


# ---------------------------------------------------------------------------------------------- GPU

def _fa():
    pytest.importorskip("vllm")
    from vllm.vllm_flash_attn import flash_attn_varlen_func

    try:
        from vllm.v1.attention.backends.fa_utils import get_flash_attn_version

        version = get_flash_attn_version() or 3
    except Exception:  # pragma: no cover - depends on the vLLM build
        version = 3
    return flash_attn_varlen_func, version


@pytest.mark.gpu
@pytest.mark.parametrize("rule", RULES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("group", [1, 4])
def test_relay_attention_cuda_flash_attn(rule, dtype, group):
    flash_attn_varlen_func, fa_version = _fa()
    (q, k_cache, v_cache), own, slot_pages, scale, ref = build(MIXED_BATCH, (1, 63), 8 // group, group,
                                                               128, 16, dtype, device="cuda")
    plan = make_plan(MIXED_BATCH, own, slot_pages, (1, 63), 16, RULES[rule], device="cuda")
    out = torch.full_like(q, float("nan"))
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")  # relay_attention must not synchronize with the host
    try:
        relay_attention(q, k_cache, v_cache, plan, out, scale, flash_attn_varlen_func,
                        attn_kwargs={"fa_version": fa_version})
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert_close(out, ref, dtype)


@pytest.mark.gpu
def test_relay_attention_cuda_flash_attn_softcap_and_sinks():
    """FlashAttention's soft-capping in every call and its sinks (`s_aux`) in the context call: its
    LSE must carry the sinks into the merge (the dense reference has them in every row's softmax)."""
    flash_attn_varlen_func, fa_version = _fa()
    sinks = torch.linspace(0.5, 4.0, 8)  # exact in bf16
    (q, k_cache, v_cache), own, slot_pages, scale, ref = build(MIXED_BATCH, (1, 63), 2, 4, 128, 16,
                                                               torch.bfloat16, device="cuda", softcap=2.0,
                                                               sinks=sinks)
    plan = make_plan(MIXED_BATCH, own, slot_pages, (1, 63), 16, RULES["permissive"], device="cuda")
    out = torch.full_like(q, float("nan"))
    relay_attention(q, k_cache, v_cache, plan, out, scale, flash_attn_varlen_func,
                    attn_kwargs={"fa_version": fa_version, "softcap": 2.0},
                    context_kwargs={"s_aux": sinks.to("cuda", torch.bfloat16)})  # FA3 takes bf16 only
    assert_close(out, ref, torch.bfloat16)


@pytest.mark.gpu
@pytest.mark.parametrize("rule", ["permissive", "one_level"])
def test_relay_attention_cuda_flash_attn_fp8(rule):
    """FlashAttention-3 over an FP8 cache with FP8 queries (as vLLM quantizes them), each call with
    its scales expanded to its own sequences, against the dense reference of the values the FP8
    tensors hold. FA3's FP8 path also rounds the softmax probabilities to FP8 before P @ V, so the
    yardstick is FA3's own error: one call over each request's whole sequence (the plan with no
    levels), on the same FP8 inputs."""
    flash_attn_varlen_func, fa_version = _fa()
    grid = (0.5, 0.25, 2.0)
    (q, k_cache, v_cache), own, slot_pages, scale, ref = build(MIXED_BATCH, (1, 63), 2, 4, 128, 16,
                                                               torch.bfloat16, device="cuda", grid=grid)
    q8, k8, v8 = ((x.float() / g).to(FP8) for x, g in zip((q, k_cache, v_cache), grid))
    descale = tuple(torch.tensor([g], device="cuda") for g in grid)
    outs = {}
    for name, plan_rule in (("relay", RULES[rule]), ("flash", None)):
        plan = make_plan(MIXED_BATCH, own, slot_pages, (1, 63), 16, plan_rule, device="cuda")
        assert bool(plan.shared) == (name == "relay")
        outs[name] = torch.full(q.shape, float("nan"), dtype=torch.bfloat16, device="cuda")
        relay_attention(q8, k8, v8, plan, outs[name], scale, flash_attn_varlen_func,
                        attn_kwargs={"fa_version": fa_version}, descale=descale)
    err, flash_err = ((outs[n].float().cpu() - ref).abs().max().item() for n in ("relay", "flash"))
    print(f"FP8 {rule}: relay max error {err:.4g}, FlashAttention's one call {flash_err:.4g}")
    assert not outs["relay"].isnan().any()
    assert err <= 2 * flash_err, (err, flash_err)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_relay_attention_cuda_torch_attn(dtype):
    """Triton fusion on CUDA with the torch attention: no vLLM needed."""
    (q, k_cache, v_cache), own, slot_pages, scale, ref = build(MIXED_BATCH, (5, 2), 2, 4, 128, 32, dtype,
                                                               device="cuda")
    plan = make_plan(MIXED_BATCH, own, slot_pages, (5, 2), 32, RULES["permissive"], device="cuda")
    out = torch.empty_like(q)
    relay_attention(q, k_cache, v_cache, plan, out, scale, varlen_attention_torch)
    assert_close(out, ref, dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("rule", ["permissive", "measured_like"])
def test_levels_on_a_second_stream_eager_and_in_a_graph(rule):
    """The levels on `RelayPlan.level_stream`, concurrent with the context call: eagerly, and captured
    in a CUDA graph (the fork and join as graph edges; the levels' buffers allocated in the capture)
    replayed on queries written after the capture. Same kernels on the same inputs: the output equals
    the one-stream call's bit for bit (a missing wait would show here), and the fp32 reference."""
    flash_attn_varlen_func, fa_version = _fa()
    dtype = torch.bfloat16
    (q, k_cache, v_cache), own, slot_pages, scale, ref = build(MIXED_BATCH, (1, 63), 8, 1, 128, 16, dtype,
                                                               device="cuda")
    plan = make_plan(MIXED_BATCH, own, slot_pages, (1, 63), 16, RULES[rule], device="cuda")
    assert plan.shared
    kwargs = {"fa_version": fa_version}
    one_stream = relay_attention(q, k_cache, v_cache, plan, torch.empty_like(q), scale, flash_attn_varlen_func,
                                 attn_kwargs=kwargs)
    plan.level_stream = torch.cuda.Stream(priority=-1)
    out = torch.full_like(q, float("nan"))
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        relay_attention(q, k_cache, v_cache, plan, out, scale, flash_attn_varlen_func, attn_kwargs=kwargs)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert torch.equal(out, one_stream)
    assert_close(out, ref, dtype)

    q_static, out_static = torch.zeros_like(q), torch.full_like(q, float("nan"))
    relay_attention(q_static, k_cache, v_cache, plan, out_static, scale, flash_attn_varlen_func, attn_kwargs=kwargs)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        relay_attention(q_static, k_cache, v_cache, plan, out_static, scale, flash_attn_varlen_func,
                        attn_kwargs=kwargs)
    out_static.fill_(float("nan"))
    q_static.copy_(q)
    graph.replay()
    assert torch.equal(out_static, one_stream)
    assert_close(out_static, ref, dtype)


@pytest.mark.parametrize("rule", ["permissive", "one_level"])
def test_fp8_cache_scales_reach_every_call(rule):
    """An FP8 cache read with its per-tensor scales (`descale`), expanded for each call: the context
    call and the levels' grouped call have different numbers of sequences."""
    grid = (1.0, 0.5, 2.0)
    (q, k_cache, v_cache), own, slot_pages, scale, ref = build(MIXED_BATCH, (1, 63), 2, 4, 64, 16, torch.float32,
                                                               grid=grid)
    plan = make_plan(MIXED_BATCH, own, slot_pages, (1, 63), 16, RULES[rule])
    assert plan.shared and plan.shared[0].call["cu_seqlens_q"].shape != plan.context["cu_seqlens_q"].shape
    k8, v8 = (k_cache / grid[1]).to(FP8), (v_cache / grid[2]).to(FP8)  # exact: the values are on the grid
    out = torch.empty_like(q)
    relay_attention(q, k8, v8, plan, out, scale, varlen_attention_torch,
                    descale=(None, torch.tensor([grid[1]]), torch.tensor([grid[2]])))
    assert_close(out, ref, torch.float32)


def test_joint_plan_refuses_context_only_keywords():
    """Sinks belong to one partial: a joint call (levels and context in one) cannot take them."""
    level = SharedLevel(perm=torch.zeros(1, dtype=torch.int32), row_index=torch.zeros(1, dtype=torch.int32),
                        call={}, ctx_start=torch.zeros(1, dtype=torch.int32))
    q = torch.randn(1, 2, 8)
    with pytest.raises(ValueError, match="joint plan"):
        relay_attention(q, q, q, RelayPlan(context={}, shared=[level]), torch.empty_like(q), 1.0,
                        varlen_attention_torch, None, {"s_aux": torch.zeros(2)})
