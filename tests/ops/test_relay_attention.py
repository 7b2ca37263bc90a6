"""Decomposition property: relay attention == plain causal attention over [system K/V ; own K/V]."""

import pytest
import torch

from tests.ops.reference import (
    DTYPES,
    assert_close,
    attention_ref,
    cu_seqlens,
    make_paged_cache,
    make_system_buffers,
)
from vllm_relay.ops import RelayPlan, plan_system_attention, relay_attention, varlen_attention_torch

S_MAX = 1024

# (slot or -1, own context length incl. this step's tokens, query length): decode steps and
# prefill chunks of relay requests on two slots, mixed with plain (untagged) requests.
MIXED_BATCH = [
    (0, 1, 1),      # relay decode, own context of one token
    (1, 300, 1),    # relay decode
    (-1, 15, 1),    # plain decode
    (0, 15, 7),     # relay chunked prefill: 8 own tokens cached, 7 new
    (-1, 33, 33),   # plain prefill
    (1, 20, 20),    # relay first prefill chunk (own tokens only; the system part is in the buffer)
    (0, 16, 1),     # relay decode
]


def build(batch, sys_lens, h_kv, group, d, block_size, dtype, device="cpu"):
    """Random inputs, the relay plan, and the dense reference output of `batch`."""
    hq = h_kv * group
    q_lens = [ql for _, _, ql in batch]
    q = torch.randn(sum(q_lens), hq, d).to(dtype)
    ks = [torch.randn(cl, h_kv, d).to(dtype) for _, cl, _ in batch]
    vs = [torch.randn(cl, h_kv, d).to(dtype) for _, cl, _ in batch]
    k_cache, v_cache, table, ctx_lens = make_paged_cache(ks, vs, block_size, dtype)
    k_sys, v_sys, valid = make_system_buffers(list(sys_lens), S_MAX, h_kv, d, dtype)
    scale = d ** -0.5

    ref = torch.zeros(q.shape)
    cu = cu_seqlens(q_lens)
    for b, (slot, _, _) in enumerate(batch):
        rows = slice(int(cu[b]), int(cu[b + 1]))
        k, v = ks[b], vs[b]
        if slot >= 0:  # the full sequence the request would have without relay
            k, v = torch.cat([valid[slot][0], k]), torch.cat([valid[slot][1], v])
        ref[rows], _ = attention_ref(q[rows], k, v, scale, causal=True)

    token_slot = torch.cat([torch.full((ql,), slot, dtype=torch.int32) for slot, _, ql in batch])
    plan = RelayPlan(
        cu_seqlens_q=cu.to(device), seqused_k=ctx_lens.to(device), max_seqlen_q=max(q_lens),
        max_seqlen_k=int(ctx_lens.max()), block_table=table.to(device),
        system=plan_system_attention(token_slot, list(sys_lens), S_MAX, block_size, device),
    )
    tensors = [x.to(device) for x in (q, k_cache, v_cache, k_sys, v_sys)]
    return tensors, plan, scale, ref


@pytest.mark.parametrize("sys_lens", [(17, 1000), (1, 300)], ids=["sys17_1000", "sys1_300"])
@pytest.mark.parametrize("group", [1, 4, 8])
@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_relay_equals_attention_over_concatenated_kv(sys_lens, group, block_size, dtype):
    (q, k_cache, v_cache, k_sys, v_sys), plan, scale, ref = build(MIXED_BATCH, sys_lens, 2, group, 64,
                                                                 block_size, dtype)
    out = torch.full_like(q, float("nan"))
    got = relay_attention(q, k_cache, v_cache, k_sys, v_sys, plan, out, scale, varlen_attention_torch)
    assert got is out
    assert_close(out, ref, dtype)


def test_long_prefill_chunk_and_odd_head_size():
    """T ~ 1000: a long relay prefill chunk next to decodes, D = 59."""
    batch = [(1, 900, 900), (0, 40, 1), (-1, 77, 60), (0, 300, 39)]
    (q, k_cache, v_cache, k_sys, v_sys), plan, scale, ref = build(batch, (1000, 17), 1, 4, 59, 16,
                                                                 torch.bfloat16)
    out = torch.empty_like(q)
    relay_attention(q, k_cache, v_cache, k_sys, v_sys, plan, out, scale, varlen_attention_torch)
    assert_close(out, ref, torch.bfloat16)


def test_torch_fusion_path(monkeypatch):
    """The CPU backend runs without TRITON_INTERPRET: relay_fusion falls back to torch."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    (q, k_cache, v_cache, k_sys, v_sys), plan, scale, ref = build(MIXED_BATCH, (17, 1000), 2, 4, 64, 16,
                                                                 torch.float16)
    out = torch.empty_like(q)
    relay_attention(q, k_cache, v_cache, k_sys, v_sys, plan, out, scale, varlen_attention_torch)
    assert_close(out, ref, torch.float16)


class Recorder:
    def __init__(self):
        self.calls = []

    def __call__(self, **kwargs):
        self.calls.append(dict(kwargs))
        kwargs.pop("scheduler_metadata", None)
        return varlen_attention_torch(**kwargs)


@pytest.mark.parametrize("no_system", ["none", "no_tagged_tokens"])
def test_without_system_work_writes_out_in_one_call(no_system):
    batch = [(-1, 15, 1), (-1, 33, 33)] if no_system == "no_tagged_tokens" else [(-1, 15, 1)]
    (q, k_cache, v_cache, _, _), plan, scale, ref = build(batch, (17,), 2, 4, 64, 16, torch.float32)
    if no_system == "none":
        plan.system = None
    attn = Recorder()
    out = torch.empty_like(q)
    got = relay_attention(q, k_cache, v_cache, None, None, plan, out, scale, attn)
    assert got is out and len(attn.calls) == 1
    assert attn.calls[0]["out"] is out and attn.calls[0]["return_softmax_lse"] is False
    assert_close(out, ref, torch.float32)


def test_forwards_attn_kwargs_and_scheduler_metadata():
    (q, k_cache, v_cache, k_sys, v_sys), plan, scale, ref = build(MIXED_BATCH, (17, 1000), 2, 1, 64, 16,
                                                                 torch.float32)
    plan.scheduler_metadata = torch.zeros(4, dtype=torch.int32)
    plan.system.scheduler_metadata = torch.ones(4, dtype=torch.int32)
    attn = Recorder()
    out = torch.empty_like(q)
    relay_attention(q, k_cache, v_cache, k_sys, v_sys, plan, out, scale, attn,
                    attn_kwargs={"fa_version": 3, "num_splits": 0})
    ctx_call, sys_call = attn.calls
    assert ctx_call["causal"] is True and ctx_call["return_softmax_lse"] is True
    assert ctx_call["scheduler_metadata"] is plan.scheduler_metadata and ctx_call["out"] is out
    assert sys_call["causal"] is False and sys_call["scheduler_metadata"] is plan.system.scheduler_metadata
    assert ctx_call["fa_version"] == sys_call["fa_version"] == 3
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
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("group", [1, 4])
def test_relay_attention_cuda_flash_attn(dtype, group):
    flash_attn_varlen_func, fa_version = _fa()
    (q, k_cache, v_cache, k_sys, v_sys), plan, scale, ref = build(MIXED_BATCH, (17, 1000), 8 // group,
                                                                 group, 128, 16, dtype, device="cuda")
    out = torch.full_like(q, float("nan"))
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")  # relay_attention must not synchronize with the host
    try:
        relay_attention(q, k_cache, v_cache, k_sys, v_sys, plan, out, scale, flash_attn_varlen_func,
                        attn_kwargs={"fa_version": fa_version})
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert_close(out, ref, dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_relay_attention_cuda_torch_attn(dtype):
    """Triton fusion on CUDA with the torch attention: no vLLM needed."""
    (q, k_cache, v_cache, k_sys, v_sys), plan, scale, ref = build(MIXED_BATCH, (1, 1000), 2, 4, 128, 32,
                                                                 dtype, device="cuda")
    out = torch.empty_like(q)
    relay_attention(q, k_cache, v_cache, k_sys, v_sys, plan, out, scale, varlen_attention_torch)
    assert_close(out, ref, dtype)
