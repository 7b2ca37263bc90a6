"""prefix_block_table: a slot's pages in front of each request's own, against a naive loop."""

import pytest
import torch

from vllm_relay.ops import prefix_block_table, prefix_block_table_torch, prefix_block_table_triton

IMPLS = {"torch": prefix_block_table_torch, "triton": prefix_block_table_triton}


def naive(block_table, seq_lens, pages, slot, slot_pages, page_size):
    rows, width = block_table.shape
    table = torch.zeros(rows, width, dtype=torch.int32)
    for r in range(rows):
        p = int(pages[r])
        for j in range(width):
            table[r, j] = slot_pages[int(slot[r]), j] if j < p else block_table[r, j - p]
    return table, seq_lens + pages * page_size


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
