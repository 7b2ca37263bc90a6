"""ops/latent.py: a shared prefix of an MLA model read as a level (`relay_attention` over the latent cache,
keys the whole vector, values its first `rank` values) equals each request's dense latent attention over
[prefix ; its own tokens] in fp32, on odd shapes: decode rows and a prompt chunk, with the torch
varlen function and with a FlashAttention-style `q_v` function adapted by `latent_varlen`."""

import pytest
import torch

from tests.ops.reference import assert_close, attention_ref, cu_seqlens
from vllm_relay.ops import RelayPlan, SharedLevel, latent_varlen, relay_attention, varlen_attention_torch

RANK, ROPE, PAGE = 40, 8, 16


def fa_with_q_v(q, k, v, q_v, **kwargs):
    """FlashAttention's split MLA form (rotary q and k; latent `q_v` and v), computed by the torch
    varlen function on the joined vectors: score = q_v . v + q . k."""
    assert q.shape[-1] == k.shape[-1] == ROPE and q_v.shape[-1] == v.shape[-1] == RANK
    return varlen_attention_torch(q=torch.cat([q_v, q], -1), k=torch.cat([v, k], -1), v=v, **kwargs)


def case(heads: int, prefix_pages: int, own: list[int], q_lens: list[int], dtype, seed: int, rank=RANK, rope=ROPE,
         device="cpu"):
    """Queries [T, H, rank + rope], a shuffled latent cache [blocks, PAGE, 1, rank + rope], the prefix's
    pages, each request's own table and length (own tokens incl. this step's), and the fp32 reference."""
    g = torch.Generator().manual_seed(seed)
    own_pages = [-(-n // PAGE) for n in own]
    blocks = prefix_pages + sum(own_pages) + 3
    cache = torch.randn(blocks, PAGE, 1, rank + rope, generator=g).to(dtype)
    perm = torch.randperm(blocks, generator=g).to(torch.int32)
    prefix, rest = perm[:prefix_pages], perm[prefix_pages:]
    width = max(own_pages)
    table = torch.zeros(len(own), width, dtype=torch.int32)
    start = 0
    for b, n in enumerate(own_pages):
        table[b, :n] = rest[start: start + n]
        start += n
    q = torch.randn(sum(q_lens), heads, rank + rope, generator=g).to(dtype)
    scale = (128 + rope) ** -0.5
    cu = cu_seqlens(q_lens)
    ref = torch.zeros(q.shape[0], heads, rank)
    for b, n in enumerate(own):
        keys = cache[torch.cat([prefix, table[b, : own_pages[b]]]).long()].flatten(0, 1)[: prefix_pages * PAGE + n]
        rows = slice(int(cu[b]), int(cu[b + 1]))
        ref[rows], _ = attention_ref(q[rows], keys, keys[..., :rank], scale, causal=True)
    lens = torch.tensor(own, dtype=torch.int32)
    q, cache, prefix, table, lens = (x.to(device) for x in (q, cache, prefix, table, lens))
    return q, cache, prefix, (table, lens), scale, ref


def plan_with_level(q_lens, prefix, own, prefix_pages):
    """Every row reads the prefix as one level (one group, not causal); each request's own pages in context."""
    table, lens = own
    T, dev = sum(q_lens), table.device
    rows = torch.arange(T, dtype=torch.int32, device=dev)
    level = SharedLevel(perm=rows, row_index=rows.clone(),
                        call=dict(cu_seqlens_q=torch.tensor([0, T], dtype=torch.int32, device=dev),
                                  seqused_k=torch.tensor([prefix_pages * PAGE], dtype=torch.int32, device=dev),
                                  max_seqlen_q=T, max_seqlen_k=prefix_pages * PAGE, block_table=prefix[None].clone()))
    context = dict(cu_seqlens_q=cu_seqlens(q_lens).to(dev), seqused_k=lens, max_seqlen_q=max(q_lens),
                   max_seqlen_k=int(lens.max()), block_table=table)
    return RelayPlan(context=context, shared=[level])


@pytest.mark.parametrize("attn", ["torch", "q_v"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("heads,prefix_pages,own,q_lens", [
    (16, 5, [1, 17, 40, 3, 16], [1, 1, 1, 1, 1]),  # decode rows over a 80-token prefix
    (3, 2, [9, 33, 1], [1, 7, 1]),                  # a prompt chunk of 7 beside two decodes, odd heads
])
def test_a_latent_level_equals_dense_latent_attention(attn, dtype, heads, prefix_pages, own, q_lens):
    q, cache, prefix, own_kv, scale, ref = case(heads, prefix_pages, own, q_lens, dtype, seed=len(own) + heads)
    fn = varlen_attention_torch if attn == "torch" else latent_varlen(fa_with_q_v, RANK)
    out = torch.full((q.shape[0], heads, RANK), float("nan"), dtype=dtype)
    got = relay_attention(q, cache, cache[..., :RANK], plan_with_level(q_lens, prefix, own_kv, prefix_pages),
                          out, scale, fn)
    assert got is out
    assert_close(out, ref, dtype)
    # Without the level (each request's whole table in its context): the same, so the level is exact.
    table, lens = own_kv
    whole = torch.cat([prefix.expand(len(own), -1), table], dim=1)
    plain = RelayPlan(context=dict(cu_seqlens_q=cu_seqlens(q_lens), seqused_k=lens + prefix_pages * PAGE,
                                   max_seqlen_q=max(q_lens), max_seqlen_k=int(lens.max()) + prefix_pages * PAGE,
                                   block_table=whole))
    assert_close(relay_attention(q, cache, cache[..., :RANK], plain, torch.empty_like(out), scale, fn), ref, dtype)


def test_latent_varlen_refuses_shapes_that_are_not_a_latent_cache():
    cache = torch.zeros(2, PAGE, 1, RANK + ROPE)
    fn = latent_varlen(fa_with_q_v, RANK)
    with pytest.raises(ValueError, match="latent"):
        fn(q=torch.zeros(1, 2, RANK), k=cache, v=cache[..., :RANK])  # q without its rotary values
    with pytest.raises(ValueError, match="latent"):
        fn(q=torch.zeros(1, 2, RANK + ROPE), k=cache, v=cache[..., : RANK - 1])


@pytest.mark.gpu
@pytest.mark.parametrize("heads", [16, 128])
def test_a_latent_level_through_flash_attention_3_on_cuda(heads):
    """FlashAttention-3's MLA form (vLLM's FLASH_ATTN_MLA call: rotary 64, latent 512) reading a level."""
    pytest.importorskip("vllm")
    from vllm.vllm_flash_attn import flash_attn_varlen_func

    own, q_lens = [1, 70, 300, 16, 5, 129], [1, 1, 1, 1, 1, 1]
    q, cache, prefix, own_kv, scale, ref = case(heads, 9, own, q_lens, torch.bfloat16, seed=3, rank=512, rope=64,
                                                device="cuda")
    fn = latent_varlen(flash_attn_varlen_func, 512)
    out = torch.full((q.shape[0], heads, 512), float("nan"), dtype=q.dtype, device="cuda")
    relay_attention(q, cache, cache[..., :512], plan_with_level(q_lens, prefix, own_kv, 9), out, scale, fn,
                    attn_kwargs={"fa_version": 3})
    assert_close(out.cpu(), ref, torch.bfloat16)
