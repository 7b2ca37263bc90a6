"""The levels of a sliding-window layer (ops/window_rows.py): each level row's first visible key, checked
against positions counted out by hand; the window group's level rows and their check of its tables."""

import numpy as np

from vllm_relay.ops.level_tree import LevelRule, find_levels, level_rows
from vllm_relay.ops.window_rows import window_level_rows, window_row_offsets

PS = 4  # tokens a page


def levels(table, q_lens, seq_lens, slot, shift):
    """The tree of a step whose rows have `seq_lens` own KV tokens after it and `q_lens` query tokens."""
    table = np.asarray(table, dtype=np.int32)
    q_lens, seq_lens = np.asarray(q_lens), np.asarray(seq_lens)
    shareable = ((seq_lens - q_lens) // PS).astype(np.int32)
    root_pages = np.array([shift // PS], dtype=np.int32)
    tree = find_levels(table, shareable, np.asarray(slot), root_pages, LevelRule(max_depth=3))
    query_start = np.concatenate(([0], np.cumsum(q_lens))).astype(np.int32)
    perm, cu, _ = level_rows(tree, query_start[:-1], int(q_lens.sum()), q_lens.astype(np.int32))
    return tree, perm, cu, query_start


def test_first_keys_are_positions_less_the_window_from_the_levels_start():
    """Rows 0-2 on a registered prompt of 8 tokens (two pages, a level of its own); rows 0 and 1 also
    share two own pages (a second level); row 3, a plain request, shares no page. Each level row's first
    visible key is its token's position (shift + own position) less W - 1, less its level's first
    position."""
    window, shift = 6, 8
    table = [[10, 11, 12, 13], [10, 11, 14, 15], [30, 31, 16, 0], [20, 21, 0, 0]]
    q_lens, seq_lens = [1, 1, 3, 1], [13, 10, 11, 6]  # row 2: a chunk of 3 tokens
    tree, perm, cu, qs = levels(table, q_lens, seq_lens, [0, 0, 0, -1], shift)
    assert tree.front.tolist() == [2, 0] and tree.start.tolist() == [0, 0] and tree.pages.tolist() == [0, 2]
    row_req, row_off = window_row_offsets(tree, perm, cu, qs, np.array([shift] * 3 + [0]), PS, window)
    keys = np.asarray(seq_lens)[row_req] + row_off
    group = np.repeat(np.arange(len(cu) - 1), np.diff(cu))
    for i, t in enumerate(perm.tolist()):
        b = int(row_req[i])
        own = seq_lens[b] - (qs[b + 1] - t)  # the token's own position
        level_start = 0 if group[i] == 0 else shift  # the slot's pages, then own pages from 0
        assert keys[i] == shift + own - (window - 1) - level_start, (i, t)
    assert sorted(set(group.tolist())) == [0, 1] and 3 not in row_req.tolist()


def test_the_window_groups_level_row_is_the_one_furthest_behind_and_its_pages_must_agree():
    """Two rows share own pages 0-2 in the full group's tables; in the window group's, row 0 (furthest
    ahead) no longer holds page 0 (the null block), row 1 does. The level table is read from row 1, and
    row 0's ids from its first visible page on must equal row 1's; an id that differs before a row's
    window does not matter, one inside it does."""
    full = [[5, 6, 7, 8], [5, 6, 7, 9]]
    tree, perm, cu, qs = levels(full, [1, 1], [15, 13], [-1, -1], 0)
    assert tree.pages.tolist() == [3] and tree.num_groups == 1
    row_req, row_off = window_row_offsets(tree, perm, cu, qs, np.zeros(2, np.int64), PS, 6)
    first = np.array([15, 13])[row_req] + row_off  # row 0 sees keys 9.., row 1 keys 7..
    assert first[np.argsort(row_req)].tolist() == [9, 7]
    window = np.array([[0, 6, 7, 8], [25, 6, 7, 9]], dtype=np.int32)
    assert window_level_rows(tree, perm, cu, row_req, first, window, PS).tolist() == [1]
    window[0, 1] = 30  # page 1 (keys 4-7): row 0's window starts at key 9 -> not read by row 0
    assert window_level_rows(tree, perm, cu, row_req, first, window, PS).tolist() == [1]
    window[0, 2] = 31  # page 2 (keys 8-11): inside row 0's window
    assert window_level_rows(tree, perm, cu, row_req, first, window, PS) is None
