"""level_attention: one launch for a shared level (gather, split-K attention over the group's pages,
LSE merge into the running output), against an fp32 dense reference on odd shapes."""

import numpy as np
import pytest
import torch

from tests.ops.reference import TOL, attention_ref, make_paged_cache
from vllm_relay.ops.level_attention import (
    level_attention,
    level_attention_torch,
    max_tiles,
    plan_tiles,
    tile_tokens,
    workspace,
)


def case(group_lens_pages, tokens_per_group, h_kv, gqa, d, dtype, T_extra=3, seed=0, device="cpu"):
    """Random running output/LSE for T tokens, a level over G groups (pages in one paged cache),
    and the reference: each grouped token's output merged with its group's attention."""
    g = torch.Generator().manual_seed(seed)
    hq = h_kv * gqa
    G = len(group_lens_pages)
    sys = [(torch.randn(n * 16, h_kv, d, generator=g), torch.randn(n * 16, h_kv, d, generator=g))
           for n in group_lens_pages]
    k_cache, v_cache, table, _ = make_paged_cache([k for k, _ in sys], [v for _, v in sys], 16, dtype)
    n_tok = sum(tokens_per_group) + T_extra
    q = torch.randn(n_tok, hq, d, generator=g).to(dtype)
    out0 = torch.randn(n_tok, hq, d, generator=g).to(dtype)
    lse0 = torch.randn(hq, n_tok, generator=g) * 3
    order = torch.randperm(n_tok, generator=g)
    groups = np.full(n_tok, -1)
    pos = 0
    for gi, n in enumerate(tokens_per_group):
        groups[order[pos: pos + n].numpy()] = gi
        pos += n
    tokens = np.flatnonzero(groups >= 0)
    perm = tokens[np.argsort(groups[tokens], kind="stable")].astype(np.int32)
    cu = np.zeros(G + 1, dtype=np.int32)
    cu[1:] = np.cumsum(tokens_per_group)
    ref_out, ref_lse = out0.float().clone(), lse0.clone()
    scale = d ** -0.5
    for t in tokens:
        gi = groups[t]
        o, lse = attention_ref(q[t: t + 1], sys[gi][0].to(dtype), sys[gi][1].to(dtype), scale, causal=False)
        w = torch.softmax(torch.stack([lse[:, 0], lse0[:, t]]), dim=0)  # [2, Hq]
        ref_out[t] = w[0][:, None] * o[0] + w[1][:, None] * out0[t].float()
        ref_lse[:, t] = torch.logsumexp(torch.stack([lse[:, 0], lse0[:, t]]), dim=0)
    pages = table[:, : max(group_lens_pages)].contiguous()
    lens = torch.tensor([n * 16 for n in group_lens_pages], dtype=torch.int32)
    moved = dict(q=q, k_cache=k_cache, v_cache=v_cache, out=out0.clone(), lse=lse0.clone(),
                 perm=torch.from_numpy(perm), group_pages=pages, group_lens=lens)
    return {k: v.to(device) for k, v in moved.items()}, cu, scale, ref_out, ref_lse, tokens


@pytest.mark.parametrize("splits", [1, 3])
@pytest.mark.parametrize("gqa, d", [(1, 64), (4, 64), (8, 59)])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_matches_reference(splits, gqa, d, dtype):
    tensors, cu, scale, ref_out, ref_lse, tokens = case((5, 0, 9), (tile_tokens(gqa) + 3, 0, 2), 2, gqa, d,
                                                        dtype)
    tensors["group_pages"][1] = 0  # an absent group: no tokens, no pages
    num_tiles = max_tiles(int(cu[-1]) + 4, 3, gqa)
    tiles = torch.from_numpy(plan_tiles(cu, num_tiles, gqa))
    ws = workspace(num_tiles, 2, splits, d, "cpu")
    before = tensors["out"].clone()
    level_attention(**tensors, tiles=tiles, softmax_scale=scale, ws=ws, num_splits=splits, update_lse=True)
    untouched = np.setdiff1d(np.arange(before.shape[0]), tokens)
    assert torch.equal(tensors["out"][untouched], before[untouched])  # tokens not in the level
    torch.testing.assert_close(tensors["out"].float(), ref_out, **TOL[dtype])
    torch.testing.assert_close(tensors["lse"][:, tokens], ref_lse[:, tokens], atol=2e-3, rtol=2e-3)
    assert (ws[2] == 0).all()  # the counters reset themselves


@pytest.mark.parametrize("block_m, block_n", [(128, 32), (32, 128)])
def test_other_tiles_match_reference(block_m, block_n, monkeypatch):
    """The tile sizes tune_level.py (in git history) swept: planning and kernel follow them."""
    import vllm_relay.ops.level_attention as la

    monkeypatch.setattr(la, "BLOCK_M", block_m)
    monkeypatch.setattr(la, "BLOCK_N", block_n)
    gqa, d, splits = 4, 64, 2
    tensors, cu, scale, ref_out, ref_lse, tokens = case((5, 9), (tile_tokens(gqa) + 3, 2), 2, gqa, d, torch.float16)
    num_tiles = max_tiles(int(cu[-1]), 2, gqa)
    tiles = torch.from_numpy(plan_tiles(cu, num_tiles, gqa))
    assert int(tiles[:, 2].max()) == block_m // gqa
    ws = workspace(num_tiles, 2, splits, d, "cpu")
    level_attention(**tensors, tiles=tiles, softmax_scale=scale, ws=ws, num_splits=splits, update_lse=True)
    torch.testing.assert_close(tensors["out"].float(), ref_out, **TOL[torch.float16])
    torch.testing.assert_close(tensors["lse"][:, tokens], ref_lse[:, tokens], atol=2e-3, rtol=2e-3)


def test_torch_twin_and_no_rows():
    tensors, cu, scale, ref_out, ref_lse, tokens = case((3, 2), (5, 7), 2, 4, 32, torch.float32)
    tiles = torch.from_numpy(plan_tiles(cu, 6, 4))
    got = {k: v.clone() for k, v in tensors.items()}
    level_attention_torch(**got, tiles=tiles, softmax_scale=scale, update_lse=False)
    torch.testing.assert_close(got["out"], ref_out, **TOL[torch.float32])
    assert torch.equal(got["lse"], tensors["lse"])
    empty = torch.zeros(6, 3, dtype=torch.int32)
    ws = workspace(6, 2, 2, 32, "cpu")
    level_attention(**{k: v.clone() for k, v in tensors.items()} | {"out": tensors["out"]}, tiles=empty,
                    softmax_scale=scale, ws=ws, num_splits=2)
    assert torch.equal(tensors["out"], case((3, 2), (5, 7), 2, 4, 32, torch.float32)[0]["out"])


def test_plan_tiles():
    cu = np.array([0, 3, 3, 70])
    assert plan_tiles(cu, 6, 1).tolist() == [[0, 0, 3], [2, 3, 64], [2, 67, 3], [0, 0, 0], [0, 0, 0], [0, 0, 0]]
    assert plan_tiles(np.array([0, 40]), 4, 4).tolist() == [[0, 0, 16], [0, 16, 16], [0, 32, 8], [0, 0, 0]]
    with pytest.raises(ValueError, match="more than 1 tiles"):
        plan_tiles(np.array([0, 70]), 1, 1)


@pytest.mark.gpu
@pytest.mark.parametrize("splits", [1, 4])
@pytest.mark.parametrize("gqa", [1, 4])
def test_cuda(splits, gqa):
    tensors, cu, scale, ref_out, ref_lse, tokens = case((40, 3, 128), (130, 1, 70), 8 // gqa, gqa, 128,
                                                        torch.bfloat16, device="cuda")
    num_tiles = max_tiles(int(cu[-1]), 3, gqa)
    tiles = torch.from_numpy(plan_tiles(cu, num_tiles, gqa)).cuda()
    ws = workspace(num_tiles, 8 // gqa, splits, 128, "cuda")
    level_attention(**tensors, tiles=tiles, softmax_scale=scale, ws=ws, num_splits=splits, update_lse=True)
    torch.testing.assert_close(tensors["out"].float().cpu(), ref_out, **TOL[torch.bfloat16])
