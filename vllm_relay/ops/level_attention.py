"""A shared level in one launch: grouped attention over a group's pages, merged into the output.

`relay_attention`'s generic level runs three kernels or more (gather the level's queries, a
FlashAttention call, relay_fusion), and inside a CUDA graph pays their launches even for a level
with no rows. `level_attention` does it all in one Triton kernel: each program takes a tile of a
group's rows (tokens x the query heads of one KV head, gathered through `perm`), one KV head and
one slice of the group's keys (split-K), runs the online softmax over the group's pages, and the
last program of a tile to finish merges every slice and the running output by their LSEs
(an atomic counter orders them; it resets itself). Tiles with no rows exit at once.

Tiles are planned on the host once per step (`plan_tiles`): (group, first row, rows) each, at most
`tile_tokens` tokens, never spanning two groups; unused tiles have 0 rows.
"""

import os

import numpy as np
import torch
import triton
import triton.language as tl

from vllm_relay.ops.relay_fusion import _interpreted, relay_fusion_torch
from vllm_relay.ops.varlen_attention import varlen_attention_torch

# The tile: read at call time, so that a tuning script can sweep it (tune_level.py, in git history;
# planners made after a change plan tiles and workspaces for the new BLOCK_M).
BLOCK_M = 64  # query rows per program: tile tokens x query heads per KV head
BLOCK_N = 64  # keys per iteration (whole pages of 16)
NUM_WARPS = 4
NUM_STAGES = 2


def tile_tokens(gqa: int) -> int:
    """Tokens per tile for `gqa` query heads per KV head."""
    return max(1, BLOCK_M // gqa)


def max_tiles(max_rows: int, num_groups: int, gqa: int) -> int:
    """Tiles needed for up to `max_rows` grouped tokens in up to `num_groups` groups."""
    return -(-max_rows // tile_tokens(gqa)) + num_groups


# A tile's keys are split into at most this many slices, so that few rows still give the GPU
# about two programs per multiprocessor.
MAX_LEVEL_SPLITS = 8


def level_splits(rows: int, gqa: int, num_kv_heads: int, num_sms: int) -> int:
    """Key slices per tile for `rows` grouped tokens (about two programs per multiprocessor, at
    most MAX_LEVEL_SPLITS)."""
    tiles = max(1, -(-rows // tile_tokens(gqa)))
    return max(1, min(MAX_LEVEL_SPLITS, -(-2 * num_sms // (tiles * num_kv_heads))))


def plan_tiles(cu: np.ndarray, num_tiles: int, gqa: int) -> np.ndarray:
    """int32 [num_tiles, 3] (group, first grouped row, rows) from the level's group offsets `cu`
    ([G + 1], rows of group g are cu[g]:cu[g+1]); tiles past the last are (0, 0, 0).

    Example:
        >>> plan_tiles(np.array([0, 3, 3, 70]), 6, 1).tolist()
        [[0, 0, 3], [2, 3, 64], [2, 67, 3], [0, 0, 0], [0, 0, 0], [0, 0, 0]]
    """
    per = tile_tokens(gqa)
    tiles = np.zeros((num_tiles, 3), dtype=np.int32)
    i = 0
    for g in range(cu.shape[0] - 1):
        for start in range(int(cu[g]), int(cu[g + 1]), per):
            if i == num_tiles:
                raise ValueError(f"plan_tiles: more than {num_tiles} tiles")
            tiles[i] = (g, start, min(per, int(cu[g + 1]) - start))
            i += 1
    return tiles


def level_attention_torch(q, k_cache, v_cache, out, lse, perm, tiles, group_pages, group_lens, softmax_scale,
                          update_lse=False, **_):
    """Torch implementation of `level_attention` (the CPU path and the kernel's test twin)."""
    rows = int(tiles[:, 2].sum())
    if rows == 0:
        return out
    G = group_pages.shape[0]
    counts = torch.zeros(G, dtype=torch.int64)
    for g, _, n in tiles.tolist():
        counts[g] += n
    cu = torch.zeros(G + 1, dtype=torch.int32)
    cu[1:] = counts.cumsum(0)
    tokens = perm[:rows].long()
    o, lse_level = varlen_attention_torch(
        q=q.index_select(0, tokens), k=k_cache, v=v_cache, cu_seqlens_q=cu, seqused_k=group_lens.int(),
        softmax_scale=softmax_scale, causal=False, block_table=group_pages, return_softmax_lse=True)
    row_index = torch.full((q.shape[0],), -1, dtype=torch.int32, device=q.device)
    row_index[tokens] = torch.arange(rows, dtype=torch.int32, device=q.device)
    relay_fusion_torch(o, lse_level, out, lse, out=out, out_lse=lse if update_lse else None, sys_index=row_index)
    return out


# Triton's standard-library helpers (tl.zeros, tl.max, tl.sum, tl.cdiv) are themselves jitted; the
# kernel uses builtins and its own combine functions only, so `_interpreted` can run it on CPU
# tensors whenever TRITON_INTERPRET is set, also after this module was imported.
@triton.jit
def _max_op(a, b):
    return tl.maximum(a, b)


@triton.jit
def _add_op(a, b):
    return a + b


# The counts vary every step: no specialization on them (one compiled kernel serves every step).
@triton.jit(do_not_specialize=["num_tokens", "num_splits"])
def _level_kernel(
    q_ptr, k_ptr, v_ptr, out_ptr, lse_ptr, perm_ptr, tiles_ptr, pages_ptr, lens_ptr,
    ws_o_ptr, ws_lse_ptr, counter_ptr,
    scale, num_tokens, num_splits,
    stride_qt, stride_qh, stride_kb, stride_kp, stride_kh, stride_vb, stride_vp, stride_vh,
    stride_ot, stride_oh, stride_pages,
    GQA: tl.constexpr, HEAD_DIM: tl.constexpr, PAGE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, UPDATE_LSE: tl.constexpr,
    DOT_F32: tl.constexpr,
):
    tile = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    n_rows = tl.load(tiles_ptr + tile * 3 + 2)
    if n_rows == 0:
        return
    g = tl.load(tiles_ptr + tile * 3)
    r0 = tl.load(tiles_ptr + tile * 3 + 1)
    seq = tl.load(lens_ptr + g)
    num_heads = tl.num_programs(1) * GQA

    m = tl.arange(0, BLOCK_M)
    row_ok = m // GQA < n_rows
    tok = tl.load(perm_ptr + r0 + m // GQA, mask=row_ok, other=0).to(tl.int64)
    head = kvh * GQA + m % GQA
    d = tl.arange(0, BLOCK_D)
    d_ok = d < HEAD_DIM
    q = tl.load(q_ptr + tok[:, None] * stride_qt + head[:, None] * stride_qh + d[None, :],
                mask=row_ok[:, None] & d_ok[None, :], other=0.0)

    # This program's slice of the group's keys: whole blocks of BLOCK_N.
    blocks = (seq + BLOCK_N - 1) // BLOCK_N
    per_split = (blocks + num_splits - 1) // num_splits
    k_lo = split * per_split * BLOCK_N
    k_hi = tl.minimum(seq, k_lo + per_split * BLOCK_N)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.full([BLOCK_M], 0.0, tl.float32)
    acc = tl.full([BLOCK_M, BLOCK_D], 0.0, tl.float32)
    qk_scale = scale * 1.4426950408889634  # exp2
    n = tl.arange(0, BLOCK_N)
    for start in range(k_lo, k_hi, BLOCK_N):
        j = start + n
        j_ok = j < k_hi
        page = tl.load(pages_ptr + g * stride_pages + j // PAGE, mask=j_ok, other=0).to(tl.int64)
        off = (j % PAGE).to(tl.int64)
        kv_mask = j_ok[:, None] & d_ok[None, :]
        k = tl.load(k_ptr + page[:, None] * stride_kb + off[:, None] * stride_kp + kvh * stride_kh + d[None, :],
                    mask=kv_mask, other=0.0)
        if DOT_F32:  # Triton's interpreter computes bf16 dots wrongly (seen with triton 3.6)
            s = tl.dot(q.to(tl.float32), tl.trans(k.to(tl.float32))) * qk_scale
        else:
            s = tl.dot(q, tl.trans(k)) * qk_scale
        s = tl.where(j_ok[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.reduce(s, 1, _max_op))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_safe)
        p = tl.exp2(s - m_safe[:, None])
        l_i = l_i * alpha + tl.reduce(p, 1, _add_op)
        v = tl.load(v_ptr + page[:, None] * stride_vb + off[:, None] * stride_vp + kvh * stride_vh + d[None, :],
                    mask=kv_mask, other=0.0)
        if DOT_F32:
            acc = acc * alpha[:, None] + tl.dot(p, v.to(tl.float32))
        else:
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m_i = m_new
    # The slice's state, natural-log LSE (-inf when it saw no key).
    has = l_i > 0
    o_part = acc / tl.where(has, l_i, 1.0)[:, None]
    lse_part = tl.where(has, m_i / 1.4426950408889634 + tl.log(tl.where(has, l_i, 1.0)), float("-inf"))

    ws_row = ((tile * tl.num_programs(1) + kvh) * num_splits + split) * BLOCK_M + m
    tl.store(ws_o_ptr + ws_row[:, None] * BLOCK_D + d[None, :], o_part)
    tl.store(ws_lse_ptr + ws_row, lse_part)
    tl.debug_barrier()
    done = tl.atomic_add(counter_ptr + tile * tl.num_programs(1) + kvh, 1, sem="acq_rel")
    if done == num_splits - 1:  # the last slice of this tile: merge all slices and the output
        tl.store(counter_ptr + tile * tl.num_programs(1) + kvh, 0)
        out_off = tok[:, None] * stride_ot + head[:, None] * stride_oh + d[None, :]
        io_mask = row_ok[:, None] & d_ok[None, :]
        lse_ctx = tl.load(lse_ptr + head * num_tokens + tok, mask=row_ok, other=float("-inf"))
        lse_ctx = tl.where(lse_ctx == float("inf"), float("-inf"), lse_ctx)
        m_all = lse_ctx
        for s_i in range(0, num_splits):
            base = ((tile * tl.num_programs(1) + kvh) * num_splits + s_i) * BLOCK_M + m
            m_all = tl.maximum(m_all, tl.load(ws_lse_ptr + base))
        m_all = tl.where(m_all == float("-inf"), 0.0, m_all)
        w_ctx = tl.exp(lse_ctx - m_all)
        o_ctx = tl.load(out_ptr + out_off, mask=io_mask, other=0.0).to(tl.float32)
        acc = tl.where(w_ctx[:, None] > 0, o_ctx, 0.0) * w_ctx[:, None]
        denom = w_ctx
        for s_i in range(0, num_splits):
            base = ((tile * tl.num_programs(1) + kvh) * num_splits + s_i) * BLOCK_M + m
            w = tl.exp(tl.load(ws_lse_ptr + base) - m_all)
            o_s = tl.load(ws_o_ptr + base[:, None] * BLOCK_D + d[None, :])
            acc += tl.where(w[:, None] > 0, o_s, 0.0) * w[:, None]
            denom += w
        ok = denom > 0
        res = acc / tl.where(ok, denom, 1.0)[:, None]
        tl.store(out_ptr + out_off, res.to(out_ptr.dtype.element_ty), mask=io_mask & ok[:, None])
        if UPDATE_LSE:
            tl.store(lse_ptr + head * num_tokens + tok, tl.where(ok, m_all + tl.log(tl.where(ok, denom, 1.0)),
                                                               float("-inf")), mask=row_ok)


def workspace(num_tiles: int, num_kv_heads: int, num_splits: int, head_dim: int, device):
    """(partial outputs, partial LSEs, counters) for `level_attention_triton`; the counters must
    start at zero (the kernel leaves them at zero)."""
    block_d = triton.next_power_of_2(head_dim)
    rows = num_tiles * num_kv_heads * num_splits * BLOCK_M
    return (torch.empty(rows, block_d, dtype=torch.float32, device=device),
            torch.empty(rows, dtype=torch.float32, device=device),
            torch.zeros(num_tiles * num_kv_heads, dtype=torch.int32, device=device))


def level_attention_triton(q, k_cache, v_cache, out, lse, perm, tiles, group_pages, group_lens, softmax_scale,
                           ws, num_splits, update_lse=False):
    """Triton implementation of `level_attention` (CUDA, or CPU under TRITON_INTERPRET=1)."""
    T, Hq, D = q.shape
    Hkv = k_cache.shape[2]
    gqa = Hq // Hkv
    ws_o, ws_lse, counters = ws
    num_tiles = tiles.shape[0]
    if (out.shape != q.shape or lse.shape != (Hq, T) or not lse.is_contiguous() or q.stride(2) != 1
            or out.stride(2) != 1 or k_cache.stride(3) != 1 or v_cache.stride(3) != 1 or Hq % Hkv
            or BLOCK_M % gqa or tiles.shape[1] != 3 or counters.numel() < num_tiles * Hkv
            or ws_lse.numel() < num_tiles * Hkv * num_splits * BLOCK_M or k_cache.shape[1] % 16):
        raise ValueError("level_attention: bad shapes or layouts: q/out [T, Hq, D] (last dim contiguous), lse "
                         "[Hq, T] contiguous, caches [blocks, page, Hkv, D], Hq a multiple of Hkv dividing "
                         f"{BLOCK_M}, workspace for {num_tiles} tiles x {Hkv} heads x {num_splits} splits")
    if T == 0 or num_tiles == 0:
        return out
    kernel = _level_kernel if q.is_cuda else _interpreted(_level_kernel)
    kernel[(num_tiles, Hkv, num_splits)](
        q, k_cache, v_cache, out, lse, perm, tiles, group_pages, group_lens, ws_o, ws_lse, counters,
        float(softmax_scale), T, num_splits,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), out.stride(0), out.stride(1),
        group_pages.stride(0),
        GQA=gqa, HEAD_DIM=D, PAGE=k_cache.shape[1], BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N,
        BLOCK_D=triton.next_power_of_2(D), UPDATE_LSE=update_lse, DOT_F32=not q.is_cuda, num_warps=NUM_WARPS,
        num_stages=NUM_STAGES,
    )
    return out


def level_attention(q, k_cache, v_cache, out, lse, perm, tiles, group_pages, group_lens, softmax_scale,
                    ws=None, num_splits=1, update_lse=False):
    """Merge, into `out`, each tiled row's attention over its group's pages (non-causal).

    Args:
        q: [T, Hq, D] queries; out: [T, Hq, D] the running output (context attention so far),
            same dtype; lse: float32 [Hq, T] (contiguous) its natural-log LSE, updated in place
            when `update_lse` (for a next level).
        k_cache, v_cache: paged caches [num_blocks, page (multiple of 16), Hkv, D], last dim contiguous.
        perm: int32 [N], the token of each grouped row; tiles: int32 [num_tiles, 3] from `plan_tiles`.
        group_pages: int32 [G, P] the pages of each group; group_lens: int32 [G] its keys.
        softmax_scale: float. ws: `workspace(num_tiles, Hkv, num_splits, D, device)` (Triton only).
        num_splits: key slices per tile (more programs for few rows).

    Returns:
        `out`: rows of tiled tokens merged with their level's attention, other rows untouched.

    Example:
        >>> level_attention(q, k_cache, v_cache, out, lse, perm, tiles,  # doctest: +SKIP
        ...                 slot_pages, lens, 0.088, ws, 4)
    """
    if q.is_cuda or os.environ.get("TRITON_INTERPRET", "0") == "1":
        return level_attention_triton(q, k_cache, v_cache, out, lse, perm, tiles, group_pages, group_lens,
                                      softmax_scale, ws, num_splits, update_lse)
    return level_attention_torch(q, k_cache, v_cache, out, lse, perm, tiles, group_pages, group_lens,
                                 softmax_scale, update_lse)
