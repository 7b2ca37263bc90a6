"""Prefix block tables: a slot's pages in front of a span of a request's own pages.

Every table relay attention reads is a span of pages of one sequence: a relay request on the prefix
path reads `[its slot's pages ; its own pages]`, a request under shared levels reads its own pages
past them, and a level reads `[its slot's pages ; a run of one member's own pages]`. Given the
source rows of vLLM's block table, `prefix_block_table` writes such tables and their KV lengths in
one pass:

    out_table[i, j] = slot_pages[slot[i], j]                              for j <  pages[i]
                    = block_table[src_row[i], start[i] + j - pages[i]]    for j >= pages[i]
    out_lens[i]     = seq_lens[i] + (pages[i] - start[i]) * page_size

(src_row defaults to i, start to 0.) Entries past the source table's width are 0: a prefix and
the own tokens it precedes fit the model's length, so they are entries past the last used block.
"""

import torch
import triton
import triton.language as tl

from vllm_relay.ops.interpreter import kernel_for, runs_triton


def prefix_block_table_torch(block_table, seq_lens, pages, slot, slot_pages, page_size, out_table,
                             out_lens, src_row=None, start=None):
    """Torch implementation of `prefix_block_table` (the CPU path and the kernel's test twin)."""
    _check_args(block_table, seq_lens, pages, slot, slot_pages, out_table, out_lens, src_row, start)
    rows, width = pages.shape[0], block_table.shape[1]
    if rows == 0:
        return out_table, out_lens
    src = block_table if src_row is None else block_table.index_select(0, src_row.long())
    first = torch.zeros_like(pages) if start is None else start
    p = pages.long()[:, None]
    j = torch.arange(width, device=block_table.device)[None, :]
    col = j - p + first.long()[:, None]
    own = torch.where(col < width, src.gather(1, col.clamp(0, width - 1)), 0)
    max_pages = slot_pages.shape[1]
    sys = slot_pages[slot.long().clamp(min=0)].gather(1, j.clamp(max=max_pages - 1).expand(rows, -1))
    out_table[:rows].copy_(torch.where(j < p, sys, own))
    out_lens[:rows].copy_(seq_lens + (pages - first) * page_size)
    return out_table, out_lens


# Triton compiles a kernel again for a pointer whose 16-byte alignment differs from the calls before.
# A step's level tables end at a fixed row (`planner.max_seqs`), so they start at a row that moves with
# the step's groups: `_level_lens[lo:]` is aligned for one step in four. The first step whose start was
# never seen compiled a variant mid-run (about 120 ms of a prefill step's host time on the H200, found by
# `bench_throughput.py --triton-cache`, 2026-11-28: benchmarks/results/archive/2026-11-26_ceiling/
# README.md, the 03:30 run).
# The kernel copies int32 entries one column at a time: alignment buys it nothing, so no pointer is
# specialized on it and the variant compiled at start-up serves every call.
_POINTERS = ["bt_ptr", "seq_lens_ptr", "pages_ptr", "slot_ptr", "slot_pages_ptr", "out_ptr", "out_lens_ptr",
             "src_ptr", "start_ptr"]


@triton.jit(do_not_specialize_on_alignment=_POINTERS)
def _prefix_block_table_kernel(
    bt_ptr, seq_lens_ptr, pages_ptr, slot_ptr, slot_pages_ptr, out_ptr, out_lens_ptr, src_ptr, start_ptr,
    width, stride_bt, stride_sp, stride_out, max_pages, page_size,
    BLOCK: tl.constexpr, HAS_SRC: tl.constexpr, HAS_START: tl.constexpr,
):
    r = tl.program_id(0)
    j = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    p = tl.load(pages_ptr + r)
    s = tl.load(slot_ptr + r)
    src = tl.load(src_ptr + r).to(tl.int64) if HAS_SRC else r.to(tl.int64)
    first = tl.load(start_ptr + r) if HAS_START else 0
    in_row = j < width
    col = j - p + first
    own = tl.load(bt_ptr + src * stride_bt + col, mask=in_row & (j >= p) & (col < width), other=0)
    sys = tl.load(slot_pages_ptr + s.to(tl.int64) * stride_sp + j,
                  mask=in_row & (j < p) & (j < max_pages) & (s >= 0), other=0)
    tl.store(out_ptr + r * stride_out + j, tl.where(j < p, sys, own), mask=in_row)
    if tl.program_id(1) == 0:
        tl.store(out_lens_ptr + r, tl.load(seq_lens_ptr + r) + (p - first) * page_size)


def prefix_block_table_triton(block_table, seq_lens, pages, slot, slot_pages, page_size, out_table,
                              out_lens, src_row=None, start=None):
    """Triton implementation of `prefix_block_table` (CUDA, or CPU under TRITON_INTERPRET=1)."""
    _check_args(block_table, seq_lens, pages, slot, slot_pages, out_table, out_lens, src_row, start)
    rows, width = pages.shape[0], block_table.shape[1]
    if rows == 0:
        return out_table, out_lens
    kernel = kernel_for(_prefix_block_table_kernel, block_table)
    block = min(1024, triton.next_power_of_2(width))
    kernel[(rows, triton.cdiv(width, block))](
        block_table, seq_lens, pages, slot, slot_pages, out_table, out_lens,
        pages if src_row is None else src_row, pages if start is None else start,
        width, block_table.stride(0), slot_pages.stride(0), out_table.stride(0),
        slot_pages.shape[1], page_size, BLOCK=block, HAS_SRC=src_row is not None, HAS_START=start is not None,
    )
    return out_table, out_lens


def prefix_block_table(block_table, seq_lens, pages, slot, slot_pages, page_size, out_table, out_lens,
                       src_row=None, start=None):
    """Block tables and KV lengths of spans of own pages, each after a slot's pages (see the module).

    Args:
        block_table: int32 [R_src, W], each request's own pages (row stride arbitrary, last dim
            contiguous). R_src = R without `src_row`.
        seq_lens: int32 [R], the KV tokens of each output row's source span from page 0 (a
            request's own tokens; for a level, the tokens up to its run's end).
        pages: int32 [R], slot pages in front of each output row (0: none).
        slot: int32 [R], the slot of each output row; read only where pages > 0.
        slot_pages: int32 [num_slots, P], the pages of each slot's prefix, in order.
        page_size: tokens per page.
        out_table: int32 [>= R, W] (rows 0..R-1 written); must not alias `block_table`.
        out_lens: int32 [>= R] (entries 0..R-1 written).
        src_row: optional int32 [R], the block-table row of each output row (default: row i).
        start: optional int32 [R], the first own page of each output row (default: 0).

    Returns:
        (out_table, out_lens). No host synchronization.

    Example:
        >>> prefix_block_table(bt, lens, pages, slot, slot_pages, 16,  # doctest: +SKIP
        ...                    ctx_bt, ctx_lens, start=skip)
    """
    if runs_triton(block_table):
        return prefix_block_table_triton(block_table, seq_lens, pages, slot, slot_pages, page_size,
                                         out_table, out_lens, src_row, start)
    return prefix_block_table_torch(block_table, seq_lens, pages, slot, slot_pages, page_size,
                                    out_table, out_lens, src_row, start)


def _check_args(block_table, seq_lens, pages, slot, slot_pages, out_table, out_lens, src_row, start) -> None:
    if block_table.dim() != 2 or slot_pages.dim() != 2:
        raise ValueError(f"prefix_block_table: block_table and slot_pages must be 2-D, got "
                         f"{tuple(block_table.shape)} and {tuple(slot_pages.shape)}")
    rows, width = pages.shape[0] if pages.dim() == 1 else -1, block_table.shape[1]
    if src_row is None and block_table.shape[0] != rows:
        raise ValueError(f"prefix_block_table: pages must have shape ({block_table.shape[0]},), got "
                         f"{tuple(pages.shape)}")
    named = (("seq_lens", seq_lens), ("pages", pages), ("slot", slot), ("src_row", src_row), ("start", start))
    for name, x in named:
        if x is not None and x.shape != (rows,):
            raise ValueError(f"prefix_block_table: {name} must have shape ({rows},), got {tuple(x.shape)}")
    for name, x in (("block_table", block_table), ("slot_pages", slot_pages), ("out_table", out_table),
                    ("out_lens", out_lens), *named):
        if x is None:
            continue
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
