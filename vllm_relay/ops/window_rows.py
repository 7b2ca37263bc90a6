"""The levels of a sliding-window layer: each level row's first visible key. Pure numpy.

A layer with a window of W tokens lets the query at position p see keys p - W + 1 .. p only. A level
(a run of pages several rows share, `level_tree.py`) then holds, for each of its rows, a suffix it
sees: the row's first visible key of the level is its position less W - 1 less the level's first
position (clipped by the kernel: below 0 the row sees the whole level, at or past its end none of it).
The rows' positions move on every decode step while the plan's rows stay, so the planner keeps, per
level row, its request and a fixed offset, and gets the key from the request's KV length on the device
each step: `key_start = seq_lens[row_req] + row_off` (`window_row_offsets`).

vLLM frees a window layer's blocks that have left every window of a request, so in that KV-cache group
a row's table holds its own block ids only from its window on (before it: the null block, or ids freed
since). The levels come from a full-attention group's tables (the same positions, other block ids), so
the window group's level table is read from the level's row that is furthest behind, and each other
row's ids from its first visible page on must be that row's (`window_level_rows`); where they are not,
the group's layers read no level this step.
"""

from __future__ import annotations

import numpy as np

from vllm_relay.ops.level_tree import LevelTree


def window_row_offsets(tree: LevelTree, perm: np.ndarray, cu: np.ndarray, query_start: np.ndarray,
                       shift: np.ndarray, page_size: int, window: int) -> tuple[np.ndarray, np.ndarray]:
    """Each level row's request and key offset: its first visible key of its level is
    `seq_len[row_req] + row_off`, with `seq_len` its request's own KV tokens after the step.

    Args:
        tree: the step's levels; perm, cu: their rows (`level_rows`), row i of group g in cu[g]:cu[g+1].
        query_start: int [B + 1], each request's first query token (and the end).
        shift: int [B], each request's system tokens in front of its own (a registered prompt's shift).
        page_size: tokens a page; window: W, the layer's window in tokens.

    Returns:
        (row_req int32 [N], row_off int32 [N]).
    """
    n = perm.shape[0]
    group = np.repeat(np.arange(cu.shape[0] - 1), np.diff(cu))[:n]
    req = np.searchsorted(query_start, perm, side="right") - 1
    # A token's own position is seq_len - (its request's end - token); its position adds the shift. A
    # level reading its slot's pages starts at position 0, one of own pages at shift + start pages.
    start = np.where(tree.front[group] > 0, 0, shift[req] + tree.start[group] * page_size)
    offset = shift[req] - (query_start[req + 1] - perm) - (window - 1) - start
    return req.astype(np.int32), offset.astype(np.int32)


def window_level_rows(tree: LevelTree, perm: np.ndarray, cu: np.ndarray, row_req: np.ndarray,
                      first_key: np.ndarray, table: np.ndarray, page_size: int) -> np.ndarray | None:
    """For each level, the row (request) whose table the window group's level table is read from: its
    member furthest behind; None when some member's own block ids from its first visible page on are not
    that row's (the window group then reads no level this step).

    Args:
        tree, perm, cu: the step's levels and their rows; row_req: each level row's request.
        first_key: int [N], each level row's first visible key of its level now (later steps' only grow).
        table: the window group's block table, host side, [>= B, W], in the step's request order.

    Returns:
        int32 [G], each level's table row, or None.
    """
    rows = tree.row.copy()
    for g in range(tree.num_groups):
        a, b = int(cu[g]), int(cu[g + 1])
        if a == b:
            continue
        reqs, keys = row_req[a:b], first_key[a:b]
        # own pages of the level each row sees: from its first visible page (past the slot's front) on
        seen = np.maximum(keys // page_size - tree.front[g], 0) + tree.start[g]
        end = int(tree.start[g] + tree.pages[g])
        far = int(np.argmin(seen))
        rep, lo = int(reqs[far]), int(seen[far])
        rows[g] = rep
        want = table[rep, lo:end]
        for r, s in zip(reqs.tolist(), seen.tolist()):
            if s < end and not np.array_equal(table[r, s:end], want[s - lo:]):
                return None
    return rows.astype(np.int32)
