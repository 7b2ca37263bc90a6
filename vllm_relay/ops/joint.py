"""A decode step's levels and its tokens' own pages in one FlashAttention call (a joint level).

On a decode step the context call is bound by its reads and a system level by its FLOPs, yet as two
persistent kernels they run one after the other (the first fills the GPU). One varlen call can hold
both: every token has one query, so the call can be non-causal, and each level becomes sequences of
at most `tokens_per_seq` of its rows over the level's pages. FlashAttention-3's varlen scheduler
hands tiles out in batch order, so the levels' sequences come first: their long tiles start at once
and the tokens' short ones fill the SMs around them and after them.

The call's queries are [the levels' rows ; the step's tokens] (one gather), its sequences [each
level's chunks ; padding chunks of no rows ; one per token], so that its output holds the levels'
rows from row 0 and the tokens' own from row N (the levels' row count, on the device for a CUDA
graph); `fuse_in_place.fuse_joint` merges them. This module plans that layout (host, numpy).
"""

import numpy as np


def joint_capacity(rows: int, groups: int, tokens_per_seq: int) -> int:
    """Sequences that `rows` level rows in at most `groups` levels can need."""
    return -(-rows // tokens_per_seq) + groups


def joint_layout(cu: np.ndarray, tokens_per_seq: int, num_tokens: int,
                 num_seqs: int | None = None) -> tuple[np.ndarray, np.ndarray]:
    """The joint call's sequences from the levels' row offsets `cu` ([G + 1]; level g's rows are
    cu[g]:cu[g+1]).

    Returns:
        (chunk_group int32 [J]: each level sequence's level; cu_joint int32 [S + num_tokens + 1]: the
        call's `cu_seqlens_q`, S = `num_seqs` level sequences (J of them real, the rest empty) then one
        query row per token, whose rows start at cu[-1]).

    Example:
        >>> g, c = joint_layout(np.array([0, 3, 8]), 4, 2, num_seqs=4)
        >>> g.tolist(), c.tolist()
        ([0, 1, 1], [0, 3, 7, 8, 8, 9, 10])
    """
    cu = np.asarray(cu, dtype=np.int64)
    sizes = -(-np.diff(cu) // tokens_per_seq)
    chunk_group = np.repeat(np.arange(sizes.shape[0]), sizes)
    first = np.repeat(np.cumsum(sizes) - sizes, sizes)
    starts = cu[chunk_group] + (np.arange(chunk_group.shape[0]) - first) * tokens_per_seq
    J = chunk_group.shape[0]
    num_seqs = J if num_seqs is None else num_seqs
    if J > num_seqs:
        raise ValueError(f"joint_layout: {J} level sequences exceed the call's {num_seqs}")
    n = int(cu[-1])
    cu_joint = np.concatenate([starts, np.full(num_seqs - J + 1, n), n + np.arange(1, num_tokens + 1)])
    return chunk_group.astype(np.int32), cu_joint.astype(np.int32)
