"""prefix_block_table: a slot's pages in front of a span of a request's own, against a naive loop."""

import pytest
import torch

from vllm_relay.ops import prefix_block_table, prefix_block_table_torch, prefix_block_table_triton

IMPLS = {"torch": prefix_block_table_torch, "triton": prefix_block_table_triton}


def naive(block_table, seq_lens, pages, slot, slot_pages, page_size, src_row=None, start=None):
    rows, width = pages.shape[0], block_table.shape[1]
    src = range(rows) if src_row is None else src_row.tolist()
    first = [0] * rows if start is None else start.tolist()
    table = torch.zeros(rows, width, dtype=torch.int32)
    for r in range(rows):
        p = int(pages[r])
        for j in range(width):
            col = first[r] + j - p
            table[r, j] = slot_pages[int(slot[r]), j] if j < p else (block_table[src[r], col] if col < width else 0)
    return table, seq_lens + (pages - torch.tensor(first, dtype=torch.int32)) * page_size


def random_case(rows, width, num_slots, max_pages, seed):
    g = torch.Generator().manual_seed(seed)
    block_table = torch.randint(0, 10_000, (rows, width), generator=g, dtype=torch.int32)
    seq_lens = torch.randint(0, 500, (rows,), generator=g, dtype=torch.int32)
    slot = torch.randint(-1, num_slots, (rows,), generator=g, dtype=torch.int32)
    pages = torch.where(slot >= 0, torch.randint(0, max_pages + 1, (rows,), generator=g, dtype=torch.int32), 0)
    slot_pages = torch.randint(10_000, 20_000, (num_slots, max_pages), generator=g, dtype=torch.int32)
    return block_table, seq_lens, pages.int(), slot, slot_pages


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("rows,width,num_slots,max_pages", [(1, 1, 1, 1), (7, 33, 2, 5), (65, 257, 3, 128),
                                                             (3, 2048, 4, 1024)])
def test_against_naive(impl, rows, width, num_slots, max_pages):
    bt, lens, pages, slot, slot_pages = random_case(rows, width, num_slots, min(max_pages, width), rows + width)
    out_t = torch.full((rows + 3, width), -7, dtype=torch.int32)
    out_l = torch.full((rows + 3,), -7, dtype=torch.int32)
    IMPLS[impl](bt, lens, pages, slot, slot_pages, 16, out_t, out_l)
    want_t, want_l = naive(bt, lens, pages, slot, slot_pages, 16)
    assert torch.equal(out_t[:rows], want_t) and torch.equal(out_l[:rows], want_l)
    assert (out_t[rows:] == -7).all() and (out_l[rows:] == -7).all()  # rows past R untouched


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("rows,src_rows,width", [(1, 1, 1), (5, 9, 33), (40, 7, 130)])
def test_spans_of_other_rows_against_naive(impl, rows, src_rows, width):
    """Levels and requests past their levels: output row i reads row src_row[i] from page start[i]."""
    g = torch.Generator().manual_seed(rows * width)
    bt = torch.randint(0, 10_000, (src_rows, width), generator=g, dtype=torch.int32)
    lens = torch.randint(0, 500, (rows,), generator=g, dtype=torch.int32)
    slot = torch.randint(-1, 2, (rows,), generator=g, dtype=torch.int32)
    pages = torch.where(slot >= 0, torch.randint(0, min(4, width) + 1, (rows,), generator=g, dtype=torch.int32), 0)
    slot_pages = torch.randint(10_000, 20_000, (2, min(4, width)), generator=g, dtype=torch.int32)
    src_row = torch.randint(0, src_rows, (rows,), generator=g, dtype=torch.int32)
    start = torch.randint(0, width + 2, (rows,), generator=g, dtype=torch.int32)  # some past the width
    out_t, out_l = torch.full((rows, width), -7, dtype=torch.int32), torch.empty(rows, dtype=torch.int32)
    IMPLS[impl](bt, lens, pages.int(), slot, slot_pages, 16, out_t, out_l, src_row=src_row, start=start)
    want_t, want_l = naive(bt, lens, pages.int(), slot, slot_pages, 16, src_row, start)
    assert torch.equal(out_t, want_t) and torch.equal(out_l, want_l)


def test_dispatch_and_a_strided_block_table():
    bt, lens, pages, slot, slot_pages = random_case(9, 40, 2, 6, 1)
    wide = torch.zeros(9, 64, dtype=torch.int32)
    wide[:, :40] = bt
    out_t, out_l = torch.empty(9, 40, dtype=torch.int32), torch.empty(9, dtype=torch.int32)
    prefix_block_table(wide[:, :40], lens, pages, slot, slot_pages, 32, out_t, out_l)
    want_t, want_l = naive(bt, lens, pages, slot, slot_pages, 32)
    assert torch.equal(out_t, want_t) and torch.equal(out_l, want_l)


def test_rejects_bad_arguments():
    bt, lens, pages, slot, slot_pages = random_case(4, 8, 2, 3, 2)
    out_t, out_l = torch.empty(4, 8, dtype=torch.int32), torch.empty(4, dtype=torch.int32)
    with pytest.raises(ValueError, match="must be int32"):
        prefix_block_table_torch(bt.long(), lens, pages, slot, slot_pages, 16, out_t, out_l)
    with pytest.raises(ValueError, match="may not alias"):
        prefix_block_table_torch(bt, lens, pages, slot, slot_pages, 16, bt, out_l)
    with pytest.raises(ValueError, match="out_table must be"):
        prefix_block_table_torch(bt, lens, pages, slot, slot_pages, 16, torch.empty(3, 8, dtype=torch.int32), out_l)
    with pytest.raises(ValueError, match="pages must have shape"):
        prefix_block_table_torch(bt, lens, pages[:2], slot, slot_pages, 16, out_t, out_l)


@pytest.mark.gpu
def test_triton_on_cuda():
    bt, lens, pages, slot, slot_pages = random_case(300, 563, 4, 512, 5)
    cuda = [x.cuda() for x in (bt, lens, pages, slot, slot_pages)]
    out_t, out_l = torch.empty(300, 563, dtype=torch.int32, device="cuda"), torch.empty(300, dtype=torch.int32,
                                                                                      device="cuda")
    prefix_block_table(*cuda, 16, out_t, out_l)
    want_t, want_l = naive(bt, lens, pages, slot, slot_pages, 16)
    assert torch.equal(out_t.cpu(), want_t) and torch.equal(out_l.cpu(), want_l)


@pytest.mark.gpu
def test_one_compiled_kernel_serves_outputs_at_any_alignment():
    """The planner writes a step's level tables at a row that moves with its groups (`level_table[lo:]`,
    `_level_lens[lo:]`): 16-byte aligned for some steps only. Triton would compile the kernel again for
    each alignment first seen, mid-run (about 120 ms of one prefill step on the H200); no pointer is
    specialized on it, so the variant compiled first serves every start."""
    from vllm_relay.ops.prefix_table import _prefix_block_table_kernel

    rows, width = 6, 37  # 37 columns: the rows of out_table start at every alignment too
    bt, lens, pages, slot, slot_pages = random_case(9, width, 3, 20, 11)
    src = torch.tensor([8, 0, 3, 3, 5, 1], dtype=torch.int32)
    start = torch.tensor([0, 2, 1, 0, 4, 3], dtype=torch.int32)
    lens, pages, slot = lens[:rows], pages[:rows], slot[:rows]
    want_t, want_l = naive(bt, lens, pages, slot, slot_pages, 16, src_row=src, start=start)
    cuda = [x.cuda() for x in (bt, lens, pages, slot, slot_pages)]
    out_t = torch.full((rows + 5, width), -7, dtype=torch.int32, device="cuda")
    out_l = torch.full((rows + 5,), -7, dtype=torch.int32, device="cuda")
    kw = dict(src_row=src.cuda(), start=start.cuda())
    prefix_block_table(*cuda, 16, out_t[1:], out_l[1:], **kw)
    cache = _prefix_block_table_kernel.device_caches[torch.cuda.current_device()][0]
    compiled = len(cache)
    for lo in range(5):  # starts at bytes 0, 4, 8, 12, 16 of out_l; of out_t, 0, 148, 296, 444, 592
        out_t.fill_(-7)
        out_l.fill_(-7)
        prefix_block_table(*cuda, 16, out_t[lo:], out_l[lo:], **kw)
        assert torch.equal(out_t[lo: lo + rows].cpu(), want_t) and torch.equal(out_l[lo: lo + rows].cpu(), want_l)
        assert (out_l[:lo] == -7).all() and (out_l[lo + rows:] == -7).all()
    assert len(cache) == compiled
