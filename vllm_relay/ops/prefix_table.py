"""Prefix block tables: put a shared prefix's pages in front of each request's own pages.

A relay request on the prefix path attends to `[its slot's pages ; its own pages]` as one
sequence. Given each request's own block table and the number of prefix pages it takes,
`prefix_block_table` writes the merged table and the merged KV lengths in one pass:

    out_table[r, j] = slot_pages[slot[r], j]           for j <  pages[r]
                    = block_table[r, j - pages[r]]     for j >= pages[r]
    out_lens[r]     = seq_lens[r] + pages[r] * page_size

Own entries shifted past the table's width are dropped: a request's prefix and own tokens fit
the model's length, so they are entries past its last used block.
"""

import os

import torch
import triton
import triton.language as tl


def prefix_block_table_torch(block_table, seq_lens, pages, slot, slot_pages, page_size, out_table,
                             out_lens):
    """Torch implementation of `prefix_block_table` (the CPU path and the kernel's test twin)."""
    _check_args(block_table, seq_lens, pages, slot, slot_pages, out_table, out_lens)
    rows, width = block_table.shape
    if rows == 0:
        return out_table, out_lens
    p = pages.long()[:, None]
    j = torch.arange(width, device=block_table.device)[None, :]
    own = block_table.gather(1, (j - p).clamp(min=0))
    max_pages = slot_pages.shape[1]
    sys = slot_pages[slot.long().clamp(min=0)].gather(1, j.clamp(max=max_pages - 1).expand(rows, -1))
    out_table[:rows].copy_(torch.where(j < p, sys, own))
    out_lens[:rows].copy_(seq_lens + pages * page_size)
    return out_table, out_lens


@triton.jit
def _prefix_block_table_kernel(
    bt_ptr, seq_lens_ptr, pages_ptr, slot_ptr, slot_pages_ptr, out_ptr, out_lens_ptr,
    width, stride_bt, stride_sp, stride_out, max_pages, page_size,
    BLOCK: tl.constexpr,
):
    r = tl.program_id(0)
    j = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    p = tl.load(pages_ptr + r)
    s = tl.load(slot_ptr + r)
    in_row = j < width
    own = tl.load(bt_ptr + r * stride_bt + (j - p), mask=in_row & (j >= p), other=0)
    sys = tl.load(slot_pages_ptr + s.to(tl.int64) * stride_sp + j,
                  mask=in_row & (j < p) & (j < max_pages) & (s >= 0), other=0)
    tl.store(out_ptr + r * stride_out + j, tl.where(j < p, sys, own), mask=in_row)
    if tl.program_id(1) == 0:
        tl.store(out_lens_ptr + r, tl.load(seq_lens_ptr + r) + p * page_size)


def prefix_block_table_triton(block_table, seq_lens, pages, slot, slot_pages, page_size, out_table,
                              out_lens):
    """Triton implementation of `prefix_block_table` (CUDA, or CPU under TRITON_INTERPRET=1)."""
    _check_args(block_table, seq_lens, pages, slot, slot_pages, out_table, out_lens)
    rows, width = block_table.shape
    if rows == 0:
        return out_table, out_lens
    kernel = _prefix_block_table_kernel
    if not block_table.is_cuda:
        from vllm_relay.ops.relay_fusion import _interpreted

        kernel = _interpreted(kernel)
    block = min(1024, triton.next_power_of_2(width))
    kernel[(rows, triton.cdiv(width, block))](
        block_table, seq_lens, pages, slot, slot_pages, out_table, out_lens,
        width, block_table.stride(0), slot_pages.stride(0), out_table.stride(0),
        slot_pages.shape[1], page_size, BLOCK=block,
    )
    return out_table, out_lens


def prefix_block_table(block_table, seq_lens, pages, slot, slot_pages, page_size, out_table, out_lens):
    """Merged block tables and KV lengths of requests reading a shared prefix's pages first.

    Args:
        block_table: int32 [R, W], each request's own pages (row stride arbitrary, last dim
            contiguous).
        seq_lens: int32 [R], each request's own KV tokens.
        pages: int32 [R], prefix pages of each request (0: the row is copied unchanged).
        slot: int32 [R], the prefix (slot) of each request; read only where pages > 0.
        slot_pages: int32 [num_slots, P], the pages of each slot's prefix, in order.
        page_size: tokens per page.
        out_table: int32 [>= R, W] (rows 0..R-1 written); must not alias `block_table`.
        out_lens: int32 [>= R] (entries 0..R-1 written).

    Returns:
        (out_table, out_lens). No host synchronization.

    Example:
        >>> prefix_block_table(bt, lens, pages, slot, slot_pages, 16, ctx_bt, ctx_lens)
    """
    if block_table.is_cuda or os.environ.get("TRITON_INTERPRET", "0") == "1":
        return prefix_block_table_triton(block_table, seq_lens, pages, slot, slot_pages, page_size,
                                         out_table, out_lens)
    return prefix_block_table_torch(block_table, seq_lens, pages, slot, slot_pages, page_size,
                                    out_table, out_lens)


def _check_args(block_table, seq_lens, pages, slot, slot_pages, out_table, out_lens) -> None:
    if block_table.dim() != 2 or slot_pages.dim() != 2:
        raise ValueError(f"prefix_block_table: block_table and slot_pages must be 2-D, got "
                         f"{tuple(block_table.shape)} and {tuple(slot_pages.shape)}")
    rows, width = block_table.shape
    for name, x in (("seq_lens", seq_lens), ("pages", pages), ("slot", slot)):
        if x.shape != (rows,):
            raise ValueError(f"prefix_block_table: {name} must have shape ({rows},), got {tuple(x.shape)}")
    for name, x in (("block_table", block_table), ("seq_lens", seq_lens), ("pages", pages),
                    ("slot", slot), ("slot_pages", slot_pages), ("out_table", out_table),
                    ("out_lens", out_lens)):
        if x.dtype != torch.int32:
            raise ValueError(f"prefix_block_table: {name} must be int32, got {x.dtype}")
        if x.device != block_table.device:
            raise ValueError(f"prefix_block_table: {name} is on {x.device}, not {block_table.device}")
        if x.numel() > 1 and x.stride(-1) != 1:
            raise ValueError(f"prefix_block_table: {name} must have a contiguous last dim")
    if out_table.dim() != 2 or out_table.shape[0] < rows or out_table.shape[1] != width:
        raise ValueError(f"prefix_block_table: out_table must be [>= {rows}, {width}], got "
                         f"{tuple(out_table.shape)}")
    if out_lens.dim() != 1 or out_lens.shape[0] < rows:
        raise ValueError(f"prefix_block_table: out_lens must be [>= {rows}], got {tuple(out_lens.shape)}")
    if out_table.data_ptr() == block_table.data_ptr():
        raise ValueError("prefix_block_table: out_table may not alias block_table")
