"""Decomposition property: relay attention == plain causal attention over [shared K/V ; own K/V].

System prompts live in pages of the same paged cache as the requests' own KV. Each relay request
takes the prefix path (its context call reads [slot pages ; own pages]) or the shared path (its
own pages, plus one grouped call per slot, merged by LSE); both must equal the dense reference.
"""

import numpy as np
import pytest
import torch

from tests.ops.reference import DTYPES, assert_close, attention_ref, cu_seqlens, make_paged_cache
from vllm_relay.ops import (
    RelayPlan,
    SharedLevel,
    choose_shared,
    group_rows,
    prefix_block_table,
    relay_attention,
    varlen_attention_torch,
)

# (slot or -1, own context length incl. this step's tokens, query length): decode steps and
# prefill chunks of relay requests on two slots, mixed with plain requests.
MIXED_BATCH = [
    (0, 1, 1),      # relay decode, own context of one token
    (1, 300, 1),    # relay decode
    (-1, 15, 1),    # plain decode
    (0, 15, 7),     # relay chunked prefill: 8 own tokens cached, 7 new
    (-1, 33, 33),   # plain prefill
    (1, 20, 20),    # relay first prefill chunk (own tokens only; the system part is in its pages)
    (0, 16, 1),     # relay decode
    (1, 5, 1),      # relay decode
]


def build(batch, sys_pages, h_kv, group, d, block_size, dtype, device="cpu", levels=1):
    """Random inputs in one paged cache and the dense reference output of `batch`.

    `sys_pages[s]` is the page count of slot s at each level (levels > 1 stacks more shared
    levels, e.g. a document under the system prompt: its own pages, per slot).
    Returns (q, k_cache, v_cache), own (table, lens), slot_pages per level, scale, reference.
    """
    hq = h_kv * group
    q_lens = [ql for _, _, ql in batch]
    q = torch.randn(sum(q_lens), hq, d).to(dtype)
    ks = [torch.randn(cl, h_kv, d).to(dtype) for _, cl, _ in batch]
    vs = [torch.randn(cl, h_kv, d).to(dtype) for _, cl, _ in batch]
    shared = [[(torch.randn(n * block_size, h_kv, d).to(dtype), torch.randn(n * block_size, h_kv, d).to(dtype))
               for n in sys_pages] for _ in range(levels)]
    flat = [kv for level in shared for kv in level]
    k_cache, v_cache, table, lens = make_paged_cache(ks + [k for k, _ in flat], vs + [v for _, v in flat],
                                                     block_size, dtype)
    B, G = len(batch), len(sys_pages)
    # As vLLM's: wide enough for any request's prefix pages and own pages together.
    width = max(-(-cl // block_size) for _, cl, _ in batch) + levels * max(sys_pages)
    slot_pages = []
    for lvl in range(levels):
        rows = table[B + lvl * G: B + (lvl + 1) * G]
        slot_pages.append(rows[:, : max(sys_pages)].contiguous())
    scale = d ** -0.5
    ref = torch.zeros(q.shape)
    cu = cu_seqlens(q_lens)
    for b, (slot, _, _) in enumerate(batch):
        rows = slice(int(cu[b]), int(cu[b + 1]))
        k, v = ks[b], vs[b]
        if slot >= 0:  # the full sequence the request would have without relay
            k = torch.cat([shared[lvl][slot][0] for lvl in range(levels)] + [k])
            v = torch.cat([shared[lvl][slot][1] for lvl in range(levels)] + [v])
        ref[rows], _ = attention_ref(q[rows], k, v, scale, causal=True)
    own_table = torch.randint(0, table.shape[0], (B, width), dtype=torch.int32)  # stale entries
    own_table[:, : table.shape[1]] = table[:B]
    moved = [x.to(device) for x in (q, k_cache, v_cache)]
    return moved, (own_table.to(device), lens[:B].to(device)), [p.to(device) for p in slot_pages], scale, ref


def make_plan(batch, own, slot_pages, sys_pages, block_size, shared_mask, device="cpu"):
    """The plan a relay planner makes: prefix rows get every level's pages in front of their own;
    shared rows get one grouped call per level (their slot's pages), merged in level order."""
    table, lens = own
    req_slot = np.array([s for s, _, _ in batch], dtype=np.int32)
    q_lens = np.array([ql for _, _, ql in batch])
    pages_per_slot = np.array(sys_pages, dtype=np.int32)
    levels = len(slot_pages)
    prefix = (req_slot >= 0) & ~shared_mask
    ctx_table, ctx_lens = table.clone(), lens.clone()
    # Prefix rows: the levels' pages in order, then the request's own (one merged table per level).
    for lvl in reversed(range(levels)):
        pages = np.where(prefix, pages_per_slot[np.maximum(req_slot, 0)], 0).astype(np.int32)
        out_t, out_l = torch.empty_like(ctx_table), torch.empty_like(ctx_lens)
        prefix_block_table(ctx_table, ctx_lens, torch.from_numpy(pages).to(device),
                           torch.from_numpy(req_slot).to(device), slot_pages[lvl], block_size, out_t, out_l)
        ctx_table, ctx_lens = out_t, out_l
    token_group = np.repeat(np.where(shared_mask, req_slot, -1), q_lens)
    perm, cu, row_index = group_rows(token_group, len(sys_pages))
    group_lens = torch.tensor(pages_per_slot * block_size, dtype=torch.int32)
    shared = [] if not shared_mask.any() else [
        SharedLevel(perm=torch.from_numpy(perm).to(device), row_index=torch.from_numpy(row_index).to(device),
                    call=dict(cu_seqlens_q=torch.from_numpy(cu).to(device), seqused_k=group_lens.to(device),
                              max_seqlen_q=int(np.diff(cu).max()), max_seqlen_k=int(group_lens.max()),
                              block_table=slot_pages[lvl]))
        for lvl in range(levels)]
    context = dict(cu_seqlens_q=cu_seqlens(list(q_lens)).to(device), seqused_k=ctx_lens,
                   max_seqlen_q=int(q_lens.max()), max_seqlen_k=int(ctx_lens.max()), block_table=ctx_table)
    return RelayPlan(context=context, shared=shared)


MODES = {
    "all_prefix": lambda batch: np.zeros(len(batch), dtype=bool),
    "all_shared": lambda batch: np.array([s >= 0 for s, _, _ in batch]),
    "rule": lambda batch: choose_shared(np.array([s for s, _, _ in batch]),
                                        np.array([ql for _, _, ql in batch]), 2),
}


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("sys_pages", [(1, 63), (5, 2)], ids=["pages1_63", "pages5_2"])
@pytest.mark.parametrize("group", [1, 4, 8])
@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_relay_equals_attention_over_concatenated_kv(mode, sys_pages, group, block_size, dtype):
    (q, k_cache, v_cache), own, slot_pages, scale, ref = build(MIXED_BATCH, sys_pages, 2, group, 64,
                                                               block_size, dtype)
    plan = make_plan(MIXED_BATCH, own, slot_pages, sys_pages, block_size, MODES[mode](MIXED_BATCH))
    out = torch.full_like(q, float("nan"))
    got = relay_attention(q, k_cache, v_cache, plan, out, scale, varlen_attention_torch)
    assert got is out
    assert_close(out, ref, dtype)


@pytest.mark.parametrize("mode", ["all_prefix", "all_shared"])
def test_two_shared_levels(mode):
    """System prompt -> document -> own tokens: two shared levels merged in order (Hydragen-style)."""
    (q, k_cache, v_cache), own, slot_pages, scale, ref = build(MIXED_BATCH, (3, 2), 2, 4, 64, 16,
                                                               torch.float32, levels=2)
    plan = make_plan(MIXED_BATCH, own, slot_pages, (3, 2), 16, MODES[mode](MIXED_BATCH))
    assert len(plan.shared) == (2 if mode == "all_shared" else 0)
    out = torch.empty_like(q)
    relay_attention(q, k_cache, v_cache, plan, out, scale, varlen_attention_torch)
    assert_close(out, ref, torch.float32)


def test_long_prefill_chunk_and_odd_head_size():
    """T ~ 1000: a long relay prefill chunk next to decodes, D = 59."""
    batch = [(1, 900, 900), (0, 40, 1), (-1, 77, 60), (0, 300, 39), (0, 3, 1)]
    (q, k_cache, v_cache), own, slot_pages, scale, ref = build(batch, (62, 1), 1, 4, 59, 16, torch.bfloat16)
    plan = make_plan(batch, own, slot_pages, (62, 1), 16, MODES["rule"](batch))
    out = torch.empty_like(q)
    relay_attention(q, k_cache, v_cache, plan, out, scale, varlen_attention_torch)
    assert_close(out, ref, torch.bfloat16)


def test_torch_fusion_path(monkeypatch):
    """The CPU backend runs without TRITON_INTERPRET: relay_fusion falls back to torch."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    (q, k_cache, v_cache), own, slot_pages, scale, ref = build(MIXED_BATCH, (1, 63), 2, 4, 64, 16,
                                                               torch.float16)
    plan = make_plan(MIXED_BATCH, own, slot_pages, (1, 63), 16, MODES["all_shared"](MIXED_BATCH))
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
    plan = make_plan(MIXED_BATCH, own, slot_pages, (1, 63), 16, MODES["all_prefix"](MIXED_BATCH))
    attn = Recorder()
    out = torch.empty_like(q)
    assert relay_attention(q, k_cache, v_cache, plan, out, scale, attn) is out
    assert len(attn.calls) == 1
    assert attn.calls[0]["out"] is out and attn.calls[0]["return_softmax_lse"] is False
    assert_close(out, ref, torch.float32)


def test_forwards_attn_kwargs_buffers_and_scheduler_metadata():
    (q, k_cache, v_cache), own, slot_pages, scale, ref = build(MIXED_BATCH, (1, 63), 2, 1, 64, 16,
                                                               torch.float32)
    plan = make_plan(MIXED_BATCH, own, slot_pages, (1, 63), 16, MODES["all_shared"](MIXED_BATCH))
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
    """A CUDA-graph step: padded shared rows point at token 0, one slot has no tokens, padded
    requests have no KV; real tokens are still exact and nothing becomes NaN."""
    batch = MIXED_BATCH + [(-1, 0, 0), (-1, 0, 0)]  # two padding requests (no tokens, no KV)
    (q, k_cache, v_cache), own, slot_pages, scale, ref = build(batch, (1, 63, 4), 2, 4, 64, 16,
                                                               torch.float32)
    mask = np.array([s == 1 for s, _, _ in batch])  # only slot 1 shares; slots 0 and 2 are empty groups
    plan = make_plan(batch, own, slot_pages, (1, 63, 4), 16, mask)
    level = plan.shared[0]
    n = level.perm.shape[0]
    level.perm = torch.cat([level.perm, torch.zeros(5, dtype=torch.int32)])  # padded rows
    level.q_buf, level.out_buf = torch.empty(n + 5, *q.shape[1:]), torch.empty(n + 5, *q.shape[1:])
    level.call["max_seqlen_q"] = n + 5  # captured graphs use upper bounds
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
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("group", [1, 4])
def test_relay_attention_cuda_flash_attn(mode, dtype, group):
    flash_attn_varlen_func, fa_version = _fa()
    (q, k_cache, v_cache), own, slot_pages, scale, ref = build(MIXED_BATCH, (1, 63), 8 // group, group,
                                                               128, 16, dtype, device="cuda")
    plan = make_plan(MIXED_BATCH, own, slot_pages, (1, 63), 16, MODES[mode](MIXED_BATCH), device="cuda")
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
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_relay_attention_cuda_torch_attn(dtype):
    """Triton fusion on CUDA with the torch attention: no vLLM needed."""
    (q, k_cache, v_cache), own, slot_pages, scale, ref = build(MIXED_BATCH, (5, 2), 2, 4, 128, 32, dtype,
                                                               device="cuda")
    plan = make_plan(MIXED_BATCH, own, slot_pages, (5, 2), 32, MODES["all_shared"](MIXED_BATCH), device="cuda")
    out = torch.empty_like(q)
    relay_attention(q, k_cache, v_cache, plan, out, scale, varlen_attention_torch)
    assert_close(out, ref, dtype)
