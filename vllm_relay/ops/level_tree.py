"""Shared levels found in the block tables: the prefix tree of a step's decode requests. Pure numpy.

vLLM's prefix cache stores a shared prefix once: every request over it holds the same physical
block ids at the same positions of its block table (the n samples of one prompt, requests over one
document, a system prompt nobody registered). `find_levels` finds those runs, as a tree:

* the root of a relay request is its registered system prompt (its slot's pages, a virtual run in
  front of its own table); the root of any other request is its first own page;
* below a node, the rows that agree on the next page form a child; a node's run is the pages all of
  its rows agree on (verified page by page, never assumed from one id: exact for any tables).

A node becomes a *level* (a group whose rows read its run once, together) when `worth` says so;
a node that is not one hands its run down to its children, so that each row's levels cover one
contiguous span of its pages: `[front pages ; own pages 0 .. skip)`. The rest of its own pages
(and the front pages, when no level took them: the prefix path) is its context, read per request.

Rows that cannot share (padding, a first prompt chunk with nothing cached) and rows whose node is
too small keep everything in their context. Every decision only moves pages between a level and
the context: exact either way.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass
class LevelRule:
    """When a node becomes a level (the measured rule lives with its measurements, in the planner).

    Attributes:
        min_rows_root: rows a registered system prompt needs to be read as a level (else its
            requests read it in their context: the prefix path).
        min_rows: rows any other shared run needs (at least 2: one row shares nothing).
        min_saved_pages: pages a level must save, `(rows - 1) * run pages`, to pay its launches.
        max_depth: levels per row at most (CUDA graphs hold a fixed number); deeper runs stay in
            the context.
        max_groups: levels per step at most (the plan's persistent tables); shallower first.
    """

    min_rows_root: int = 1
    min_rows: int = 2
    min_saved_pages: int = 0
    max_depth: int = 4
    max_groups: int = 1 << 30

    def __post_init__(self) -> None:
        if self.min_rows < 2 or self.min_rows_root < 1 or self.max_depth < 1 or self.max_groups < 0:
            raise ValueError(f"LevelRule: invalid {self}")


@dataclass
class LevelTree:
    """The levels of a step (groups, shallowest first) and each row's share of them.

    Group g reads `front[g]` pages of slot `slot[g]` (when >= 0), then own pages
    `start[g] .. start[g] + pages[g]` of row `row[g]`'s block table; its members are the rows r with
    `g` in `row_groups[r]`. Row r reads, in its context, `row_front[r]` pages of its slot, then its
    own pages from `row_skip[r]` on.

    Attributes (int32 numpy arrays):
        row, start, pages, slot, front, size: [G] per group (size: its rows).
        depth: [G], the group's position in its rows' chains (0: the first level they read).
        row_groups: [B, max_depth], each row's groups in order, -1 past its last.
        row_skip: [B], own pages of each row its levels cover.
        row_front: [B], slot pages each row reads in its context (its slot's pages on the prefix
            path, else 0).
    """

    row: np.ndarray
    start: np.ndarray
    pages: np.ndarray
    slot: np.ndarray
    front: np.ndarray
    size: np.ndarray
    depth: np.ndarray
    row_groups: np.ndarray
    row_skip: np.ndarray
    row_front: np.ndarray

    @property
    def num_groups(self) -> int:
        return int(self.row.shape[0])

    def saved_pages(self) -> int:
        """Page reads the levels save this step: each level's run is read once, not once per row."""
        return int(((self.size.astype(np.int64) - 1) * (self.front + self.pages)).sum())


def find_levels(block_table: np.ndarray, shareable: np.ndarray, root: np.ndarray, root_pages: np.ndarray,
                rule: LevelRule) -> LevelTree:
    """The step's levels: runs of pages that several rows' tables share, as a tree (see the module).

    Args:
        block_table: int32 [>= B, W], each row's own pages (vLLM's host block table).
        shareable: int32 [B], leading own pages each row may read through a level: the whole
            pages before its first query token (a decode token or a prompt chunk), 0 for a row that
            cannot share (padding).
        root: int32 [B], each row's registered system prompt (slot), -1 for none.
        root_pages: int32 [num_slots], each slot's pages.
        rule: when a node becomes a level.

    Returns:
        `LevelTree`. No row reads a page twice or misses one: for every row, levels then context
        cover `[root_pages[root] slot pages ; own pages]` exactly once, in order.

    Example:
        >>> bt = np.array([[5, 6, 7], [5, 6, 8], [5, 9, 4]], dtype=np.int32)
        >>> t = find_levels(bt, np.array([2, 2, 2]), np.array([-1, -1, -1]), np.zeros(0, np.int32),
        ...                 LevelRule())
        >>> t.start.tolist(), t.pages.tolist(), t.size.tolist(), t.row_skip.tolist()
        ([0, 1], [1, 1], [3, 2], [2, 2, 1])
    """
    B = int(shareable.shape[0])
    shareable = shareable.astype(np.int64)
    root = root.astype(np.int64)
    root_pages = np.asarray(root_pages, dtype=np.int64)
    has_root = root >= 0
    my_front = slot_front(root, root_pages)
    row_skip = np.zeros(B, dtype=np.int64)
    row_front = my_front.copy()
    row_groups = np.full((B, rule.max_depth), -1, dtype=np.int32)
    # Per group (shallowest first): rep row, start, pages, slot, front, size, depth; blocks of arrays.
    groups: list[np.ndarray] = []
    num_groups = 0

    # Active rows and their state (all rows of a node share it: they took the same path).
    act = np.flatnonzero(has_root | (shareable > 0))
    c0 = np.zeros(act.size, dtype=np.int64)  # own page where the current node starts
    run0 = np.zeros(act.size, dtype=np.int64)  # own page where the run not yet in a level starts
    front = my_front[act]  # slot pages not yet in a level
    cuts = np.zeros(act.size, dtype=np.int64)  # levels so far
    first_block = block_table[act, 0].astype(np.int64) if act.size else np.zeros(0, np.int64)
    num_slots = root_pages.shape[0]
    # Depth 0: relay rows by slot, others by first page (offset past the slots).
    key = np.where(has_root[act], root[act], num_slots + first_block)
    at_root = has_root[act]  # rows whose node is their slot's (at depth 0)

    while act.size:
        first, node, counts = _nodes(key)
        keep = counts[node] >= np.where(at_root, rule.min_rows_root, rule.min_rows)
        if not keep.all():
            act, c0, run0, front, cuts, key = (x[keep] for x in (act, c0, run0, front, cuts, key))
            if not act.size:
                break
            first, node, counts = _nodes(key)
        size = counts[node]
        # The node's run from c0: pages on which every row agrees with the node's first row.
        rep = act[first[node]]
        agree = _agreement(block_table, act, rep, c0, np.minimum(shareable[act], shareable[rep]) - c0)
        run = np.full(first.shape[0], np.iinfo(np.int64).max, dtype=np.int64)
        np.minimum.at(run, node, agree)
        end = c0 + run[node]  # own page where the node ends
        acc = front + end - run0  # pages the node's level would read
        worth = ((size - 1) * acc >= rule.min_saved_pages) & (acc > 0) & (cuts < rule.max_depth)
        # Record the levels (node order: one group per node), shallowest first, within capacity.
        # `worth` is the same for every row of a node: read it at the node's first row.
        cut_nodes = np.flatnonzero(worth[first])[: max(rule.max_groups - num_groups, 0)]
        node_cut = np.zeros(first.shape[0], dtype=bool)
        node_cut[cut_nodes] = True
        cut = node_cut[node]
        if cut_nodes.size:
            f = first[cut_nodes]
            r = act[f]
            groups.append(np.stack([r, run0[f], end[f] - run0[f], np.where(front[f] > 0, root[r], -1), front[f],
                                    counts[cut_nodes], cuts[f]]))
            gid = num_groups + np.searchsorted(cut_nodes, node[cut])
            num_groups += cut_nodes.size
            row_groups[act[cut], cuts[cut]] = gid
            cuts[cut] += 1
            run0[cut] = end[cut]
            front[cut] = 0
            row_skip[act[cut]] = end[cut]
            row_front[act[cut]] = 0
        # Children: the rows with pages to share past the node, by their next page.
        c0 = end
        more = (shareable[act] > c0) & (cuts < rule.max_depth)
        act, c0, run0, front, cuts, node = (x[more] for x in (act, c0, run0, front, cuts, node))
        at_root = np.zeros(act.size, dtype=bool)
        if act.size:
            key = (node.astype(np.int64) << 32) | block_table[act, c0].astype(np.int64)

    g = np.concatenate(groups, axis=1).astype(np.int32) if groups else np.zeros((7, 0), dtype=np.int32)
    return LevelTree(row=g[0], start=g[1], pages=g[2], slot=g[3], front=g[4], size=g[5], depth=g[6],
                     row_groups=row_groups, row_skip=row_skip.astype(np.int32),
                     row_front=row_front.astype(np.int32))


def saved_bound(shareable: np.ndarray, root: np.ndarray, root_pages: np.ndarray) -> int:
    """An upper bound on `find_levels(...).saved_pages()` for any rule, from the rows' lengths alone.

    A row's levels cover at most its L = slot pages + shareable pages, each page once. A tree saves
    sum_g (size_g - 1) * len_g = sum_r covered_r - sum_g len_g, and the levels' lengths sum to at
    least any one row's coverage, so it saves at most sum(covered) - max(covered) <= sum(L) - max(L)
    (the middle term grows with each covered_r). A step of a few requests can thus skip the search
    when even this cannot reach the planner's threshold.

    Example:
        >>> saved_bound(np.array([3, 3, 0]), np.array([-1, 0, 0]), np.array([4]))
        7
    """
    cover = slot_front(root, root_pages) + np.asarray(shareable, dtype=np.int64)
    return int(cover.sum() - cover.max(initial=0))


def slot_front(root: np.ndarray, root_pages: np.ndarray) -> np.ndarray:
    """int64 [B]: the slot pages each row reads first (`root_pages[root]`, 0 for a row with no slot).

    Example:
        >>> slot_front(np.array([1, -1, 0]), np.array([4, 2])).tolist()
        [2, 0, 4]
    """
    root = np.asarray(root, dtype=np.int64)
    root_pages = np.asarray(root_pages, dtype=np.int64)
    if not root_pages.size:
        return np.zeros(root.shape[0], dtype=np.int64)
    return np.where(root >= 0, root_pages[np.maximum(root, 0)], 0)


def _nodes(key: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """`np.unique(key, return_index, return_inverse, return_counts)` without the unique values:
    (each node's first row, each row's node, each node's rows), nodes in key order. A step whose
    keys are all distinct (nothing shared at this depth) costs one sort and one comparison."""
    order = np.argsort(key, kind="stable")
    sk = key[order]
    new = np.empty(key.shape[0], dtype=bool)
    new[:1] = True
    np.not_equal(sk[1:], sk[:-1], out=new[1:])
    if new.all():
        node = np.empty(key.shape[0], dtype=np.int64)
        node[order] = np.arange(key.shape[0])
        return order, node, np.ones(key.shape[0], dtype=np.int64)
    starts = np.flatnonzero(new)
    node = np.empty(key.shape[0], dtype=np.int64)
    node[order] = np.cumsum(new) - 1
    return order[starts], node, np.diff(starts, append=key.shape[0])


def _agreement(block_table, rows, rep, c0, lim) -> np.ndarray:
    """For each row: how many pages from its c0 on (at most `lim`) equal those of its `rep` row.

    Rows are compared in batches of one start page, with row gathers and slices: numpy copies a
    row's span at memory speed, where a 2-D fancy index costs about 30x more (1024 rows x 1024
    pages: 0.35 against 10 ms here). Only rows that agree on their first page are compared further
    (requests under one system prompt with nothing else shared: the rep row alone).
    """
    agree = np.zeros(rows.shape[0], dtype=np.int64)
    lo = int(c0.min(initial=0))
    starts = [lo] if lo == int(c0.max(initial=0)) else np.unique(c0).tolist()  # one start: the usual root
    for start in starts:
        sel = np.flatnonzero(c0 == start) if len(starts) > 1 else np.arange(rows.shape[0])
        sel = sel[(lim[sel] > 0) & (block_table[rows[sel], start] == block_table[rep[sel], start])]
        if not sel.size:
            continue
        width = int(lim[sel].max())
        reps = rep[sel]
        ref = block_table[reps[0], start: start + width] if (reps == reps[0]).all() else \
            block_table[reps, start: start + width]  # one node (the usual root): no second gather
        same = block_table[rows[sel], start: start + width] == ref
        first = same.argmin(axis=1)
        whole = same[np.arange(sel.shape[0]), first]  # no mismatch at all
        agree[sel] = np.minimum(np.where(whole, same.shape[1], first), lim[sel])
    return agree


def level_rows(tree: LevelTree, row_token: np.ndarray, num_tokens: int,
               row_len: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The levels' query rows: every query token of each member row, grouped by level.

    A level's pages all precede each member row's first query token (a decode token, or a chunk of
    a prompt whose shared part is already in the cache), so all of the row's tokens read it whole.

    Args:
        tree: the step's `LevelTree`.
        row_token: int [B], each row's first query token.
        num_tokens: T, the step's tokens.
        row_len: int [B], each row's query tokens (None: one each, a decode batch).

    Returns:
        (perm int32 [N], cu int32 [G + 1], row_index int32 [max_depth, T]): `perm[i]` is the token
        of level row i (rows of group g are cu[g]:cu[g+1]); `row_index[k, t]` is token t's row in
        its k-th level, -1 past its last.

    Example:
        >>> t = find_levels(np.array([[5, 6], [5, 6], [5, 7]], np.int32), np.array([2, 2, 1]),
        ...                 np.full(3, -1), np.zeros(0, np.int32), LevelRule(max_depth=2))
        >>> perm, cu, idx = level_rows(t, np.array([0, 1, 2]), 3)
        >>> perm.tolist(), cu.tolist(), idx.tolist()
        ([0, 1, 2, 0, 1], [0, 3, 5], [[0, 1, 2], [3, 4, -1]])
        >>> perm, cu, idx = level_rows(t, np.array([0, 1, 3]), 4, np.array([1, 2, 1]))  # row 1: 2 tokens
        >>> perm.tolist(), cu.tolist()
        ([0, 1, 2, 3, 0, 1, 2], [0, 4, 7])
    """
    rows, depth = np.nonzero(tree.row_groups >= 0)
    g = tree.row_groups[rows, depth]
    order = np.argsort(g, kind="stable")
    rows, depth, g = rows[order], depth[order], g[order]
    lens = np.ones(rows.shape[0], dtype=np.int64) if row_len is None else np.asarray(row_len, dtype=np.int64)[rows]
    total = int(lens.sum())
    first = np.cumsum(lens) - lens  # each (row, level) entry's first level row
    tokens = (np.repeat(np.asarray(row_token, dtype=np.int64)[rows] - first, lens) + np.arange(total)).astype(np.int32)
    cu = np.zeros(tree.num_groups + 1, dtype=np.int32)
    np.cumsum(np.bincount(g, weights=lens, minlength=tree.num_groups).astype(np.int64), out=cu[1:])
    row_index = np.full((tree.row_groups.shape[1], num_tokens), -1, dtype=np.int32)
    row_index[np.repeat(depth, lens), tokens] = np.arange(total, dtype=np.int32)
    return tokens, cu, row_index
