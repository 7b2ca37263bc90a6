"""The shared level of a sliding-window layer: a level's pages read once for all its rows, each row
from its own first visible key on.

A shared level is a run of KV pages several query rows read in common (`relay_attention.py`): group g
owns rows cu_seqlens_q[g]:cu_seqlens_q[g+1], and reads keys 0 .. seqused_k[g] - 1 of its block table
non-causally (every key of a level precedes every query that reads it). In a sliding-window layer of W
tokens the query at position p sees keys p - W + 1 .. p only, so a row sees a suffix of the level: its
first visible key is its position minus W plus one, relative to the level's first key (`key_start`,
`window_rows.py`). Below 0 the row sees the whole level, at or past its end none of it.

    row r of group g sees keys j with  key_start[r] <= j < seqused_k[g]

`window_level_attention` is FlashAttention's `flash_attn_varlen_func` as called for a level (paged,
non-causal, returning the natural-log LSE) with that one keyword more. Its Triton kernel packs the GQA
heads of one KV head and a few rows of one group into the M dimension of a tile, so each K/V tile is
loaded once for all of them; a program's key loop starts at the smallest first key of its rows (the
pages before it are never read: in a window layer's KV-cache group they may be freed, or the null
block) and ends at the group's last key. A row that sees no key gets out = 0 and lse = -inf
(FlashAttention-3's convention). A level of few rows is few programs, each over the whole window: where
they would leave the GPU idle, each program's keys are cut into ranges, a program each, merged by their
LSEs (`split_combine.py`; the launch rules: `window_launch.py`). `window_level_attention_torch` is its
torch twin (`window_level_torch.py`: the CPU path and the kernel's test twin), computed in fp32 from each
group's keys gathered explicitly.
"""

import torch
import triton
import triton.language as tl

from vllm_relay.ops import window_launch as launch
from vllm_relay.ops.interpreter import kernel_for, reduce_max, reduce_min, reduce_sum, runs_triton
from vllm_relay.ops.split_combine import combine_splits
from vllm_relay.ops.window_level_torch import _check_args, _out_dtype, _scale, window_level_attention_torch

# The metadata tensors are slices of the planner's persistent buffers starting at rows that move with
# the step (`prefix_table.py` says what a pointer's alignment costs): they are read an element at a time,
# so no pointer is specialized on its alignment and one compiled variant serves every step. Nor is the
# LSE's row stride, which is the step's row count: 1, a multiple of 16 or neither would each compile a
# variant of their own (as `fuse_in_place.py`'s LSE strides would), one of them first in some step after
# the engine's start. Nor is the group count: 1 in most eager steps' calls, a graph's capacity in its graphs.
_POINTERS = ["cu_ptr", "seqused_ptr", "bt_ptr", "key_start_ptr", "k_scale_ptr", "v_scale_ptr", "q_scale_ptr"]
_MOVING = ["stride_lh", "stride_bt", "stride_ps", "stride_pls", "stride_plh", "num_groups"]


@triton.jit
def _dot(a, b, PRECISION: tl.constexpr, IN_FP32: tl.constexpr):
    """a @ b with an fp32 accumulator. IN_FP32: with the operands' values in fp32 (exact from bf16): the
    interpreter multiplies bf16 operands as the integers that hold them (Triton 3.9)."""
    if IN_FP32:
        c = tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    else:
        c = tl.dot(a, b, input_precision=PRECISION)
    return c


@triton.jit
def _cumsum(x):
    return tl.associative_scan(x, 0, tl.standard._sum_combine)


@triton.jit
def _level_tile(
    g, row_lo, num_rows, kv_head, first_row, split, q_ptr, k_ptr, v_ptr, out_ptr, lse_ptr, seqused_ptr,
    bt_ptr, key_start_ptr, part_out_ptr, part_lse_ptr, q_scale, k_scale, v_scale, softmax_scale, softcap,
    stride_qt, stride_qh, stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
    stride_ot, stride_oh, stride_lh, stride_bt, stride_ps, stride_pt, stride_ph, stride_pls, stride_plh,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, SOFTCAP: tl.constexpr, DOT_PRECISION: tl.constexpr,
    DOT_IN_FP32: tl.constexpr, SPLITS: tl.constexpr, MIN_CHUNK: tl.constexpr,
):
    """Rows first_row .. first_row + ROWS - 1 of group g (its `num_rows` rows from row `row_lo`), the GROUP
    query heads of KV head `kv_head` each, over key range `split`; element m of the tile's M dimension is
    (row m // GROUP, head m % GROUP). A tile past its group's rows has no valid element: it reads no key and
    writes nothing."""
    ROWS: tl.constexpr = BLOCK_M // GROUP
    m = tl.arange(0, BLOCK_M)
    local = first_row + m // GROUP
    m_valid = (m < ROWS * GROUP) & (local < num_rows)
    row = (row_lo + local).to(tl.int64)
    head = (kv_head * GROUP + m % GROUP).to(tl.int64)
    d = tl.arange(0, BLOCK_D)
    d_mask = d < HEAD_DIM

    hi = tl.load(seqused_ptr + g)
    first = tl.load(key_start_ptr + row, mask=m_valid, other=0)
    first = tl.where(m_valid, first, hi)
    # Keys before the tile's smallest first key are seen by none of its rows: neither loaded nor looped.
    lo = tl.maximum(reduce_min(first, 0), 0)
    begin, end = (lo // BLOCK_N) * BLOCK_N, hi
    if SPLITS > 1:  # this program's range: tiles of keys from `begin`, alike but the last
        per = (tl.maximum(hi - begin, 0) + SPLITS - 1) // SPLITS  # (tl.cdiv: not in the interpreter's reach)
        chunk = tl.maximum((per + BLOCK_N - 1) // BLOCK_N * BLOCK_N, MIN_CHUNK)
        begin += split * chunk
        end = tl.minimum(hi, begin + chunk)

    CDT: tl.constexpr = out_ptr.dtype.element_ty  # the dot's inputs (FP8 values convert exactly)
    q = tl.load(q_ptr + row[:, None] * stride_qt + head[:, None] * stride_qh + d[None, :],
                mask=m_valid[:, None] & d_mask[None, :], other=0.0).to(CDT)
    qk_scale = softmax_scale * q_scale * k_scale

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)  # running max, log2 units
    l_i = tl.full([BLOCK_M], 0.0, tl.float32)
    acc = tl.full([BLOCK_M, BLOCK_D], 0.0, tl.float32)
    bt_row = bt_ptr + g.to(tl.int64) * stride_bt
    for start in range(begin, end, BLOCK_N):
        n = start + tl.arange(0, BLOCK_N)
        n_mask = (n >= lo) & (n < hi)  # table entries outside may be garbage: never followed
        blk = tl.load(bt_row + n // BLOCK_SIZE, mask=n_mask, other=0).to(tl.int64)
        slot = (n % BLOCK_SIZE).to(tl.int64)
        kv_mask = n_mask[None, :] & d_mask[:, None]
        k = tl.load(k_ptr + blk[None, :] * stride_kb + slot[None, :] * stride_ks + kv_head * stride_kh
                    + d[:, None], mask=kv_mask, other=0.0).to(CDT)  # [BLOCK_D, BLOCK_N]
        s = _dot(q, k, DOT_PRECISION, DOT_IN_FP32) * qk_scale
        if SOFTCAP:  # softcap * tanh(s / softcap), in a form that neither overflows nor cancels
            x = s / softcap
            e = tl.exp2(-2.0 * 1.4426950408889634 * tl.abs(x))
            t = (1.0 - e) / (1.0 + e)
            s = softcap * tl.where(x < 0, -t, t)
        s = s * 1.4426950408889634
        seen = (n[None, :] >= first[:, None]) & (n[None, :] < hi)
        s = tl.where(seen, s, float("-inf"))
        m_new = tl.maximum(m_i, reduce_max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # no key seen yet: avoid (-inf) - (-inf)
        p = tl.exp2(s - m_safe[:, None])
        alpha = tl.exp2(m_i - m_safe)
        l_i = l_i * alpha + reduce_sum(p, 1)
        v = tl.load(v_ptr + blk[:, None] * stride_vb + slot[:, None] * stride_vs + kv_head * stride_vh
                    + d[None, :], mask=n_mask[:, None] & d_mask[None, :], other=0.0).to(CDT)
        acc = acc * alpha[:, None] + _dot(p.to(CDT), v, DOT_PRECISION, DOT_IN_FP32)
        m_i = m_new

    seen_any = l_i > 0
    o = acc * (v_scale / tl.where(seen_any, l_i, 1.0))[:, None]
    lse = tl.where(seen_any, (m_i + tl.log2(tl.where(seen_any, l_i, 1.0))) * 0.6931471805599453,
                   float("-inf"))
    mask = m_valid[:, None] & d_mask[None, :]
    if SPLITS > 1:  # every range writes its partial, an empty one too (0, -inf)
        tl.store(part_out_ptr + split * stride_ps + row[:, None] * stride_pt + head[:, None] * stride_ph
                 + d[None, :], o, mask=mask)  # (the partials: well under 2**31 elements)
        tl.store(part_lse_ptr + split * stride_pls + head * stride_plh + row, lse, mask=m_valid)
    else:
        tl.store(out_ptr + row[:, None] * stride_ot + head[:, None] * stride_oh + d[None, :], o.to(CDT),
                 mask=mask)
        tl.store(lse_ptr + head * stride_lh + row, lse, mask=m_valid)


@triton.jit(do_not_specialize=_MOVING, do_not_specialize_on_alignment=_POINTERS)
def _window_level_kernel(
    q_ptr, k_ptr, v_ptr, out_ptr, lse_ptr, cu_ptr, seqused_ptr, bt_ptr, key_start_ptr,
    q_scale_ptr, k_scale_ptr, v_scale_ptr, part_out_ptr, part_lse_ptr,
    q_scale, k_scale, v_scale, softmax_scale, softcap,
    stride_qt, stride_qh, stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
    stride_ot, stride_oh, stride_lh, stride_bt, stride_ps, stride_pt, stride_ph, stride_pls, stride_plh,
    num_groups, num_kv_heads,
    GROUP: tl.constexpr,  # query heads per KV head
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,  # tokens a page
    BLOCK_M: tl.constexpr,  # (row, head) pairs a tile: ROWS rows x GROUP heads, padded
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    SCALES_ON_DEVICE: tl.constexpr,  # q/k/v scales read from their pointers (else the float arguments)
    SOFTCAP: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    DOT_IN_FP32: tl.constexpr,
    SPLITS: tl.constexpr,  # key ranges (> 1: partials into part_out / part_lse, merged after)
    MIN_CHUNK: tl.constexpr,  # keys a range holds, at least (a multiple of BLOCK_N)
    COMPACT: tl.constexpr,  # programs loop over the step's tiles (else one tile a program, by group)
    BLOCK_G: tl.constexpr,  # COMPACT: the groups, padded to a power of two
):
    ROWS: tl.constexpr = BLOCK_M // GROUP
    if SCALES_ON_DEVICE:  # per-tensor scales: the first element of each (an expanded view is fine)
        q_scale = tl.load(q_scale_ptr).to(tl.float32)
        k_scale = tl.load(k_scale_ptr).to(tl.float32)
        v_scale = tl.load(v_scale_ptr).to(tl.float32)
    if COMPACT:  # work item (tile t of the step, KV head, range), tiles numbered group by group
        gi = tl.arange(0, BLOCK_G)
        counts = tl.load(cu_ptr + gi + 1, mask=gi < num_groups, other=0)
        counts = (counts - tl.load(cu_ptr + gi, mask=gi < num_groups, other=0) + ROWS - 1) // ROWS
        ends = _cumsum(counts)  # tiles of groups 0 .. g
        items = reduce_sum(counts, 0) * num_kv_heads * SPLITS
        for item in range(tl.program_id(0), items, tl.num_programs(0)):
            t = item // (num_kv_heads * SPLITS)
            g = reduce_sum((ends <= t).to(tl.int32), 0)
            first_tile = reduce_sum(tl.where(gi == g, ends - counts, 0), 0)
            row_lo = tl.load(cu_ptr + g)
            _level_tile(g, row_lo, tl.load(cu_ptr + g + 1) - row_lo, (item // SPLITS) % num_kv_heads,
                        (t - first_tile) * ROWS, item % SPLITS,
                        q_ptr, k_ptr, v_ptr, out_ptr, lse_ptr, seqused_ptr, bt_ptr, key_start_ptr,
                        part_out_ptr, part_lse_ptr, q_scale, k_scale, v_scale, softmax_scale, softcap,
                        stride_qt, stride_qh, stride_kb, stride_ks, stride_kh, stride_vb, stride_vs,
                        stride_vh, stride_ot, stride_oh, stride_lh, stride_bt, stride_ps, stride_pt,
                        stride_ph, stride_pls, stride_plh, GROUP, HEAD_DIM, BLOCK_SIZE, BLOCK_M, BLOCK_N,
                        BLOCK_D, SOFTCAP, DOT_PRECISION, DOT_IN_FP32, SPLITS, MIN_CHUNK)
    else:  # program (g, kv head, tile x SPLITS + range)
        g = tl.program_id(0)
        first_row = (tl.program_id(2) // SPLITS) * ROWS
        row_lo = tl.load(cu_ptr + g)
        num_rows = tl.load(cu_ptr + g + 1) - row_lo
        if first_row >= num_rows:
            return
        _level_tile(g, row_lo, num_rows, tl.program_id(1), first_row, tl.program_id(2) % SPLITS,
                    q_ptr, k_ptr, v_ptr, out_ptr, lse_ptr, seqused_ptr, bt_ptr, key_start_ptr,
                    part_out_ptr, part_lse_ptr, q_scale, k_scale, v_scale, softmax_scale, softcap,
                    stride_qt, stride_qh, stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
                    stride_ot, stride_oh, stride_lh, stride_bt, stride_ps, stride_pt, stride_ph, stride_pls,
                    stride_plh, GROUP, HEAD_DIM, BLOCK_SIZE, BLOCK_M, BLOCK_N, BLOCK_D, SOFTCAP,
                    DOT_PRECISION, DOT_IN_FP32, SPLITS, MIN_CHUNK)


def window_level_attention(q, k, v, cu_seqlens_q, seqused_k, block_table, key_start, max_seqlen_q,
                           softmax_scale, out=None, causal=False, return_softmax_lse=True, softcap=0.0,
                           k_descale=None, v_descale=None, q_descale=None, **ignored):
    """Attention of groups of rows over their level's paged keys, each row from its first visible key on.

    FlashAttention's `flash_attn_varlen_func` keywords as a level is called with (pass them by keyword),
    plus `key_start`. Runs the Triton kernel on CUDA tensors (and on CPU ones under TRITON_INTERPRET=1),
    else the torch twin. No host synchronization: the launch can be captured in a CUDA graph.

    Args:
        q: [N, Hq, D] queries, fp16/bf16/fp32 (or FP8 with `q_descale`), last dim contiguous. Rows at or
            past cu_seqlens_q[G] may hold anything: they are neither read nor written.
        k, v: paged caches [num_blocks, block_size, Hkv, D] (FlashAttention's layout; any strides with a
            contiguous last dim), q's dtype or an FP8 cache (float8_e4m3fn / float8_e5m2) read as
            `value * k_descale` / `value * v_descale`. Query head h reads KV head h // (Hq // Hkv).
        cu_seqlens_q: int32 [G + 1]: group g owns rows cu_seqlens_q[g]:cu_seqlens_q[g+1].
        seqused_k: int32 [G]: the keys of group g (0: its rows see none).
        block_table: int32 [G, W]: key j of group g is in block block_table[g, j // block_size], at
            j % block_size. Entries for keys before the smallest key_start of the group's rows, or at
            or past seqused_k[g], may hold anything: they are never read.
        key_start: int32 [N] (or longer): row r's first visible key; <= 0 for all, >= seqused_k for none.
        max_seqlen_q: int, at least any group's rows (sizes the grid: fixed under a CUDA graph).
        softmax_scale: float.
        out: optional [N, Hq, D] output, written in place (rows past cu_seqlens_q[G] untouched); q's
            dtype (with FP8 queries: fp16/bf16/fp32, bf16 when allocated here).
        causal: must be False (a level precedes its rows).
        return_softmax_lse: also return the LSE.
        softcap: scores `softcap * tanh(s * softmax_scale / softcap)` (0: none), as FlashAttention.
        k_descale, v_descale, q_descale: per-tensor scales of an FP8 cache (and FP8 queries): a float, or
            a tensor holding one value (e.g. [G, Hkv] expanded from one), read on the device. q_descale
            is for FP8 queries only, scaling them as the cache's scales do.
        **ignored: FlashAttention's tuning keywords (fa_version, scheduler_metadata, num_splits), and
            max_seqlen_k, read as the most keys a row reads (a window's length: it bounds the key ranges
            a program's keys are cut into; None: unknown); `window_size` must be None or (-1, -1), and
            `alibi_slopes`, `s_aux`, `cu_seqlens_k` None (else NotImplementedError: the window is
            `key_start`).

    Returns:
        `out` [N, Hq, D], and with `return_softmax_lse` the natural-log LSE float32 [Hq, N] (allocated
        with -inf: rows past cu_seqlens_q[G] keep it). A row that sees no key: out 0, lse -inf.

    Example:
        >>> out, lse = window_level_attention(  # doctest: +SKIP
        ...     q=q_level, k=k_cache, v=v_cache, cu_seqlens_q=cu, seqused_k=lens, block_table=table,
        ...     key_start=first_keys, max_seqlen_q=rows, softmax_scale=0.088, causal=False)
    """
    _check_args(q, k, v, cu_seqlens_q, seqused_k, block_table, key_start, out, causal, ignored,
                (q_descale, k_descale, v_descale))
    if not runs_triton(q):
        return window_level_attention_torch(q=q, k=k, v=v, cu_seqlens_q=cu_seqlens_q, seqused_k=seqused_k,
                                            block_table=block_table, key_start=key_start,
                                            max_seqlen_q=max_seqlen_q, softmax_scale=softmax_scale, out=out,
                                            causal=causal, return_softmax_lse=return_softmax_lse,
                                            softcap=softcap, k_descale=k_descale, v_descale=v_descale,
                                            q_descale=q_descale)
    N, Hq, D = q.shape
    Hkv = k.shape[2]
    group = Hq // Hkv
    if out is None:
        out = torch.zeros(q.shape, dtype=_out_dtype(q), device=q.device)
    lse = torch.full((Hq, N), float("-inf"), dtype=torch.float32, device=q.device)
    G = seqused_k.shape[0]
    max_rows = int(max_seqlen_q)
    if G and max_rows > 0 and N:
        grid, consts = launch.launch(N, group, Hkv, D, G, max_rows, ignored.get("max_seqlen_k"),
                                     launch.sm_count(q.device))
        splits = consts["SPLITS"]
        scales = (q_descale, k_descale, v_descale)
        on_device = any(isinstance(x, torch.Tensor) for x in scales)
        ptrs = [_scale_tensor(x, q) for x in scales] if on_device else [cu_seqlens_q] * 3
        floats = [1.0] * 3 if on_device else [1.0 if x is None else float(x) for x in scales]
        kernel = kernel_for(_window_level_kernel, q)
        part_out, part_lse, part_strides = lse, lse, (0,) * 5  # (unread with one range)
        if splits > 1:  # the ranges' partials (graph memory under a capture), merged below
            part_out = torch.empty(splits, N, Hq, D, dtype=torch.float32, device=q.device)
            part_lse = torch.empty(splits, Hq, N, dtype=torch.float32, device=q.device)
            part_strides = (*part_out.stride()[:3], *part_lse.stride()[:2])
        kernel[grid](
            q, k, v, out, lse, cu_seqlens_q, seqused_k, block_table, key_start, *ptrs, part_out, part_lse,
            *floats, _scale(softmax_scale, D), float(softcap or 0.0),
            q.stride(0), q.stride(1), k.stride(0), k.stride(1), k.stride(2), v.stride(0), v.stride(1),
            v.stride(2), out.stride(0), out.stride(1), lse.stride(0), block_table.stride(0),
            *part_strides, G, Hkv,
            GROUP=group, HEAD_DIM=D, BLOCK_SIZE=k.shape[1], SCALES_ON_DEVICE=on_device, SOFTCAP=bool(softcap),
            DOT_PRECISION="ieee" if out.dtype == torch.float32 else "tf32",
            DOT_IN_FP32=not q.is_cuda and out.dtype == torch.bfloat16, **consts, num_stages=2)
        if splits > 1:
            combine_splits(part_out, part_lse, out, lse, cu_seqlens_q[:1], cu_seqlens_q[G:])
    return (out, lse) if return_softmax_lse else out


def _scale_tensor(x, like: torch.Tensor) -> torch.Tensor:
    """A scale as a tensor on the device whose first element is read (a float: a one-element tensor)."""
    if isinstance(x, torch.Tensor):
        return x
    return torch.full((1,), 1.0 if x is None else float(x), dtype=torch.float32, device=like.device)


def warm_up_window_level(q, k, v, out, max_rows: int, keys: int | None, softmax_scale: float,
                         softcap: float = 0.0, k_descale=None, v_descale=None, q_descale=None) -> int:
    """Compile every kernel variant a level call of one group and 1 to `max_rows` rows launches, reading at
    most `keys` keys a row, with q, k, v and out typed and laid out as the calls' (one row of `q` and `out`
    is used, the caches may hold one page): `launch.one_group_variants`.
    An eager step's prompt chunks can take a variant no CUDA graph's capture compiled (heads over 128
    with more than a few hundred rows take wider tiles): without this it is compiled in the first such
    step of a loaded server. Each variant runs once over a group of no rows, which reads and writes
    nothing. Returns the variants launched; a no-op off CUDA unless the kernel is interpreted."""
    if not runs_triton(q):
        return 0
    group, num_kv_heads, head_dim = q.shape[1] // k.shape[2], k.shape[2], q.shape[2]
    sms = launch.sm_count(q.device)
    variants = launch.one_group_variants(group, num_kv_heads, head_dim, max_rows, keys, sms)
    zeros = torch.zeros(2, dtype=torch.int32, device=q.device)
    for rows in variants.values():
        window_level_attention(q=q[:1], k=k, v=v, cu_seqlens_q=zeros, seqused_k=zeros[:1],
                               block_table=zeros[:1].view(1, 1), key_start=zeros[:1], max_seqlen_q=rows,
                               max_seqlen_k=keys, softmax_scale=softmax_scale, out=out[:1], softcap=softcap,
                               k_descale=k_descale, v_descale=v_descale, q_descale=q_descale)
    return len(variants)
