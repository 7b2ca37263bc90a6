import numpy as np
import pytest
import torch

from tests.ops.reference import DTYPES, assert_close, attention_ref, make_system_buffers
from vllm_relay.ops import (
    SystemPlan,
    plan_system_attention,
    system_attention,
    system_attention_torch,
    varlen_attention_torch,
)


def reference_system(q, valid, token_slot, scale):
    """Each tagged token attends to its slot's valid K/V (dense, non-causal, so rows are independent)."""
    T, hq, d = q.shape
    o = torch.zeros(T, hq, d)
    lse = torch.full((hq, T), float("-inf"))
    for s, (k, v) in enumerate(valid):
        rows = torch.nonzero(token_slot == s).flatten()
        if rows.numel():
            o[rows], lse[:, rows] = attention_ref(q[rows], k, v, scale, causal=False)
    return o, lse


def random_slots(T, num_slots, untagged_frac=0.3):
    slots = torch.randint(0, num_slots, (T,), dtype=torch.int32)
    slots[torch.rand(T) < untagged_frac] = -1
    return slots


class CountingAttn:
    def __init__(self):
        self.calls = []

    def __call__(self, **kwargs):
        self.calls.append(kwargs)
        return varlen_attention_torch(**kwargs)


# ------------------------------------------------------------------------------------------ planning

def test_plan_groups_tokens_stably_by_slot():
    plan = plan_system_attention([2, -1, 0, 2, 0, -1, 1], [5, 9, 3], S_max=32, page_size=16, device="cpu")
    assert plan.num_tokens == 5
    assert plan.perm.tolist() == [2, 4, 6, 0, 3]
    assert plan.cu_seqlens_q.tolist() == [0, 2, 3, 5]
    assert plan.seqused_k.tolist() == [5, 9, 3]
    assert (plan.max_seqlen_q, plan.max_seqlen_k) == (2, 9)
    assert plan.block_table.tolist() == [[0, 1], [2, 3], [4, 5]]
    assert plan.sys_index.tolist() == [3, -1, 0, 4, 1, -1, 2]
    for t in (plan.perm, plan.cu_seqlens_q, plan.seqused_k, plan.block_table, plan.sys_index):
        assert t.dtype == torch.int32


@pytest.mark.parametrize("as_type", [list, np.array, torch.tensor])
def test_plan_accepts_host_containers_and_skips_identity_perm(as_type):
    plan = plan_system_attention(as_type([0, 0, 1, -1, -1]), as_type([4, 7]), S_max=64, page_size=32,
                                 device="cpu")
    assert plan.perm is None  # tagged tokens are already rows 0..2 in grouped order
    assert plan.sys_index.tolist() == [0, 1, 2, -1, -1]
    assert plan.block_table.tolist() == [[0, 1], [2, 3]]


def test_plan_treats_empty_slots_as_untagged():
    plan = plan_system_attention([1, 0, 1], [0, 5], S_max=16, page_size=16, device="cpu")
    assert plan.num_tokens == 2
    assert plan.sys_index.tolist() == [0, -1, 1]  # slot 0 is empty
    assert plan.perm.tolist() == [0, 2] and plan.seqused_k.tolist() == [5]


def test_plan_without_tagged_tokens():
    plan = plan_system_attention([-1, -1], [3], S_max=16, page_size=16, device="cpu")
    assert plan.num_tokens == 0 and plan.perm is None
    assert plan.sys_index.tolist() == [-1, -1]
    assert plan.block_table.shape == (0, 1)


@pytest.mark.parametrize("kwargs,match", [
    (dict(token_slot_cpu=[0], sys_lens_cpu=[4], S_max=40, page_size=16), "multiple of page_size"),
    (dict(token_slot_cpu=[2], sys_lens_cpu=[4], S_max=32, page_size=16), "token_slot_cpu values"),
    (dict(token_slot_cpu=[-2], sys_lens_cpu=[4], S_max=32, page_size=16), "token_slot_cpu values"),
    (dict(token_slot_cpu=[0], sys_lens_cpu=[40], S_max=32, page_size=16), "sys_lens_cpu values"),
    (dict(token_slot_cpu=torch.zeros(1, dtype=torch.int32, device="meta"), sys_lens_cpu=[4], S_max=32,
          page_size=16), "must be on the host"),
])
def test_plan_checks(kwargs, match):
    with pytest.raises(ValueError, match=match):
        plan_system_attention(device="cpu", **kwargs)


# --------------------------------------------------------------------------------------- attention

@pytest.mark.parametrize("T", [1, 7, 129])
@pytest.mark.parametrize("sys_lens", [(17,), (1, 1000, 17)], ids=["one_slot", "three_slots"])
@pytest.mark.parametrize("group", [1, 4, 8])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_system_attention_matches_reference(T, sys_lens, group, dtype):
    h_kv, d, page_size = 2, 64, 16 if T != 7 else 32
    s_max = 1024
    q = torch.randn(T, h_kv * group, d).to(dtype)
    k_sys, v_sys, valid = make_system_buffers(list(sys_lens), s_max, h_kv, d, dtype)
    token_slot = random_slots(T, len(sys_lens))
    if T == 1:
        token_slot[0] = len(sys_lens) - 1
    scale = d ** -0.5
    ref_o, ref_lse = reference_system(q, valid, token_slot, scale)

    plan = plan_system_attention(token_slot, list(sys_lens), s_max, page_size, device="cpu")
    attn = CountingAttn()
    o_g, lse_g = system_attention(q, k_sys, v_sys, plan, scale, attn, attn_kwargs={"fa_version": 3})
    assert len(attn.calls) == 1  # one grouped launch for all slots
    assert attn.calls[0]["causal"] is False and attn.calls[0]["fa_version"] == 3
    assert o_g.shape == (plan.num_tokens, q.shape[1], d) and lse_g.shape == (q.shape[1], plan.num_tokens)
    tagged = plan.sys_index >= 0
    rows = plan.sys_index[tagged].long()
    assert_close(o_g[rows], ref_o[tagged], dtype)
    torch.testing.assert_close(lse_g[:, rows], ref_lse[:, tagged], atol=1e-4, rtol=1e-5)

    o_t, lse_t = system_attention_torch(q, k_sys, v_sys, torch.tensor(sys_lens), token_slot, scale)
    assert_close(o_t, ref_o, dtype)
    torch.testing.assert_close(lse_t, ref_lse, atol=1e-4, rtol=1e-5)
    assert torch.all(o_t[~tagged] == 0) and torch.all(lse_t[:, ~tagged] == float("-inf"))


def test_system_attention_uses_slice_without_perm():
    q = torch.randn(4, 4, 64)
    k_sys, v_sys, valid = make_system_buffers([9, 3], 32, 4, 64, torch.float32)
    plan = plan_system_attention([0, 1, -1, -1], [9, 3], 32, 16, device="cpu")
    attn = CountingAttn()
    o, lse = system_attention(q, k_sys, v_sys, plan, 0.125, attn)
    assert plan.perm is None and attn.calls[0]["q"].data_ptr() == q.data_ptr()
    ref_o, _ = reference_system(q, valid, torch.tensor([0, 1, -1, -1]), 0.125)
    assert_close(o, ref_o[:2], torch.float32)


def test_system_attention_without_tokens_does_not_call_attn():
    plan = plan_system_attention([-1, -1, -1], [5], 16, 16, device="cpu")
    attn = CountingAttn()
    k_sys, v_sys, _ = make_system_buffers([5], 16, 2, 64, torch.float16)
    o, lse = system_attention(torch.randn(3, 2, 64).half(), k_sys, v_sys, plan, 0.125, attn)
    assert attn.calls == [] and o.shape == (0, 2, 64) and lse.shape == (2, 0)


def test_system_attention_passes_scheduler_metadata():
    plan = plan_system_attention([0], [5], 16, 16, device="cpu")
    plan.scheduler_metadata = torch.zeros(3, dtype=torch.int32)
    seen = {}

    def attn(**kwargs):
        seen.update(kwargs)
        kwargs.pop("scheduler_metadata")
        return varlen_attention_torch(**kwargs)

    k_sys, v_sys, _ = make_system_buffers([5], 16, 2, 64, torch.float32)
    system_attention(torch.randn(1, 2, 64), k_sys, v_sys, plan, 0.125, attn)
    assert seen["scheduler_metadata"] is plan.scheduler_metadata


def test_system_buffers_must_be_pageable():
    plan = plan_system_attention([0], [5], 32, 16, device="cpu")
    k_sys = torch.randn(32, 2, 2, 64).transpose(0, 1)  # [num_slots=2, S_max=32, ...], dims 0/1 swapped
    with pytest.raises(ValueError, match="cannot be viewed as pages"):
        system_attention(torch.randn(1, 2, 64), k_sys, k_sys, plan, 0.125, varlen_attention_torch)
    assert isinstance(plan, SystemPlan)
