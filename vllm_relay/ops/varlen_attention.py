"""Paged variable-length attention in torch: a drop-in for FlashAttention's `flash_attn_varlen_func`.

It serves as the CPU backend's attention and as the `attn_fn` of `relay_attention` in CPU tests.
It has no Triton kernel: on CUDA the backend passes vLLM's FlashAttention itself.
"""

import torch

# Scores of one query chunk are [chunk, Hq, K] fp32; the chunk is sized to keep them under ~64 MiB.
_MAX_SCORE_ELEMS = 1 << 24
# Decode rows run batched, their KV gathered padded to the longest: [rows, K, Hkv, D] fp32 each.
_MAX_KV_ELEMS = 1 << 24


FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)


class _Fp8Cache:
    """An FP8 paged cache and its scale: `index_select` gathers its bytes and reads them in fp32."""

    def __init__(self, cache: torch.Tensor, scale: float) -> None:
        self.bytes, self.fp8, self.shape = cache.view(torch.uint8), cache.dtype, cache.shape
        self.scale = scale

    def index_select(self, dim: int, index: torch.Tensor) -> torch.Tensor:
        return self.bytes.index_select(dim, index).view(self.fp8).float() * self.scale


def _descale(x, name: str) -> float:
    """A per-tensor scale given as a float or as a tensor of one value (possibly expanded)."""
    if x is None:
        return 1.0
    if not isinstance(x, torch.Tensor):
        return float(x)
    values = x.reshape(-1).float()
    if values.numel() > 0 and bool((values == values[0]).all()):
        return float(values[0])
    raise NotImplementedError(f"varlen_attention_torch: {name} must be one scale for the whole cache, got a "
                              f"tensor of {tuple(x.shape)} with distinct entries")


def _logsumexp(s: torch.Tensor, sinks: torch.Tensor | None) -> torch.Tensor:
    """Each row's LSE over its scores `s` [..., K] (-inf for a row that sees no key) and, with
    `sinks` (broadcast to s[..., 0]), over its sink's logit too."""
    lse = torch.logsumexp(s, dim=-1)
    return lse if sinks is None else torch.logaddexp(lse, sinks.expand_as(lse))


def _cap(s: torch.Tensor, softcap: float) -> torch.Tensor:
    """Soft-capped scores, as FlashAttention applies `softcap` (after the softmax scale)."""
    return s if not softcap else torch.tanh(s / softcap) * softcap


def _gather_kv(cache, blocks: torch.Tensor, k_len: int) -> torch.Tensor:
    """First `k_len` tokens of a request from a paged cache [num_blocks, block_size, Hkv, D], in fp32."""
    return cache.index_select(0, blocks).flatten(0, 1)[:k_len].float()


def varlen_attention_torch(q, k_cache=None, v_cache=None, cu_seqlens_q=None, seqused_k=None,
                           max_seqlen_q=None, max_seqlen_k=None, softmax_scale=None, causal=False,
                           block_table=None, out=None, return_softmax_lse=False, **kwargs):
    """Paged varlen attention with `flash_attn_varlen_func`'s keywords and semantics, in torch.

    Pass arguments by keyword. FlashAttention's names `k=` and `v=` are accepted for `k_cache` and
    `v_cache`; FlashAttention-only tuning keywords (fa_version, scheduler_metadata, num_splits,
    q_descale left None, ...) are accepted and ignored. Features that would change the result and are
    not computed here (ALiBi, non-paged `cu_seqlens_k`, a window that is not causal) raise
    NotImplementedError.

    Args:
        q: queries, shape [Tq, Hq, D], fp16/bf16/fp32, last dim contiguous.
        k_cache, v_cache: paged caches, shape [num_blocks, block_size, Hkv, D] and [..., Hkv, Dv]
            (FlashAttention's layout; non-contiguous views allowed; Dv may differ from D, as MLA's
            latent cache read as keys of 576 values and values of their first 512), q's dtype, or an FP8 KV cache (float8_e4m3fn or
            float8_e5m2) read as `value * k_descale` / `value * v_descale`. Query head h reads KV
            head h // (Hq // Hkv).
        cu_seqlens_q: int32 [B + 1], request b owns query rows cu_seqlens_q[b]:cu_seqlens_q[b+1].
        seqused_k: int32 [B], number of KV tokens of request b, read through `block_table`.
        max_seqlen_q, max_seqlen_k: ints, accepted for compatibility (not needed here).
        softmax_scale: float, defaults to D ** -0.5.
        causal: bottom-right aligned: query i of a request with L queries and K keys sees keys
            j <= K - L + i.
        block_table: int32 [B, max_blocks], physical block ids of each request.
        out: optional output [Tq, Hq, Dv] in q's dtype; rows outside cu_seqlens_q are left as is.
        return_softmax_lse: also return the natural-log LSE, float32 [Hq, Tq].
        k_descale, v_descale: the FP8 cache's per-tensor scales: a float, or a tensor holding one
            value (FlashAttention's [B, Hkv] expanded from one); 1.0 when None.
        softcap: logit soft-capping, scores `softcap * tanh(s / softcap)` (0: none), as FlashAttention.
        s_aux: attention sinks, one logit per query head [Hq]: a key every row sees that has no value
            (FlashAttention's `s_aux`): it joins each row's softmax denominator and its LSE.
        window_size: FlashAttention's (left, right) sliding window, with `causal` only: query i also sees
            no key before K - L + i - left (None or left -1: no window). (A window layer's shared level,
            each row from its own first key, is `window_level_attention_torch`'s.)

    Returns:
        `out` [Tq, Hq, Dv] in q's dtype, or `(out, lse)` with `return_softmax_lse`. Computed in fp32.
        A row that sees no key (seqused_k == 0, or masked out by causality) gives out = 0 and
        lse = -inf (FlashAttention-3's convention), or its sink's logit with `s_aux`.

    Example:
        >>> o, lse = varlen_attention_torch(  # doctest: +SKIP
        ...     q=q, k=k_cache, v=v_cache, cu_seqlens_q=cu, seqused_k=kl,
        ...     max_seqlen_q=mq, max_seqlen_k=mk, softmax_scale=0.088, causal=True,
        ...     block_table=bt, return_softmax_lse=True)
    """
    k_cache = kwargs.pop("k", None) if k_cache is None else k_cache
    v_cache = kwargs.pop("v", None) if v_cache is None else v_cache
    descale = tuple(_descale(kwargs.pop(name, None), name) for name in ("k_descale", "v_descale"))
    softcap = float(kwargs.pop("softcap", 0) or 0)
    sinks = kwargs.pop("s_aux", None)
    left = _window_left(kwargs.pop("window_size", None), causal)
    _check_unsupported(kwargs)
    _check_args(q, k_cache, v_cache, cu_seqlens_q, seqused_k, block_table, out)
    if k_cache.dtype in FP8_DTYPES:  # gathered as bytes (index_select has no float8 kernels), read scaled
        kv = (_Fp8Cache(k_cache, descale[0]), _Fp8Cache(v_cache, descale[1]))
    elif descale != (1.0, 1.0):
        raise ValueError("varlen_attention_torch: k_descale / v_descale apply to an FP8 KV cache only")
    else:
        kv = (k_cache, v_cache)
    T, Hq, D = q.shape
    Hkv, Dv = k_cache.shape[2], v_cache.shape[3]
    group = Hq // Hkv
    scale = D ** -0.5 if softmax_scale is None else float(softmax_scale)
    if sinks is not None:
        if sinks.shape != (Hq,):
            raise ValueError(f"varlen_attention_torch: s_aux must be [Hq] = [{Hq}], got {tuple(sinks.shape)}")
        sinks = sinks.float().view(Hkv, group)
    if out is None:
        out = q.new_zeros(T, Hq, Dv)
    lse = torch.full((Hq, T), float("-inf"), dtype=torch.float32, device=q.device)

    cu = cu_seqlens_q.tolist()
    k_lens = seqused_k.tolist()
    block_size = k_cache.shape[1]
    # One query and some keys (decode): all such requests at once; the others one by one.
    decode = [b for b, k_len in enumerate(k_lens) if cu[b + 1] - cu[b] == 1 and k_len > 0]
    first = _first_keys(cu, k_lens, left, q.device)  # [Tq] or None
    if len(decode) > 1:
        _decode_batch(q, *kv, decode, cu, k_lens, block_table, scale, softcap, sinks, out, lse, first)
    else:
        decode = []
    batched = set(decode)
    for b, k_len in enumerate(k_lens):
        q_start, q_end = cu[b], cu[b + 1]
        q_len = q_end - q_start
        if q_len <= 0 or b in batched:
            continue
        if k_len <= 0:
            out[q_start:q_end] = 0
            if sinks is not None:
                lse[:, q_start:q_end] = sinks.reshape(Hq, 1)
            continue
        blocks = block_table[b, : (k_len + block_size - 1) // block_size].long()
        k = _gather_kv(kv[0], blocks, k_len)  # [K, Hkv, D] fp32
        v = _gather_kv(kv[1], blocks, k_len)
        chunk = max(1, _MAX_SCORE_ELEMS // (Hq * k_len))
        for c0 in range(0, q_len, chunk):
            c1 = min(q_len, c0 + chunk)
            qc = q[q_start + c0: q_start + c1].float().reshape(c1 - c0, Hkv, group, D)
            s = _cap(torch.einsum("qhgd,khd->hgqk", qc, k) * scale, softcap)  # [Hkv, g, C, K]
            keys = torch.arange(k_len, device=q.device)[None, :]
            if causal:
                rows = torch.arange(c0, c1, device=q.device)[:, None] + (k_len - q_len)
                s = s.masked_fill(keys > rows, float("-inf"))
            if first is not None:
                s = s.masked_fill(keys < first[q_start + c0: q_start + c1, None], float("-inf"))
            row_lse = _logsumexp(s, None if sinks is None else sinks[:, :, None])  # [Hkv, g, C]
            p = torch.exp(s - row_lse.masked_fill(row_lse == float("-inf"), 0.0)[..., None])
            o = torch.einsum("hgqk,khd->qhgd", p, v).reshape(c1 - c0, Hq, Dv)
            out[q_start + c0: q_start + c1] = o.to(out.dtype)
            lse[:, q_start + c0: q_start + c1] = row_lse.reshape(Hq, c1 - c0)
    return (out, lse) if return_softmax_lse else out


def _gather_blocks(k_cache, v_cache, table, k_len):
    """The first `k_len` tokens of the blocks in `table` [n, W]: K and V, [n, k_len, Hkv, D or Dv], fp32."""
    n, w = table.shape
    bs, Hkv, D = k_cache.shape[1:]
    k = k_cache.index_select(0, table.flatten()).view(n, w * bs, Hkv, D)[:, :k_len].float()
    v = v_cache.index_select(0, table.flatten()).view(n, w * bs, Hkv, v_cache.shape[3])[:, :k_len].float()
    return k, v


def _decode_batch(q, k_cache, v_cache, reqs, cu, k_lens, block_table, scale, softcap, sinks, out, lse,
                  first=None) -> None:
    """Requests `reqs`, one query each (its keys from `first`'s on, else all), as batched matmuls over their KV
    gathered padded to the longest of a chunk (the padding masked): a few torch calls per chunk
    instead of a few per request. Chunks hold requests of similar lengths, within the limits."""
    block_size, Hkv, D = k_cache.shape[1], k_cache.shape[2], k_cache.shape[3]
    Hq = q.shape[1]
    by_len = sorted(reqs, key=lambda b: k_lens[b])
    i = 0
    while i < len(by_len):
        j = i + 1  # grow the chunk while its longest request keeps it within the limits
        while j < len(by_len):
            n, k_max = j - i + 1, k_lens[by_len[j]]
            if n * Hq * k_max > _MAX_SCORE_ELEMS or n * k_max * Hkv * D > _MAX_KV_ELEMS:
                break
            j += 1
        chunk, k_max = by_len[i:j], k_lens[by_len[j - 1]]
        n = len(chunk)
        rows = torch.tensor([cu[b] for b in chunk], device=q.device)
        used = torch.tensor([k_lens[b] for b in chunk], device=q.device)
        n_blocks = (k_max + block_size - 1) // block_size
        table = block_table[torch.tensor(chunk, device=q.device), :n_blocks]
        table = table.long().clamp(min=0)  # entries past a request's blocks: any block, masked below
        k, v = _gather_blocks(k_cache, v_cache, table, k_max)  # [n, K, Hkv, D] each
        qc = q[rows].float().reshape(n, Hkv, Hq // Hkv, D)
        # Per KV head: batched matmuls over strided views of the gathered blocks (no permuted copy).
        s = torch.stack([torch.bmm(qc[:, h], k[:, :, h].transpose(1, 2)) for h in range(Hkv)], 1)
        s = _cap(s * scale, softcap)
        keys = torch.arange(k_max, device=q.device)[None, :]
        pad = keys >= used[:, None]
        if first is not None:
            pad |= keys < first[rows][:, None]
        s = s.masked_fill(pad[:, None, None, :], float("-inf"))  # [n, Hkv, g, K]
        row_lse = _logsumexp(s, sinks)  # [n, Hkv, g]: -inf for a row that sees no key
        p = torch.exp(s - row_lse.masked_fill(row_lse == float("-inf"), 0.0)[..., None])
        o = torch.stack([torch.bmm(p[:, h], v[:, :, h]) for h in range(Hkv)], 1)  # [n, Hkv, g, D]
        out[rows] = o.reshape(n, Hq, v.shape[-1]).to(out.dtype)
        lse[:, rows] = row_lse.reshape(n, Hq).T
        i = j


def _window_left(window, causal: bool) -> int:
    """The keys a query sees before itself (-1: all), from FlashAttention's `window_size`."""
    if window is None or tuple(window) == (-1, -1):
        return -1
    left, right = (int(x) for x in window)
    if not causal or left < 0 or right not in (0, -1):
        raise NotImplementedError(f"varlen_attention_torch: window_size={tuple(window)} with causal={causal} "
                                  "(a causal window (left, 0) only)")
    return left


def _first_keys(cu, k_lens, left: int, device) -> torch.Tensor | None:
    """Each query row's first visible key [Tq] under a causal sliding window of `left` keys before the
    query, or None when every row sees its keys from the first. Query t of request b sees keys up to
    k_len - (cu[b + 1] - t) (bottom-right causal)."""
    if left < 0:
        return None
    ends = torch.tensor([k_len - cu[b + 1] for b, k_len in enumerate(k_lens)], device=device)
    last = torch.arange(cu[-1], device=device) + ends.repeat_interleave(torch.tensor(cu).diff().to(device))
    return (last - left).clamp(min=0)


_IGNORED_NONE = ("alibi_slopes", "cu_seqlens_k", "q_v", "q_descale", "mask_mod", "aux_tensors",
                 "dynamic_causal", "output_scale", "key_start")


def _check_unsupported(kwargs: dict) -> None:
    for name in _IGNORED_NONE:
        if kwargs.get(name) is not None:
            raise NotImplementedError(f"varlen_attention_torch: {name} is not supported")
    if kwargs.get("dropout_p"):
        raise NotImplementedError("varlen_attention_torch: dropout_p is not supported")


def _check_args(q, k_cache, v_cache, cu_seqlens_q, seqused_k, block_table, out) -> None:
    for name, x in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache), ("cu_seqlens_q", cu_seqlens_q),
                    ("seqused_k", seqused_k), ("block_table", block_table)):
        if not isinstance(x, torch.Tensor):
            raise ValueError(f"varlen_attention_torch: {name} is required (a tensor), got {type(x).__name__}")
    if q.dim() != 3:
        raise ValueError(f"varlen_attention_torch: q must be [Tq, Hq, D], got {tuple(q.shape)}")
    if k_cache.dim() != 4 or v_cache.dim() != 4 or k_cache.shape[:3] != v_cache.shape[:3]:
        raise ValueError("varlen_attention_torch: k_cache and v_cache must be [num_blocks, block_size, "
                         f"Hkv, D] and [..., Hkv, Dv], got {tuple(k_cache.shape)} and {tuple(v_cache.shape)}")
    if k_cache.shape[3] != q.shape[2]:
        raise ValueError(f"varlen_attention_torch: head size of k_cache ({k_cache.shape[3]}) != q's "
                         f"({q.shape[2]})")
    if q.shape[1] % k_cache.shape[2] != 0:
        raise ValueError(f"varlen_attention_torch: Hq={q.shape[1]} is not a multiple of "
                         f"Hkv={k_cache.shape[2]}")
    if k_cache.dtype != v_cache.dtype or k_cache.dtype not in (q.dtype, *FP8_DTYPES):
        raise ValueError(f"varlen_attention_torch: KV dtypes {k_cache.dtype}, {v_cache.dtype}: need q's "
                         f"({q.dtype}) or one FP8 dtype for both")
    if cu_seqlens_q.dim() != 1 or seqused_k.shape != (cu_seqlens_q.shape[0] - 1,):
        raise ValueError(f"varlen_attention_torch: need cu_seqlens_q [B+1] and seqused_k [B], got "
                         f"{tuple(cu_seqlens_q.shape)} and {tuple(seqused_k.shape)}")
    if block_table.dim() != 2 or block_table.shape[0] < seqused_k.shape[0]:
        raise ValueError(f"varlen_attention_torch: block_table must be [B, max_blocks], got "
                         f"{tuple(block_table.shape)} for B={seqused_k.shape[0]}")
    want = (*q.shape[:2], v_cache.shape[3])
    if out is not None and (tuple(out.shape) != want or out.dtype != q.dtype):
        raise ValueError(f"varlen_attention_torch: out must be {q.dtype} {want}, got "
                         f"{out.dtype} {tuple(out.shape)}")
