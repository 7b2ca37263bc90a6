"""gather_rows: the levels' query rows, the count read on the device, against index_select."""

import pytest
import torch

from vllm_relay.ops.gather_rows import gather_rows, gather_rows_torch, gather_rows_triton

IMPLS = {"torch": gather_rows_torch, "triton": gather_rows_triton}


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("T, N, count, shape", [(1, 1, 1, (1, 16)), (37, 50, 29, (3, 59)), (130, 64, 0, (8, 128)),
                                                (9, 300, 300, (2, 64))])
def test_against_index_select(impl, T, N, count, shape):
    src = torch.randn(T, *shape)
    perm = torch.randint(0, T, (N,), dtype=torch.int32)
    out = torch.full((N + 3, *shape), float("nan"))
    IMPLS[impl](src, perm, torch.tensor([count], dtype=torch.int32), out)
    assert torch.equal(out[:count], src[perm[:count].long()])
    assert out[count:].isnan().all()  # rows past the count untouched


def test_rejects_bad_arguments():
    src, out = torch.randn(4, 2, 8), torch.empty(4, 2, 8)
    with pytest.raises(ValueError, match="perm must be int32"):
        gather_rows(src, torch.zeros(4, dtype=torch.int64), torch.ones(1, dtype=torch.int32), out)
    with pytest.raises(ValueError, match="out must be"):
        gather_rows(src, torch.zeros(4, dtype=torch.int32), torch.ones(1, dtype=torch.int32), out[:, :1])


@pytest.mark.gpu
def test_a_captured_graph_replays_any_count():
    src = torch.randn(300, 32, 128, dtype=torch.bfloat16, device="cuda")
    perm = torch.randint(0, 300, (1024,), dtype=torch.int32, device="cuda")
    count = torch.zeros(1, dtype=torch.int32, device="cuda")
    out = torch.zeros(1024, 32, 128, dtype=torch.bfloat16, device="cuda")
    gather_rows(src, perm, count, out)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        gather_rows(src, perm, count, out)
    for n in (0, 1, 517, 1024):
        out.zero_()
        count.fill_(n)
        graph.replay()
        assert torch.equal(out[:n], src[perm[:n].long()]) and not out[n:].any()


@pytest.mark.gpu
def test_one_compiled_kernel_serves_a_count_at_any_alignment():
    """The planner's count is an element of its plan (`cu[G]`): 16-byte aligned for some steps
    only. Triton would compile the kernel again for an aligned pointer, mid-run (a step stalled
    132 ms on the H100); the count is not specialized on its alignment."""
    from vllm_relay.ops.gather_rows import _gather_rows_kernel

    src = torch.randn(64, 4, 128, dtype=torch.bfloat16, device="cuda")
    perm = torch.randint(0, 64, (32,), dtype=torch.int32, device="cuda")
    counts = torch.tensor([5, 7, 9, 11, 13], dtype=torch.int32, device="cuda")  # at byte 0, 4, 8, 12, 16
    out = torch.zeros(32, 4, 128, dtype=torch.bfloat16, device="cuda")
    gather_rows(src, perm, counts[1:2], out)
    cache = _gather_rows_kernel.device_caches[torch.cuda.current_device()][0]
    compiled = len(cache)
    for i in range(5):
        n = int(counts[i])
        out.zero_()
        gather_rows(src, perm, counts[i: i + 1], out)
        assert torch.equal(out[:n], src[perm[:n].long()]) and not out[n:].any()
    assert len(cache) == compiled


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float8_e4m3fn])
def test_the_warm_up_compiles_what_a_step_launches(dtype):
    """`warm_up_gather_rows` compiles the kernel a step's gather launches: the queries a view of vLLM's
    fused QKV rows (another row stride), any count, the planner's buffers (FP8 rows as bytes)."""
    from vllm_relay.ops.gather_rows import _gather_rows_kernel, warm_up_gather_rows

    hq, hkv, d = 12, 4, 80  # a shape no other test compiles
    bytes_ = dtype == torch.float8_e4m3fn
    perm = torch.zeros(700, dtype=torch.int32, device="cuda")[3:]  # a staging buffer's view
    q_buf = torch.zeros(697, hq, d, dtype=dtype, device="cuda")  # a row for each of perm's
    rows = q_buf.view(torch.uint8) if bytes_ else q_buf
    cache = _gather_rows_kernel.device_caches[torch.cuda.current_device()][0]
    before = len(cache)
    warm_up_gather_rows(perm, rows)
    assert len(cache) == before + 1
    qkv = torch.randn(300, (hq + 2 * hkv) * d, device="cuda").to(dtype)
    q = qkv[:, : hq * d].view(300, hq, d)
    src = q.view(torch.uint8) if bytes_ else q
    perm[:517].copy_(torch.randint(0, 300, (517,), dtype=torch.int32))
    gather_rows(src, perm, torch.tensor([517], dtype=torch.int32, device="cuda"), rows)
    assert torch.equal(rows[:517], src[perm[:517].long()])
    assert len(cache) == before + 1
