"""vllm_relay/ops/split_combine.py: partials over disjoint key ranges merged by their LSEs, the Triton
kernel and its torch twin against attention computed whole over the ranges' keys (fp32, here)."""

import pytest
import torch

from tests.ops.reference import assert_close, interpreter_on
from vllm_relay.ops.split_combine import combine_splits, combine_splits_torch

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
NEEDS_TRITON = pytest.mark.skipif(DEVICE == "cpu" and not interpreter_on(),
                                  reason="needs CUDA or TRITON_INTERPRET=1")
IMPLS = [pytest.param(combine_splits_torch, id="torch"),
         pytest.param(combine_splits, id="triton", marks=NEEDS_TRITON)]
SENTINEL = 7.0


def partials(S, N, H, D, keys_per_range, empty):
    """Each range's attention over its own keys, and the whole attention over all of them, per (row, head).
    `empty`: (range, row) pairs whose range holds no key the row sees (masked out of the whole too)."""
    q = torch.randn(N, H, D)
    k = torch.randn(S, keys_per_range, H, D)
    v = torch.randn(S, keys_per_range, H, D)
    s = torch.einsum("nhd,skhd->shnk", q, k) * D ** -0.5 * 3  # [S, H, N, K]: spread, so weights differ
    for r, n in empty:
        s[r, :, n] = float("-inf")
    part_lse = torch.logsumexp(s, dim=-1)  # [S, H, N]
    w = torch.exp(s - part_lse.masked_fill(part_lse == float("-inf"), 0.0)[..., None])
    part_out = torch.einsum("shnk,skhd->snhd", w, v)
    whole = s.permute(1, 2, 0, 3).reshape(H, N, S * keys_per_range)  # every key of every range
    lse = torch.logsumexp(whole, dim=-1)
    p = torch.exp(whole - lse.masked_fill(lse == float("-inf"), 0.0)[..., None])
    out = torch.einsum("hnk,khd->nhd", p, v.reshape(S * keys_per_range, H, D))
    return part_out.contiguous(), part_lse.contiguous(), out, lse


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("S, N, H, D", [(1, 4, 2, 16), (4, 5, 3, 80), (16, 9, 16, 256)])
def test_matches_the_whole_attention(impl, dtype, S, N, H, D):
    """Rows whose ranges are partly empty, and one row that sees nothing (out 0, lse -inf); the rows before
    `start` and from `end` on are left as they were."""
    empty = [(r, 1) for r in range(0, S, 2)] + [(r, 2) for r in range(S)]
    part_out, part_lse, want_out, want_lse = partials(S, N, H, D, 7, empty)
    start, end = 1, N - 1
    out = torch.full((N, H, D), SENTINEL, dtype=dtype)
    lse = torch.full((H, N), SENTINEL)
    bounds = [torch.tensor([x], dtype=torch.int32) for x in (start, end)]
    args = [x.to(DEVICE) for x in (part_out, part_lse, out, lse, *bounds)]
    impl(*args)
    out, lse = args[2].cpu(), args[3].cpu()
    assert_close(out[start:end], want_out[start:end], dtype)
    torch.testing.assert_close(lse[:, start:end], want_lse[:, start:end], atol=1e-4, rtol=1e-5)
    assert (out[2] == 0).all() and (lse[:, 2] == float("-inf")).all()
    for rows in (slice(0, start), slice(end, None)):
        assert (out[rows] == SENTINEL).all() and (lse[:, rows] == SENTINEL).all()


@pytest.mark.parametrize("impl", IMPLS)
def test_refuses_shapes_that_disagree(impl):
    part_out, part_lse, _, _ = partials(2, 3, 2, 16, 4, [])
    rows = torch.tensor([0], dtype=torch.int32), torch.tensor([3], dtype=torch.int32)
    with pytest.raises(ValueError, match="do not agree"):
        impl(part_out, part_lse, torch.zeros(3, 2, 8), torch.zeros(2, 3), *rows)
    with pytest.raises(ValueError, match="float32"):
        impl(part_out.half(), part_lse, torch.zeros(3, 2, 16), torch.zeros(2, 3), *rows)
