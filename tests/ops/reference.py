"""Independent fp32 references and input builders for the ops tests.

Nothing here imports vllm_relay: the references are written from the math, over K/V that are
explicitly concatenated, so a bug shared by an op and its own torch twin still shows.
"""

import os

import torch

# Per-dtype (atol, rtol) for outputs compared with an fp32 reference. The low-precision rows cover
# the rounding of inputs/partials to the dtype (fusion and relay round twice) plus one extra ulp:
# Triton's interpreter converts fp32 -> bf16 by truncation, not round-to-nearest.
TOL = {
    torch.float32: dict(atol=2e-5, rtol=2e-5),
    torch.float16: dict(atol=2e-3, rtol=2e-3),
    torch.bfloat16: dict(atol=1.6e-2, rtol=1.6e-2),
}
DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def interpreter_on() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def assert_close(actual, expected, dtype, msg=""):
    """Elementwise check (every element, never a mean) against an fp32 reference."""
    torch.testing.assert_close(actual.float().cpu(), expected.float().cpu(), **TOL[dtype], msg=msg or None)


def on_grid(x, scale, fp8=torch.float8_e4m3fn):
    """`x` moved to the nearest value an FP8 cache of this dtype and scale holds, in fp32 (exact:
    the FP8 value times the scale)."""
    return (x.float() / scale).to(fp8).float() * scale


def fusion_ref(o_sys, lse_sys, o_ctx, lse_ctx):
    """Exact merge in float64 for finite LSEs: softmax weights over the two parts.

    o_*: [T, H, D]; lse_*: [T, H] (natural log). Returns (out float64 [T, H, D], lse float64 [T, H]).
    """
    lse = torch.stack([lse_sys.double(), lse_ctx.double()])  # [2, T, H]
    w = torch.softmax(lse, dim=0)[..., None]
    out = w[0] * o_sys.double() + w[1] * o_ctx.double()
    return out, torch.logsumexp(lse, dim=0)


def attention_ref(q, k, v, scale, causal, softcap=0.0, sinks=None, first=None):
    """Dense attention of one sequence in fp32, one head at a time.

    q: [L, Hq, D]; k: [K, Hkv, D]; v: [K, Hkv, Dv] (Dv may differ from D: MLA's latent values). Causal is bottom-right aligned: query i sees keys
    j <= K - L + i. `first` (int [L]): query i sees no key before first[i] either (a sliding window).
    Rows that see no key give o = 0, lse = -inf. `softcap` > 0 caps the scaled
    scores to softcap * tanh(s / softcap). `sinks` [Hq]: each head's sink, one more logit in every
    row's softmax with a zero value (a row that sees no key then has lse = its sink).
    Returns (o float32 [L, Hq, Dv], lse float32 [Hq, L]).
    """
    L, Hq, _ = q.shape
    K, Hkv, D = k.shape[0], k.shape[1], v.shape[2]
    o = torch.zeros(L, Hq, D)
    lse = torch.full((Hq, L), float("-inf"))
    if K == 0:
        return o, lse if sinks is None else sinks.float()[:, None].expand(Hq, L).clone()
    allowed = torch.ones(L, K, dtype=torch.bool)
    if causal:
        allowed = torch.arange(K)[None, :] <= (torch.arange(L)[:, None] + K - L)
    if first is not None:
        allowed = allowed & (torch.arange(K)[None, :] >= torch.as_tensor(first).long()[:, None])
    for h in range(Hq):
        kh = k[:, h * Hkv // Hq].float()
        vh = v[:, h * Hkv // Hq].float()
        s = (q[:, h].float() @ kh.T) * scale
        if softcap:
            s = softcap * torch.tanh(s / softcap)
        s = s.masked_fill(~allowed, float("-inf"))
        if sinks is not None:  # the sink: one more column of scores, its value a zero row
            s = torch.cat([s, torch.full((L, 1), float(sinks[h]))], dim=1)
            vh = torch.cat([vh, torch.zeros(1, D)])
        m = s.max(dim=1, keepdim=True).values
        m = torch.where(m == float("-inf"), 0.0, m)
        p = torch.exp(s - m)
        denom = p.sum(dim=1, keepdim=True)
        o[:, h] = (p @ vh) / denom.clamp_min(1e-30)
        lse[h] = torch.where(denom[:, 0] > 0, torch.log(denom[:, 0]) + m[:, 0], float("-inf"))
    return o, lse


def make_paged_cache(ks, vs, block_size, dtype, extra_blocks=3):
    """Scatter per-request K/V into a FlashAttention-layout paged cache with shuffled blocks.

    ks, vs: lists of [K_b, Hkv, D] tensors. The cache is allocated as vLLM's FlashAttention does,
    [num_blocks, block_size, Hkv, 2*D] with K and V packed in the last dim, so k_cache and v_cache
    are non-contiguous views [num_blocks, block_size, Hkv, D]. Unused slots hold random garbage.
    Returns (k_cache, v_cache, block_table int32 [B, max_blocks], seqused_k int32 [B]).
    """
    Hkv, D = ks[0].shape[1], ks[0].shape[2]
    nblk = [(k.shape[0] + block_size - 1) // block_size for k in ks]
    total = sum(nblk) + extra_blocks
    packed = torch.randn(total, block_size, Hkv, 2 * D).to(dtype)
    k_cache, v_cache = packed[..., :D], packed[..., D:]
    ids = torch.randperm(total)
    max_blocks = max(max(nblk), 1)
    # Unused table entries point at a random (garbage) block, as stale tables would.
    table = torch.randint(0, total, (len(ks), max_blocks), dtype=torch.int32)
    scatter_blocks(k_cache, v_cache, ks, vs, ids, table)
    seqused = torch.tensor([k.shape[0] for k in ks], dtype=torch.int32)
    return k_cache, v_cache, table, seqused


def cache_to(k_cache, v_cache, device):
    """The two halves of a packed cache (`make_paged_cache`'s) on `device`, still the halves of one tensor:
    `.to()` of a view with gaps between its rows copies it contiguous, and a GPU test would then never see
    the cache's strides."""
    packed = torch.cat([k_cache, v_cache], dim=-1).to(device)
    return packed[..., : k_cache.shape[-1]], packed[..., k_cache.shape[-1]:]


def scatter_blocks(k_cache, v_cache, ks, vs, ids, table, scales=(1.0, 1.0)) -> None:
    """Request b's K/V ([K_b, Hkv, D] each) into the next ceil(K_b / block_size) blocks of `ids`, in order,
    recorded in `table[b]`; values divided by `scales` (an FP8 cache's) and cast to the cache's dtype."""
    block_size, pos = k_cache.shape[1], 0
    for b, (k, v) in enumerate(zip(ks, vs, strict=True)):
        n = (k.shape[0] + block_size - 1) // block_size
        mine = ids[pos: pos + n]
        pos += n
        table[b, :n] = mine.int()
        for i, blk in enumerate(mine.tolist()):
            lo, hi = i * block_size, min(k.shape[0], (i + 1) * block_size)
            k_cache[blk, : hi - lo] = (k[lo:hi] / scales[0]).to(k_cache.dtype)
            v_cache[blk, : hi - lo] = (v[lo:hi] / scales[1]).to(v_cache.dtype)


def cu_seqlens(lens):
    out = torch.zeros(len(lens) + 1, dtype=torch.int32)
    out[1:] = torch.tensor(lens, dtype=torch.int32).cumsum(0)
    return out
