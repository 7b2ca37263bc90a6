"""MLA's latent attention in `relay_attention`'s terms: keys the whole latent vector, values its first part.

DeepSeek's multi-head latent attention (MLA) caches one vector a token: `rank` latent values (512) and
`rope` rotary ones (64). On decode each query head is absorbed into that space (its `rank` values times
the up-projection, then its own `rope` values), and attends to the cache as MQA with one KV head whose
key is the whole vector and whose value is its first `rank` values: score = q[:rank] . c[:rank] +
q[rank:] . c[rank:], output in the latent space (vLLM up-projects it after attention). So a shared
prefix of an MLA model is a level like any other: `relay_attention(q, cache, cache[..., :rank], plan,
out, scale, attn_fn)` with q [T, H, rank + rope], the cache [blocks, page, 1, rank + rope] and out
[T, H, rank]; the levels' outputs and LSEs merge in the latent space, before the up-projection (linear,
so it commutes with the merge's weighted sum).

`varlen_attention_torch` takes these shapes as they are (values narrower than keys). FlashAttention-3
takes MLA's split form instead, the rotary part as q and k and the latent part as `q_v` and v (vLLM's
FLASH_ATTN_MLA backend): `latent_varlen` adapts a function of that form to the one above.
"""

from __future__ import annotations


def latent_varlen(fa_varlen, rank: int):
    """`fa_varlen` (FlashAttention's varlen function with `q_v`, as vLLM's FLASH_ATTN_MLA calls it) as a
    varlen function of whole latent keys: called with q [T, H, rank + rope], k the latent cache [blocks,
    page, 1, rank + rope] and v its first `rank` values, it calls `fa_varlen(q=q[..., rank:], k=k[...,
    rank:], v=v, q_v=q[..., :rank], ...)` (views: no copy), every other keyword as given."""

    def call(q, k, v, **kwargs):
        if q.shape[-1] != k.shape[-1] or v.shape[-1] != rank or k.shape[-1] <= rank:
            raise ValueError(f"latent_varlen: q and k must hold {rank} latent values and the rotary ones, "
                             f"v the latent ones: got q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}")
        return fa_varlen(q=q[..., rank:], k=k[..., rank:], v=v, q_v=q[..., :rank], **kwargs)

    return call
