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
