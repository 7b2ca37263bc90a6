"""The torch twin of `window_level.py`'s kernel (the CPU path and the kernel's test twin), and the
arguments both refuse. Imports only torch."""

import torch

FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def _scale(softmax_scale, head_dim: int) -> float:
    return head_dim ** -0.5 if softmax_scale is None else float(softmax_scale)


def _out_dtype(q: torch.Tensor) -> torch.dtype:
    return torch.bfloat16 if q.dtype in FP8_DTYPES else q.dtype


def _scale_value(x) -> float:
    """A per-tensor scale's value on the host (the torch twin): its first element."""
    if x is None:
        return 1.0
    return float(x.reshape(-1)[0]) if isinstance(x, torch.Tensor) else float(x)


def _gather(cache: torch.Tensor, blocks: torch.Tensor) -> torch.Tensor:
    """The tokens of `blocks` of a paged cache, [len(blocks) * block_size, Hkv, D] (FP8 caches gathered as
    bytes: index_select has no FP8 kernels)."""
    if cache.dtype in FP8_DTYPES:
        return cache.view(torch.uint8).index_select(0, blocks).view(cache.dtype).flatten(0, 1)
    return cache.index_select(0, blocks).flatten(0, 1)


def _read(x: torch.Tensor, scale: float) -> torch.Tensor:
    """`x` in fp32, an FP8 tensor times its scale."""
    return x.float() * scale if x.dtype in FP8_DTYPES else x.float()


def window_level_attention_torch(q, k, v, cu_seqlens_q, seqused_k, block_table, key_start, max_seqlen_q,
                                 softmax_scale, out=None, causal=False, return_softmax_lse=True, softcap=0.0,
                                 k_descale=None, v_descale=None, q_descale=None, **ignored):
    """Torch implementation of `window_level_attention` (the CPU path and the kernel's test twin).

    Same arguments and results; in fp32, one group at a time, its keys gathered from the block table
    (the caches in any strides: vLLM's CPU cache views). Synchronizes with the host (it reads the lengths).
    """
    _check_args(q, k, v, cu_seqlens_q, seqused_k, block_table, key_start, out, causal, ignored,
                (q_descale, k_descale, v_descale), kernel=False)
    N, Hq, D = q.shape
    block_size, Hkv = k.shape[1], k.shape[2]
    group = Hq // Hkv
    if out is None:
        out = torch.zeros(q.shape, dtype=_out_dtype(q), device=q.device)
    lse = torch.full((Hq, N), float("-inf"), dtype=torch.float32, device=q.device)
    q_scale, k_scale, v_scale = (_scale_value(x) for x in (q_descale, k_descale, v_descale))
    cu, lens = cu_seqlens_q.tolist(), seqused_k.tolist()
    for g, k_len in enumerate(lens):
        r0, r1 = cu[g], cu[g + 1]
        if r1 <= r0:
            continue
        first = key_start[r0:r1].long()
        lo = max(int(first.min()), 0) // block_size * block_size  # keys before: seen by no row, never read
        if k_len <= lo:
            out[r0:r1] = 0
            continue
        blocks = block_table[g, lo // block_size: (k_len + block_size - 1) // block_size].long()
        kg = _read(_gather(k, blocks)[: k_len - lo], k_scale)  # keys lo .. k_len - 1: [K, Hkv, D]
        vg = _read(_gather(v, blocks)[: k_len - lo], v_scale)
        qg = _read(q[r0:r1], q_scale).reshape(r1 - r0, Hkv, group, D)
        s = torch.einsum("rhgd,khd->hgrk", qg, kg) * _scale(softmax_scale, D)  # [Hkv, group, R, K]
        if softcap:
            s = torch.tanh(s / softcap) * softcap
        keys = torch.arange(lo, k_len, device=q.device)
        s = s.masked_fill(keys[None, :] < first[:, None], float("-inf"))
        row_lse = torch.logsumexp(s, dim=-1)  # -inf for a row that sees no key
        p = torch.exp(s - row_lse.masked_fill(row_lse == float("-inf"), 0.0)[..., None])
        o = torch.einsum("hgrk,khd->rhgd", p, vg).reshape(r1 - r0, Hq, D)
        out[r0:r1] = o.to(out.dtype)
        lse[:, r0:r1] = row_lse.reshape(Hq, r1 - r0)
    return (out, lse) if return_softmax_lse else out


_REFUSED = ("alibi_slopes", "s_aux", "cu_seqlens_k")


def _check_args(q, k, v, cu_seqlens_q, seqused_k, block_table, key_start, out, causal, ignored,
                descales, kernel: bool = True) -> None:
    """What both implementations refuse; `kernel`: the Triton kernel's, which also needs the caches' last
    dim contiguous (the torch twin gathers any strides: vLLM's CPU cache views)."""
    name = "window_level_attention"
    if causal:
        raise NotImplementedError(f"{name}: causal=True (a level precedes its rows: non-causal only)")
    window = ignored.get("window_size")
    if window is not None and tuple(window) != (-1, -1):
        raise NotImplementedError(f"{name}: window_size={tuple(window)} (the window is each row's key_start)")
    for key in _REFUSED:
        if ignored.get(key) is not None:
            raise NotImplementedError(f"{name}: {key} is not supported")
    if q.dim() != 3 or k.dim() != 4 or k.shape != v.shape or k.shape[3] != q.shape[2]:
        raise ValueError(f"{name}: need q [N, Hq, D] and k, v [num_blocks, block_size, Hkv, D], got "
                         f"{tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    if q.shape[1] % k.shape[2]:
        raise ValueError(f"{name}: Hq={q.shape[1]} is not a multiple of Hkv={k.shape[2]}")
    if q.dtype in FP8_DTYPES:
        if descales[0] is None or k.dtype not in FP8_DTYPES:
            raise ValueError(f"{name}: FP8 queries need q_descale and an FP8 cache")
    elif q.dtype not in _FLOAT_DTYPES:
        raise ValueError(f"{name}: q must be fp16/bf16/fp32 (or FP8 with q_descale), got {q.dtype}")
    elif descales[0] is not None:
        raise ValueError(f"{name}: q_descale applies to FP8 queries only")
    if k.dtype != v.dtype or k.dtype not in (q.dtype, *FP8_DTYPES):
        raise ValueError(f"{name}: KV dtypes {k.dtype}, {v.dtype}: need q's ({q.dtype}) or one FP8 dtype")
    if k.dtype not in FP8_DTYPES and any(x is not None for x in descales[1:]):
        raise ValueError(f"{name}: k_descale / v_descale apply to an FP8 KV cache only")
    for x in descales:
        if isinstance(x, torch.Tensor) and (x.device != q.device or x.numel() == 0):
            raise ValueError(f"{name}: a scale tensor must hold a value on {q.device}, got "
                             f"{tuple(x.shape)} on {x.device}")
    for t, what in ((q, "q"), (k, "k"), (v, "v")) if kernel else ((q, "q"),):
        if t.stride(-1) != 1:
            raise ValueError(f"{name}: {what} must have a contiguous last dim")
    G = seqused_k.shape[0] if seqused_k.dim() == 1 else -1
    if cu_seqlens_q.shape != (G + 1,) or block_table.dim() != 2 or block_table.shape[0] < G:
        raise ValueError(f"{name}: need cu_seqlens_q [G + 1], seqused_k [G], block_table [G, W], got "
                         f"{tuple(cu_seqlens_q.shape)}, {tuple(seqused_k.shape)}, {tuple(block_table.shape)}")
    if key_start.dim() != 1 or key_start.shape[0] < q.shape[0]:
        raise ValueError(f"{name}: key_start must be [N] = [{q.shape[0]}], got {tuple(key_start.shape)}")
    for t, what in ((cu_seqlens_q, "cu_seqlens_q"), (seqused_k, "seqused_k"), (block_table, "block_table"),
                    (key_start, "key_start")):
        if t.dtype != torch.int32 or t.device != q.device:
            raise ValueError(f"{name}: {what} must be int32 on {q.device}, got {t.dtype} on {t.device}")
        if t.numel() > 1 and t.stride(-1) != 1:
            raise ValueError(f"{name}: {what} must have a contiguous last dim")
    if out is not None:
        dtype_ok = out.dtype in _FLOAT_DTYPES if q.dtype in FP8_DTYPES else out.dtype == q.dtype
        if out.shape != q.shape or out.stride(-1) != 1 or not dtype_ok:
            raise ValueError(f"{name}: out must be {tuple(q.shape)} in q's dtype (fp16/bf16/fp32 for FP8 "
                             f"queries) with a contiguous last dim, got {out.dtype} {tuple(out.shape)}")
