"""A sliding-window layer's level rows, as its planner keeps them (ops/window_rows.py has the math).

Each level row's first visible key moves on with every decode step while the plan's rows stay: the
rows' requests and key offsets are staged once per plan, and the keys made each step on the device
from the requests' KV lengths (`keys`), into a persistent buffer the level call reads (a CUDA graph
replays it with the step's keys).
"""

from __future__ import annotations

import numpy as np
import torch

from vllm_relay.ops.window_rows import window_level_rows, window_row_offsets


class WindowRows:
    """Per level row (up to `max_rows`): its request and key offset (staged), and its first visible key."""

    def __init__(self, window: int, page_size: int, max_rows: int, device: torch.device) -> None:
        self.window, self.page_size, self.device = window, page_size, device
        self._host = torch.zeros(2, max_rows, dtype=torch.int32, pin_memory=device.type == "cuda")
        self._dev = torch.zeros_like(self._host, device=device)
        self.key_start = torch.zeros(max_rows, dtype=torch.int32, device=device)
        self.saved: int | None = None  # KV tokens the staged levels save a step (None: not known)

    def stage(self, step, tree, perm, cu, query_start, kv_group: int) -> np.ndarray | None:
        """Stage the rows of `tree`'s levels (`perm`, `cu`: `level_rows`'); each level's table row in
        group `kv_group`, or None where its tables differ from the levels' (the group then reads no
        level this step: nothing staged)."""
        row_req, row_off = window_row_offsets(tree, perm, cu, query_start, step.req_shift, self.page_size,
                                              self.window)
        level_row = tree.row
        if step.level_group != kv_group and tree.pages.any():  # own pages, read from another group's tables
            if step.tables is None or step.tables[kv_group] is None or step.seq_lens is None:
                return None
            first_key = step.seq_lens[row_req] + row_off
            level_row = window_level_rows(tree, perm, cu, row_req, first_key, step.tables[kv_group],
                                          self.page_size)
            if level_row is None:
                return None
        self.saved = None if step.seq_lens is None else saved_tokens(tree, cu, step.seq_lens[row_req] + row_off,
                                                                      self.page_size)
        n = perm.shape[0]
        self._host[0, :n], self._host[1, :n] = torch.from_numpy(row_req), torch.from_numpy(row_off)
        self._host[:, n:] = 0
        self._dev.copy_(self._host, non_blocking=self.device.type == "cuda")
        return level_row

    def clear(self) -> None:
        """No level rows: a graph's rows read request 0."""
        self._dev.zero_()

    def keys(self, seq_lens: torch.Tensor, rows: int) -> torch.Tensor:
        """Each of the first `rows` level rows' first visible key this step, on the device: its request's
        KV length (`seq_lens`) plus its offset (a graph's rows past the step's read request 0: their
        output is never merged)."""
        keys = self.key_start[:rows]
        torch.index_select(seq_lens, 0, self._dev[0, :rows], out=keys)
        return keys.add_(self._dev[1, :rows])


def saved_tokens(tree, cu: np.ndarray, first_key: np.ndarray, page_size: int) -> int:
    """KV tokens a step of these levels saves a window layer: each row would read the keys of its level it
    sees; the level reads, once, those its furthest-behind row sees."""
    group = np.repeat(np.arange(cu.shape[0] - 1), np.diff(cu))
    length = ((tree.front + tree.pages) * page_size)[group]
    seen = np.clip(length - np.maximum(first_key, 0), 0, None)
    most = np.zeros(cu.shape[0] - 1, dtype=np.int64)
    np.maximum.at(most, group, seen)
    return int(seen.sum() - most.sum())
