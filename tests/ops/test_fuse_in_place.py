"""vllm_relay/ops/fuse_in_place.py: the levels' merge in one launch, against `relay_fusion`'s
torch twin and a float64 merge of every part at once, on odd shapes."""

import pytest
import torch

from tests.ops.reference import DTYPES, assert_close, interpreter_on
from vllm_relay.ops import relay_fusion_torch


# ---- fuse_in_place: relay_attention's compact launch --------------------------------------------

@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("update_lse", [False, True])
@pytest.mark.parametrize("T, N, H, D", [(1, 1, 1, 16), (37, 11, 3, 59), (130, 64, 8, 128)])
def test_fuse_in_place_equals_relay_fusion(dtype, update_lse, T, N, H, D):
    """Same result as the checked relay_fusion (its torch twin), tokens without a level row
    untouched bit for bit, the LSE merged in place only when asked."""
    from vllm_relay.ops.fuse_in_place import fuse_in_place

    device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cpu" and not interpreter_on():
        pytest.skip("needs CUDA or TRITON_INTERPRET=1")
    out = torch.randn(T, H, D).to(dtype).to(device)
    lse = (torch.randn(H, T) * 3).to(device)
    o_level = torch.randn(N, H, D).to(dtype).to(device)
    lse_level = (torch.randn(H, N) * 3).to(device)
    row_index = torch.full((T,), -1, dtype=torch.int32)
    rows = torch.randperm(T)[: min(N, T)]
    row_index[rows] = torch.randperm(N)[: rows.numel()].int()
    row_index = row_index.to(device)
    want_out, want_lse = out.clone(), lse.clone()
    relay_fusion_torch(o_level, lse_level, want_out, want_lse, out=want_out,
                       out_lse=want_lse if update_lse else None, sys_index=row_index)
    got_out, got_lse = out.clone(), lse.clone()
    assert fuse_in_place(got_out, got_lse, o_level, lse_level, row_index, update_lse) is got_out
    untagged = row_index < 0
    assert torch.equal(got_out[untagged], out[untagged])
    assert_close(got_out, want_out, dtype)
    torch.testing.assert_close(got_lse, want_lse if update_lse else lse, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("levels, T, N, H, D", [(2, 1, 2, 1, 16), (3, 41, 70, 3, 59), (4, 130, 200, 8, 128)])
def test_fuse_in_place_merges_several_levels_per_token(dtype, levels, T, N, H, D):
    """A token under several levels (row_index [L, T]) comes out as the softmax-weighted mix of its
    context and every level it has, against a float64 merge of all the parts at once."""
    from vllm_relay.ops.fuse_in_place import fuse_in_place

    device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cpu" and not interpreter_on():
        pytest.skip("needs CUDA or TRITON_INTERPRET=1")
    out = torch.randn(T, H, D).to(dtype)
    lse = torch.randn(H, T) * 3
    o_level = torch.randn(N, H, D).to(dtype)
    lse_level = torch.randn(H, N) * 3
    row_index = torch.full((levels, T), -1, dtype=torch.int32)
    rows = torch.randperm(N)
    used = 0
    for t in range(T):  # each token takes 0..levels distinct rows, in any order
        k = int(torch.randint(0, levels + 1, ()))
        if used + k > N:
            break
        row_index[:k, t] = rows[used: used + k].int()
        used += k
    lses, outs = [lse.t().double()], [out.double()]
    for k in range(levels):
        has = row_index[k] >= 0
        r = row_index[k].clamp(min=0).long()
        lses.append(torch.where(has[:, None], lse_level.t()[r].double(), float("-inf")))
        outs.append(o_level[r].double())
    w = torch.softmax(torch.stack(lses), dim=0)[..., None]  # [1 + L, T, H, 1]
    want = sum(wi * torch.where(wi > 0, oi, 0.0) for wi, oi in zip(w, outs))
    want_lse = torch.logsumexp(torch.stack(lses), dim=0).t()
    got_out, got_lse = out.clone().to(device), lse.clone().to(device)
    fuse_in_place(got_out, got_lse, o_level.to(device), lse_level.to(device), row_index.to(device), True)
    untouched = (row_index < 0).all(dim=0)
    assert torch.equal(got_out.cpu()[untouched], out[untouched])
    assert_close(got_out, want, dtype)
    torch.testing.assert_close(got_lse.cpu(), want_lse.float(), atol=1e-5, rtol=1e-5)
    torch_out, torch_lse = out.clone(), lse.clone()  # the CPU path: one relay_fusion_torch per level
    for k in range(levels):
        relay_fusion_torch(o_level, lse_level, torch_out, torch_lse, out=torch_out, out_lse=torch_lse,
                           sys_index=row_index[k].contiguous())
    assert_close(torch_out, want, dtype)


# ---- fuse_joint: one call's output (level rows, then the tokens' own) ------------------------------

@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("levels, T, N, H, D, spare", [(1, 1, 0, 1, 16, 0), (2, 37, 29, 3, 59, 5),
                                                        (4, 130, 200, 8, 128, 17)])
@pytest.mark.parametrize("strided_lse", [False, True])
def test_fuse_joint_merges_the_tokens_rows_with_their_levels(dtype, levels, T, N, H, D, spare, strided_lse):
    """`out[t]` is the float64 softmax-weighted mix of the token's own row (at N + t of the call's
    output) and its level rows; every token written, those without a level row exactly their own row;
    the same from the torch path (an LSE whose last dim is not contiguous)."""
    from vllm_relay.ops.fuse_in_place import fuse_joint

    device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cpu" and not interpreter_on():
        pytest.skip("needs CUDA or TRITON_INTERPRET=1")
    R = N + T + spare  # the call's rows: a graph's buffers hold more than a step uses
    o_all = torch.randn(R, H, D).to(dtype)
    lse_all = torch.randn(H, R) * 3
    lse_all[:, N + T // 2] = float("-inf")  # a token with no KV of its own (a padding request)
    row_index = torch.full((levels, T), -1, dtype=torch.int32)
    rows, used = torch.randperm(N), 0
    for t in range(T):
        k = int(torch.randint(0, levels + 1, ()))
        if used + k > N:
            break
        row_index[:k, t] = rows[used: used + k].int()
        used += k
    lses, outs = [lse_all[:, N: N + T].t().double()], [o_all[N: N + T].double()]
    for k in range(levels):
        has = row_index[k] >= 0
        r = row_index[k].clamp(min=0).long()
        lses.append(torch.where(has[:, None], lse_all.t()[r].double(), float("-inf")))
        outs.append(o_all[r].double())
    w = torch.nan_to_num(torch.softmax(torch.stack(lses), dim=0))[..., None]
    want = sum(wi * torch.where(wi > 0, oi, 0.0) for wi, oi in zip(w, outs))
    dead = torch.isinf(torch.stack(lses)).all(dim=0)  # no keys anywhere: the own row as it is
    want = torch.where(dead[..., None], outs[0], want)
    lse_in = lse_all.to(device)
    if strided_lse:  # FlashAttention's LSE is [H, R] contiguous; a transposed copy takes the torch path
        lse_in = lse_all.t().contiguous().to(device).t()
    start = torch.tensor([N], dtype=torch.int32, device=device)
    got = torch.full((T, H, D), float("nan")).to(dtype).to(device)
    assert fuse_joint(got, o_all.to(device), lse_in, start, row_index.to(device)) is got
    alone = (row_index < 0).all(dim=0)
    assert torch.equal(got.cpu()[alone], o_all[N: N + T][alone])
    assert_close(got, want, dtype)


# ---- warm-up: every fuse_in_place variant compiled at start-up ------------------------------------

@pytest.mark.parametrize("H", [1, 4, 8, 20, 32, 40, 64])
@pytest.mark.parametrize("max_tokens", [1, 100, 512, 8192, 20000])
def test_warm_up_sizes_cover_every_launch_config(H, max_tokens):
    # The warm-up samples step sizes at powers of two; every size up to max_tokens must pick one of
    # the sampled launch configurations (else a later step compiles one mid-run).
    from vllm_relay.ops.fuse_in_place import _launch_config, _powers_of_two

    for D, elem in ((64, 2), (128, 2), (128, 4), (256, 2)):
        sampled = {_launch_config(t * H, D, elem, False) for t in _powers_of_two(max_tokens)}
        every = {_launch_config(t * H, D, elem, False) for t in range(1, max_tokens + 1)}
        assert every <= sampled, (every - sampled)


@pytest.mark.gpu
@pytest.mark.parametrize("H, D", [(32, 128), (8, 64), (40, 128)])
def test_warm_up_then_no_compilation_cuda(H, D):
    from vllm_relay.ops.fuse_in_place import _fuse_in_place_kernel, fuse_in_place, warm_up_fuse_in_place

    caches = getattr(_fuse_in_place_kernel, "device_caches", None)
    if caches is None:
        pytest.skip("this Triton keeps no per-device kernel cache to inspect")
    assert warm_up_fuse_in_place(H, D, torch.bfloat16, "cuda", 4096) >= 2
    dev = torch.cuda.current_device()
    before = len(caches[dev][0])
    for T in (1, 7, 64, 300, 1000, 4096):
        N = max(1, T // 3)
        out = torch.randn(T, H, D, dtype=torch.bfloat16, device="cuda")
        lse = torch.randn(H, T, device="cuda")
        o_level = torch.randn(N, H, D, dtype=torch.bfloat16, device="cuda")
        lse_level = torch.randn(H, N, device="cuda")
        row_index = torch.randint(-1, N, (T,), dtype=torch.int32, device="cuda")
        want = relay_fusion_torch(o_level, lse_level, out.clone(), lse.clone(), sys_index=row_index)
        assert_close(fuse_in_place(out, lse, o_level, lse_level, row_index, False), want, torch.bfloat16)
    assert len(caches[dev][0]) == before, "fuse_in_place compiled a kernel the warm-up did not"
