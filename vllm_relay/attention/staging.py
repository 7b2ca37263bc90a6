"""The plan's host side: one pinned int32 staging buffer and its device twin, and what it holds.

The planner writes each step's plan arrays (the context tables' and the levels' facts) into one host
buffer and copies the span used to the device in one transfer; every layer, and every CUDA graph
captured over the device views, reads them there. A decode step over the same rows and tree as the
last (most decode steps) would write the same arrays: `Staged` is what a staging holds, kept under a
key, so that such a step writes, copies and launches none of it again.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

# The buffer's parts, in order (one view each).
PARTS = ("ctx_front", "ctx_slot", "ctx_skip", "perm", "cu", "lens", "group_row", "group_start", "group_own",
         "group_front", "group_slot", "row_index")


class StagingBuffer:
    """The pinned host buffer and its device twin, cut into the views of `PARTS` (`sizes`, int32
    elements each). Each view starts 128-byte aligned: Triton specializes kernels on their pointers'
    alignment, and a view at an odd offset would make the kernels compiled at start-up miss."""

    def __init__(self, sizes: list[int], device: torch.device) -> None:
        self.offsets = np.concatenate(([0], np.cumsum([-(-n // 32) * 32 for n in sizes])))
        self.device = device
        self.host = torch.zeros(int(self.offsets[-1]), dtype=torch.int32, pin_memory=device.type == "cuda")
        self.host_np = self.host.numpy()
        self.dev = torch.zeros_like(self.host, device=device)
        self.views = dict(zip(PARTS, (self.dev[a: a + n] for a, n in zip(self.offsets[:-1], sizes))))

    def host_part(self, name: str, n: int) -> np.ndarray:
        """The first `n` values of one part as the last `stage` wrote them, on the host (a view)."""
        start = int(self.offsets[PARTS.index(name)])
        return self.host_np[start: start + n]

    def stage(self, B, T, depth, groups, ctx_front, ctx_slot, ctx_skip, perm, cu, lens, facts, row_index) -> None:
        """Write the host arrays (padding: cu flat to `groups` + 1, row_index -1; `facts`: each level
        sequence's (row, start, own, front, slot), or None) and copy the used span to the device in
        one transfer."""
        host, off = self.host_np, self.offsets
        host[off[0]: off[0] + B] = ctx_front
        host[off[1]: off[1] + B] = ctx_slot
        host[off[2]: off[2] + B] = ctx_skip
        n = perm.shape[0]
        host[off[3]: off[3] + n] = perm
        host[off[4]: off[4] + cu.shape[0]] = cu
        host[off[4] + cu.shape[0]: off[4] + groups + 1] = cu[-1]
        host[off[5]: off[5] + lens.shape[0]] = lens
        for i, values in enumerate(facts or ()):
            host[off[6 + i]: off[6 + i] + values.shape[0]] = values
        host[off[11]: off[11] + depth * T] = -1
        host[off[11]: off[11] + row_index.size] = row_index.reshape(-1)
        end = int(off[11]) + depth * T
        self.dev[:end].copy_(self.host[:end], non_blocking=self.device.type == "cuda")


@dataclass
class Staged:
    """What the staging buffer, its device twin and the level tables hold: a plan less its context
    lengths. Kept while `key` (row facts, tree, requests, graph, slot pages: `RelayPlanner.plan`)
    stays, so that a decode step over the same rows stages, copies and launches nothing again."""

    key: tuple | None
    groups: int  # the level call's groups (a graph's capacity, or the step's)
    rows: int  # its rows (likewise)
    depth: int  # the row index's levels
    num_rows: int  # level rows this step
    max_group_rows: int
    max_group_len: int
    max_front: int  # most slot pages a context reads in front
    one_split: bool
    counts: dict  # what each step of it adds to the stats (`RelayPlanner._counts`)
    joint_tokens: int = 0  # a joint call's tokens per level sequence (0: none, `RelayPlanner.plan`)


def same_key(a: tuple | None, b: tuple) -> bool:
    """Keys of `Staged`: the same row facts and tree objects, the same counts.

    Example:
        >>> rows, tree = object(), object()
        >>> same_key((rows, tree, 8, True, 0), (rows, tree, 8, True, 0)), same_key(None, (rows, None, 8, True, 0))
        (True, False)
    """
    return a is not None and a[0] is b[0] and a[1] is b[1] and a[2:] == b[2:]
