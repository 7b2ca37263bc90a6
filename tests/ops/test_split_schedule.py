"""`force_one_split`: one key split for every batch of a FlashAttention-3 call captured split.
`graph_split_cap`: the split cap FA3's schedule can use.

On the CPU, the schedule layout it writes (and refuses), and the cap against FA3's split formula
transcribed in float32; on the GPU, a varlen call over paged keys captured in a CUDA graph with 8
splits and FA3's schedule in a persistent buffer, replayed for random batches with every split count
forced to 1: output and LSE equal the fp32 reference; and FA3's own schedule and output under vLLM's
cap and under `graph_split_cap`: equal.
"""

import numpy as np
import pytest
import torch

from tests.ops.reference import attention_ref
from vllm_relay.ops import force_one_split, graph_split_cap
from vllm_relay.ops.split_schedule import most_dynamic_splits


def fa3_dynamic_splits(key_blocks: np.ndarray, total_blocks: np.ndarray, heads: int, num_sms: int, cap: int):
    """FA3's split count for a batch of `key_blocks` key blocks in a call of `total_blocks` query x
    key blocks (hopper/flash_prepare_scheduler.cu, its float32 arithmetic)."""
    f32 = np.float32
    per_sm = np.ceil(total_blocks.astype(f32) * f32(1.1) * f32(heads) / f32(num_sms)).astype(np.int64)
    return np.maximum(np.minimum((key_blocks + per_sm - 1) // per_sm, cap), 1)


@pytest.mark.parametrize("num_sms", [78, 108, 114, 132, 170])
def test_no_batch_gets_more_splits_than_the_cap(num_sms):
    """Over every KV head count and key length, a batch alone or beside others: FA3's split count
    under a cap of 256 never passes `most_dynamic_splits`, and reaches it (the bound is tight)."""
    rng = np.random.default_rng(num_sms)
    key_blocks = np.arange(1, 6000)
    for heads in range(1, 129):
        bound = most_dynamic_splits(num_sms, heads)
        reached = 0
        for query_blocks in (1, 2, 3, 9):
            others = rng.integers(0, 4000, size=key_blocks.shape) * (query_blocks > 1)
            total = key_blocks * query_blocks + others
            splits = fa3_dynamic_splits(key_blocks, total, heads, num_sms, 256)
            assert splits.max() <= bound
            reached = max(reached, int(splits.max()))
        assert reached == bound
        assert graph_split_cap(32, num_sms, heads) == min(32, max(2, bound))


def test_the_cap_never_splits_an_unsplit_call():
    assert graph_split_cap(0, 132, 32) == 0 and graph_split_cap(1, 132, 32) == 1
    assert graph_split_cap(32, 132, 128) == 2  # FA3's split kernels stay, as under vLLM's cap


@pytest.mark.parametrize("batch", [1, 3, 4, 5, 66])
def test_every_batch_split_count_becomes_one(batch):
    b4 = -(-batch // 4) * 4
    sched = torch.randint(0, 9, (2 * b4 + 1,), dtype=torch.int32)
    before = sched.clone()
    assert force_one_split(sched, batch)
    assert (sched[b4: 2 * b4] == 1).all()
    assert torch.equal(sched[:b4], before[:b4]) and sched[-1] == before[-1]  # rows and semaphore kept


@pytest.mark.parametrize("length,dtype", [(9, torch.int64), (5, torch.int32), (10, torch.int32), (17, torch.int32)])
def test_another_layout_is_left_alone(length, dtype):
    """A schedule without the split vector (one split, no dynamic split) or of another batch size or
    dtype: untouched, FA3's own choice stands."""
    sched = torch.arange(length, dtype=dtype)
    assert not force_one_split(sched, 2)
    assert torch.equal(sched, torch.arange(length, dtype=dtype))


@pytest.mark.gpu
@pytest.mark.parametrize("hq,hkv", [(8, 8), (8, 2)])
def test_captured_split_call_replays_unsplit_exactly_on_cuda(hq, hkv):
    pytest.importorskip("vllm")
    from vllm.vllm_flash_attn import flash_attn_varlen_func, get_scheduler_metadata

    D, BLOCK, C, SPLITS, PAGES = 128, 16, 6, 8, 200
    dev, dtype, scale = "cuda", torch.bfloat16, D ** -0.5
    rng = np.random.default_rng(0)
    kv = torch.randn(PAGES, BLOCK, hkv, 2 * D, device=dev, dtype=dtype)
    k_cache, v_cache = kv[..., :D], kv[..., D:]
    width = 64
    table = torch.zeros(C, width, dtype=torch.int32, device=dev)
    lens = torch.zeros(C, dtype=torch.int32, device=dev)
    cu = torch.zeros(C + 1, dtype=torch.int32, device=dev)
    max_rows = 64
    q = torch.zeros(max_rows, hq, D, device=dev, dtype=dtype)
    out = torch.zeros_like(q)
    sched_buf = torch.zeros(1 + 2 * (-(-C // 4) * 4), dtype=torch.int32, device=dev)

    def schedule():
        sched = get_scheduler_metadata(
            batch_size=C, max_seqlen_q=max_rows, max_seqlen_k=width * BLOCK, num_heads_q=hq, num_heads_kv=hkv,
            headdim=D, cache_seqlens=lens, qkv_dtype=dtype, cu_seqlens_q=cu, page_size=BLOCK, causal=False,
            window_size=(-1, -1), num_splits=SPLITS)
        assert sched.shape == sched_buf.shape  # FA3's dynamic-split layout
        sched_buf.copy_(sched)

    def call():
        return flash_attn_varlen_func(
            q=q, k=k_cache, v=v_cache, out=out, cu_seqlens_q=cu, seqused_k=lens, max_seqlen_q=max_rows,
            max_seqlen_k=width * BLOCK, softmax_scale=scale, causal=False, block_table=table,
            return_softmax_lse=True, scheduler_metadata=sched_buf, num_splits=SPLITS, fa_version=3)

    schedule()
    call()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        _, lse = call()
    changed = False
    for _ in range(4):
        G = int(rng.integers(1, C + 1))
        rows = rng.integers(1, max_rows // C + 1, size=G)
        keys = rng.integers(1, width * BLOCK, size=G)  # few rows over long keys: FA3 splits them
        cu.zero_()
        cu[1: G + 1] = torch.tensor(np.cumsum(rows), dtype=torch.int32)
        cu[G + 1:] = int(rows.sum())
        lens.zero_()
        lens[:G] = torch.tensor(keys, dtype=torch.int32)
        table.copy_(torch.randint(0, PAGES, table.shape, dtype=torch.int32))
        q.copy_(torch.randn_like(q))
        schedule()
        graph.replay()
        split_out = out.clone()
        assert force_one_split(sched_buf, C)
        graph.replay()
        changed |= not torch.equal(split_out, out)
        for g in range(G):
            a, b, n = int(cu[g]), int(cu[g + 1]), int(keys[g])
            pages = table[g, : -(-n // BLOCK)].long()
            k = k_cache[pages].reshape(-1, hkv, D)[:n].float().cpu()
            v = v_cache[pages].reshape(-1, hkv, D)[:n].float().cpu()
            o_ref, lse_ref = attention_ref(q[a:b].float().cpu(), k, v, scale, causal=False)
            torch.testing.assert_close(out[a:b].float().cpu(), o_ref, atol=2e-2, rtol=2e-2)
            torch.testing.assert_close(lse[:, a:b].float().cpu(), lse_ref, atol=1e-3, rtol=1e-3)
    assert changed  # the replays with FA3's splits and with one split computed differently


@pytest.mark.gpu
@pytest.mark.parametrize("hq,hkv", [(32, 32), (32, 8), (28, 4)])
def test_the_cap_changes_no_split_and_no_result_on_cuda(hq, hkv):
    """FA3 varlen calls over paged keys (few rows over long keys: split; many rows: not) with their
    schedules, under vLLM's cap (32) and under `graph_split_cap`: the same split counts, bit-equal
    output and LSE."""
    pytest.importorskip("vllm")
    from vllm.vllm_flash_attn import flash_attn_varlen_func, get_scheduler_metadata

    D, BLOCK, PAGES = 128, 16, 2048
    dev, dtype, scale = "cuda", torch.bfloat16, D ** -0.5
    cap = graph_split_cap(32, torch.cuda.get_device_properties(0).multi_processor_count, hkv)
    assert 2 <= cap < 32
    rng = np.random.default_rng(hq + hkv)
    kv = torch.randn(PAGES, BLOCK, hkv, 2 * D, device=dev, dtype=dtype)
    k_cache, v_cache = kv[..., :D], kv[..., D:]
    split_seen = False
    for _ in range(12):
        G = int(rng.integers(1, 9))
        rows = rng.integers(1, int(rng.choice([3, 40, 700])), size=G)
        keys = rng.integers(1, 16000, size=G)
        width = -(-int(keys.max()) // BLOCK)
        table = torch.randint(0, PAGES, (G, width), dtype=torch.int32, device=dev)
        lens = torch.tensor(keys, dtype=torch.int32, device=dev)
        cu = torch.tensor(np.concatenate([[0], np.cumsum(rows)]), dtype=torch.int32, device=dev)
        q = torch.randn(int(rows.sum()), hq, D, device=dev, dtype=dtype)
        results = []
        for splits in (32, cap):
            sched = get_scheduler_metadata(
                batch_size=G, max_seqlen_q=int(rows.max()), max_seqlen_k=int(keys.max()), num_heads_q=hq,
                num_heads_kv=hkv, headdim=D, cache_seqlens=lens, qkv_dtype=dtype, cu_seqlens_q=cu,
                page_size=BLOCK, causal=False, window_size=(-1, -1), num_splits=splits)
            out, lse = flash_attn_varlen_func(
                q=q, k=k_cache, v=v_cache, cu_seqlens_q=cu, seqused_k=lens, max_seqlen_q=int(rows.max()),
                max_seqlen_k=int(keys.max()), softmax_scale=scale, causal=False, block_table=table,
                return_softmax_lse=True, scheduler_metadata=sched, num_splits=splits, fa_version=3)
            b4 = -(-G // 4) * 4
            results.append((sched[b4: b4 + G].clone(), out, lse))
        (splits32, out32, lse32), (splits_cap, out_cap, lse_cap) = results
        assert torch.equal(splits32, splits_cap)
        assert torch.equal(out32, out_cap) and torch.equal(lse32, lse_cap)
        split_seen |= bool((splits32 > 1).any())
    assert split_seen
