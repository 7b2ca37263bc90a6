"""Host-side planning of relay attention, once per step. Pure numpy: no torch, no vLLM.

A relay request's system prompt lives in whole pages of the paged KV cache (its slot's pages).
Each step, every relay request takes one of two exact paths:

* **prefix** (merged): its context call reads `[slot pages ; own pages]` as one sequence, so a
  single FlashAttention call computes its attention, exactly what vLLM's default does for a
  request whose prompt prefix is cached. It costs one read of the system KV per request.
* **shared** (split): its context call reads only its own pages and returns the LSE; one grouped
  call reads each slot's pages once for every split token of that slot (matrix-matrix), and the
  relay fusion merges the two states by their LSEs.

The shared path pays when many decode tokens read the same system prompt in one step; a request
whose query fills FlashAttention's tiles by itself (a prefill chunk) gains nothing from it, since
its attention over the system part is compute-bound either way. `choose_shared` is that rule.
"""

from __future__ import annotations

import numpy as np

# A query of this many tokens or fewer re-reads the whole system KV for very little arithmetic
# (a decode step); longer queries (prefill chunks) already use the system KV as a matrix operand.
SHARED_MAX_QUERY_LEN = 1


def choose_shared(req_slot: np.ndarray, q_lens: np.ndarray, min_group: int) -> np.ndarray:
    """Which relay requests take the shared (split) path this step.

    Args:
        req_slot: int [B], the system slot of each request, -1 for a request without one.
        q_lens: int [B], the query tokens of each request this step.
        min_group: a slot's decode requests are split only if there are at least this many of
            them (one read of the system KV for the group, against one per request); 0 or 1
            splits every decode request, a huge value none.

    Returns:
        bool [B]: True for the requests whose decode tokens join their slot's shared group.

    Example:
        >>> choose_shared(np.array([0, 0, 1, -1, 0]), np.array([1, 1, 1, 1, 9]), 2).tolist()
        [True, True, False, False, False]
    """
    req_slot = np.asarray(req_slot)
    eligible = (req_slot >= 0) & (np.asarray(q_lens) <= SHARED_MAX_QUERY_LEN)
    if not eligible.any():
        return eligible
    counts = np.bincount(req_slot[eligible], minlength=int(req_slot.max()) + 1)
    return eligible & (counts[np.where(req_slot >= 0, req_slot, 0)] >= max(min_group, 1))


def group_rows(token_group: np.ndarray, num_groups: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Group tokens by a shared KV (a slot), keeping their order within a group (stable).

    Args:
        token_group: int [T], the group of each token, -1 for tokens that join no group.
        num_groups: G, the number of groups (slots); groups absent this step are empty.

    Returns:
        (perm int32 [N], cu int32 [G + 1], row_index int32 [T]): `perm[i]` is the token of
        grouped row i (rows of group g are cu[g]:cu[g+1]); `row_index[t]` is token t's grouped row,
        -1 for a token in no group.

    Example:
        >>> perm, cu, idx = group_rows(np.array([1, -1, 0, 1]), 3)
        >>> perm.tolist(), cu.tolist(), idx.tolist()
        ([2, 0, 3], [0, 1, 3, 3], [1, -1, 0, 2])
    """
    token_group = np.asarray(token_group)
    if token_group.size and (token_group.min() < -1 or token_group.max() >= num_groups):
        raise ValueError(f"group_rows: groups must be in [-1, {num_groups}), got "
                         f"[{token_group.min()}, {token_group.max()}]")
    tokens = np.flatnonzero(token_group >= 0)
    perm = tokens[np.argsort(token_group[tokens], kind="stable")].astype(np.int32)
    cu = np.zeros(num_groups + 1, dtype=np.int32)
    np.cumsum(np.bincount(token_group[tokens], minlength=num_groups), out=cu[1:])
    row_index = np.full(token_group.shape[0], -1, dtype=np.int32)
    row_index[perm] = np.arange(perm.shape[0], dtype=np.int32)
    return perm, cu, row_index
