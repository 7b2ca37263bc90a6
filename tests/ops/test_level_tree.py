"""Levels found in block tables: every row reads each of its pages exactly once, in order, and with the
permissive rule the levels read each shared page once per step (checked against a brute-force trie)."""

import numpy as np
import pytest

from vllm_relay.ops.level_tree import LevelRule, _nodes, find_levels, level_rows, saved_bound

PERMISSIVE = LevelRule(min_rows_root=1, min_rows=2, min_saved_pages=0, max_depth=64)


def random_tables(rng, B, num_slots=2, width=40):
    """Block tables with sharing at several depths, as vLLM's prefix cache lays it out: rows copy a
    random prefix of an earlier row's pages (a document, a prompt's samples) and end in pages of their
    own; some rows follow a registered system prompt; every page id is used by one run only."""
    next_id = iter(range(1, 10**6))
    table = np.zeros((B + 3, width), dtype=np.int32)
    n_own = np.zeros(B, dtype=np.int64)
    root = np.where(rng.random(B) < 0.4, rng.integers(0, num_slots, B), -1)
    for r in range(B):
        n = int(rng.integers(0, width))
        peers = [p for p in range(r) if root[p] == root[r]]
        k = 0
        if peers and rng.random() < 0.8:
            p = int(rng.choice(peers))
            k = min(n, int(rng.integers(0, n_own[p] + 1)))
            table[r, :k] = table[p, :k]
        table[r, k:n] = [next(next_id) for _ in range(n - k)]
        table[r, n:] = rng.integers(0, 10**6, width - n)  # past the row's pages: garbage
        n_own[r] = n
    shareable = np.where(rng.random(B) < 0.85, n_own, 0)  # the others: first chunks, nothing cached
    root_pages = rng.integers(1, 6, num_slots)
    return table, n_own, shareable, root, root_pages


def pages_read(tree, table, r, n_own, slot_pages, root):
    """Row r's pages as the plan reads them: its levels in order, then its context."""
    seq = []
    for g in tree.row_groups[r]:
        if g < 0:
            break
        if tree.slot[g] >= 0:
            seq += slot_pages[tree.slot[g]][: tree.front[g]]
        seq += table[tree.row[g], tree.start[g]: tree.start[g] + tree.pages[g]].tolist()
    if tree.row_front[r]:
        seq += slot_pages[root[r]][: tree.row_front[r]]
    return seq + table[r, tree.row_skip[r]: n_own[r]].tolist()


@pytest.mark.parametrize("seed", range(12))
@pytest.mark.parametrize("rule", [PERMISSIVE, LevelRule(min_rows_root=3, min_rows=3, min_saved_pages=20, max_depth=2),
                                  LevelRule(min_rows_root=40, min_rows=2, max_depth=1, max_groups=3)])
def test_every_row_reads_its_pages_exactly_once_in_order(seed, rule):
    rng = np.random.default_rng(seed)
    B = int(rng.integers(1, 70))
    table, n_own, shareable, root, root_pages = random_tables(rng, B)
    slot_pages = [[-(1000 * s + i) for i in range(int(n))] for s, n in enumerate(root_pages)]
    tree = find_levels(table, shareable, root, root_pages, rule)
    for r in range(B):
        want = (slot_pages[root[r]] if root[r] >= 0 else []) + table[r, : n_own[r]].tolist()
        assert pages_read(tree, table, r, n_own, slot_pages, root) == want, r
        assert tree.row_skip[r] <= shareable[r]  # never a page at or after the query tokens
    # Each group's rows hold its run: the same ids at the same positions (the rule's limits held).
    for g in range(tree.num_groups):
        members = np.flatnonzero((tree.row_groups == g).any(axis=1))
        least = min(rule.min_rows, rule.min_rows_root) if tree.slot[g] >= 0 else rule.min_rows
        assert members.size == tree.size[g] >= least
        run = table[members, tree.start[g]: tree.start[g] + tree.pages[g]]
        assert (run == run[0]).all()
        assert (tree.size[g] - 1) * (tree.front[g] + tree.pages[g]) >= rule.min_saved_pages
    assert tree.num_groups <= rule.max_groups
    assert ((tree.row_groups >= 0).sum(axis=1) <= rule.max_depth).all()


@pytest.mark.parametrize("seed", range(8))
def test_permissive_levels_read_each_shared_page_once(seed):
    """Against a brute-force prefix trie: with every shared run a level, a step reads each node's
    page once (the slot's pages once per slot), so the page reads equal the trie's size."""
    rng = np.random.default_rng(100 + seed)
    B = int(rng.integers(2, 60))
    table, n_own, shareable, root, root_pages = random_tables(rng, B)
    tree = find_levels(table, shareable, root, root_pages, PERMISSIVE)
    reads = int((tree.front + tree.pages).sum()) + int((tree.row_front + n_own - tree.row_skip).sum())
    nodes = set()
    want = 0
    for r in range(B):
        if root[r] >= 0:
            if shareable[r] > 0 or (root == root[r]).any():
                nodes.add(("slot", root[r]))
        for k in range(n_own[r]):
            if k < shareable[r]:
                nodes.add((root[r], tuple(table[r, : k + 1])))
            else:
                want += 1  # past the shareable pages: the row's own read
    relay_rows = root >= 0
    want += sum(int(root_pages[s]) for s in set(root[relay_rows].tolist()))
    want += sum(1 for node in nodes if node[0] != "slot")
    assert reads == want
    assert tree.saved_pages() == int(((tree.size - 1) * (tree.front + tree.pages)).sum())


@pytest.mark.parametrize("seed", range(16))
def test_saved_bound_is_never_below_what_a_tree_saves(seed):
    """The planner skips the search when `saved_bound` is below its threshold: no tree of any rule
    may save more. The permissive rule saves the most; the bound is reached by rows that all read
    one run (a row's pages all in one level of every row)."""
    rng = np.random.default_rng(300 + seed)
    B = int(rng.integers(1, 70))
    table, n_own, shareable, root, root_pages = random_tables(rng, B)
    bound = saved_bound(shareable, root, root_pages)
    for rule in (PERMISSIVE, LevelRule(min_rows_root=1, min_rows=2, max_depth=2)):
        assert find_levels(table, shareable, root, root_pages, rule).saved_pages() <= bound
    n = int(rng.integers(1, 30))  # B rows over one document of n pages: the bound is exact
    same = np.tile(np.arange(1, n + 1, dtype=np.int32), (B, 1))
    tree = find_levels(same, np.full(B, n), np.full(B, -1), np.zeros(0, np.int32), PERMISSIVE)
    bound = saved_bound(np.full(B, n), np.full(B, -1), np.zeros(0, np.int32))
    assert tree.saved_pages() == bound == (B - 1) * n


def test_a_page_shared_out_of_prefix_order_is_not_trusted():
    """Two copies of one prefix (computed concurrently, both cached): a third request may mix their
    pages. Only runs that every member holds page by page become levels."""
    table = np.array([[10, 11, 12], [20, 21, 22], [10, 21, 30]], dtype=np.int32)
    tree = find_levels(table, np.array([3, 3, 3]), np.full(3, -1), np.zeros(0, np.int32), PERMISSIVE)
    assert tree.num_groups == 1 and tree.pages.tolist() == [1] and tree.size.tolist() == [2]
    assert tree.row_skip.tolist() == [1, 0, 1]


def test_relay_rows_read_their_system_prompt_first_and_short_groups_take_the_prefix_path():
    table = np.array([[7, 8], [7, 8], [9, 1], [3, 4]], dtype=np.int32)
    root = np.array([0, 0, 0, 1])
    rule = LevelRule(min_rows_root=2, min_rows=2, max_depth=3)
    tree = find_levels(table, np.array([2, 2, 1, 2]), root, np.array([4, 6]), rule)
    # Slot 0: its pages for its three rows, then pages [7, 8] for rows 0 and 1; slot 1 has one row.
    assert tree.slot.tolist() == [0, -1] and tree.front.tolist() == [4, 0] and tree.pages.tolist() == [0, 2]
    assert tree.row_front.tolist() == [0, 0, 0, 6] and tree.row_skip.tolist() == [2, 2, 0, 0]


def test_a_short_shared_run_joins_its_children_levels():
    """A run too short for a level of its own is read by the levels below it."""
    table = np.array([[1, 2, 3, 4, 9], [1, 2, 3, 4, 8], [1, 5, 6, 7, 3], [1, 5, 6, 7, 2]], dtype=np.int32)
    rule = LevelRule(min_rows=2, min_saved_pages=4, max_depth=3)  # page 1 alone saves 3 reads: too few
    tree = find_levels(table, np.array([4, 4, 4, 4]), np.full(4, -1), np.zeros(0, np.int32), rule)
    assert sorted(zip(tree.start.tolist(), tree.pages.tolist())) == [(0, 4), (0, 4)]
    assert tree.row_skip.tolist() == [4, 4, 4, 4]


@pytest.mark.parametrize("multi", [False, True], ids=["decode", "chunks"])
def test_level_rows_against_a_naive_loop(multi):
    """Every query token of a member row (one for a decode row, a chunk's for a prompt chunk whose
    shared part is cached) has one level row in each of its row's levels, grouped by level."""
    rng = np.random.default_rng(5)
    table, n_own, shareable, root, root_pages = random_tables(rng, 50)
    tree = find_levels(table, shareable, root, root_pages, PERMISSIVE)
    lens = rng.integers(1, 5, 50) if multi else np.ones(50, dtype=np.int64)
    starts = np.cumsum(lens) - lens + np.arange(50)  # a gap after each row: tokens of no row
    T = int(starts[-1] + lens[-1]) + 3
    perm, cu, row_index = level_rows(tree, starts, T, lens if multi else None)
    own_tokens = [list(range(starts[r], starts[r] + lens[r])) for r in range(50)]
    for g in range(tree.num_groups):
        members = [r for r in range(50) if g in tree.row_groups[r]]
        assert perm[cu[g]: cu[g + 1]].tolist() == [t for r in members for t in own_tokens[r]]
    for r in range(50):
        for k, g in enumerate(tree.row_groups[r]):
            for i, t in enumerate(own_tokens[r]):
                if g < 0:
                    assert row_index[k, t] == -1
                else:
                    members = [m for m in range(50) if g in tree.row_groups[m]]
                    before = sum(lens[m] for m in members[: members.index(r)])
                    assert row_index[k, t] == cu[g] + before + i
    listed = [t for r in range(50) for t in own_tokens[r]]
    assert (np.delete(row_index, listed, axis=1) == -1).all()


@pytest.mark.parametrize("kind", ["mixed", "distinct", "equal", "one", "empty"])
def test_nodes_equal_numpy_unique(kind):
    """The tree's grouping of rows by key: numpy's `unique` (first row, each row's node, counts)."""
    rng = np.random.default_rng(len(kind))
    n = {"one": 1, "empty": 0}.get(kind, 300)
    key = {"mixed": rng.integers(0, 40, n) << 32 | rng.integers(0, 3, n),
           "distinct": rng.permutation(10**6)[:n], "equal": np.full(n, 7)}.get(kind, rng.integers(0, 5, n))
    key = key.astype(np.int64)
    _, first, node, counts = np.unique(key, return_index=True, return_inverse=True, return_counts=True)
    got = _nodes(key)
    for want, have in zip((first, node.reshape(-1), counts), got):
        assert have.dtype.kind == "i" and have.tolist() == want.tolist()


def test_a_large_decode_batch_under_one_prompt_with_samples_below():
    """The shapes a server sees (1024 rows): one registered prompt over every row, and groups of 16
    samples sharing a document's pages under it; each row's pages still read exactly once."""
    rng = np.random.default_rng(3)
    B, width = 1024, 48
    table = rng.permutation(B * width).astype(np.int32).reshape(B, width)
    table[:, :8] = table[np.arange(B) // 16 * 16, :8]  # 8 pages shared by each group of 16
    n_own = rng.integers(9, width, B)
    root, root_pages = np.zeros(B, dtype=np.int64), np.array([128])
    rule = LevelRule(min_rows_root=2, min_rows=2, min_saved_pages=1)
    tree = find_levels(table, n_own, root, root_pages, rule)
    assert tree.num_groups == 1 + B // 16 and tree.size.tolist() == [B] + [16] * (B // 16)
    assert tree.front.tolist() == [128] + [0] * (B // 16) and set(tree.pages[1:].tolist()) == {8}
    slot_pages = [[-(i + 1) for i in range(128)]]
    for r in rng.choice(B, 64, replace=False):
        want = slot_pages[0] + table[r, : n_own[r]].tolist()
        assert pages_read(tree, table, r, n_own, slot_pages, root) == want
