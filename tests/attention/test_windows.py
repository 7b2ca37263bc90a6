"""A window layer's level rows (attention/windows.py): staged once per plan, their first visible keys made
from the step's KV lengths each step; a group whose tables differ from the levels' stages nothing."""

from types import SimpleNamespace

import numpy as np
import torch

from vllm_relay.attention.windows import WindowRows
from vllm_relay.ops.level_tree import LevelRule, find_levels, level_rows

PS = 4


def test_keys_follow_the_kv_lengths_of_each_step_and_clear_reads_request_0():
    table = np.array([[5, 6, 7, 8], [5, 6, 7, 9]], dtype=np.int32)
    tree = find_levels(table, np.array([3, 3]), np.array([-1, -1]), np.zeros(0, np.int32), LevelRule())
    query_start = np.array([0, 1, 2], dtype=np.int32)
    perm, cu, _ = level_rows(tree, query_start[:-1], 2)
    step = SimpleNamespace(req_shift=np.zeros(2, np.int32), level_group=1, tables=[table, table],
                           seq_lens=np.array([15, 13], np.int32))
    rows = WindowRows(6, PS, 8, torch.device("cpu"))
    assert rows.stage(step, tree, perm, cu, query_start, kv_group=0).tolist() == [1]  # the row furthest behind
    # the level (12 keys) seen from keys 9 and 7: 3 + 5 read per row, 5 read once: 3 saved
    assert rows.saved == 3
    order = perm.tolist()  # the level's rows: request of each
    # a decode token at own position seq_len - 1 sees keys from seq_len - 6 on (the level starts at 0)
    assert rows.keys(torch.tensor([15, 13], dtype=torch.int32), 4)[:2].tolist() == [[9, 7][r] for r in order]
    assert rows.keys(torch.tensor([16, 14], dtype=torch.int32), 2).tolist() == [[10, 8][r] for r in order]  # the next step
    assert rows.keys(torch.tensor([16, 14], dtype=torch.int32), 4)[2:].tolist() == [16, 16]  # past the rows: request 0, offset 0
    rows.clear()
    assert rows.keys(torch.tensor([16, 14], dtype=torch.int32), 2).tolist() == [16, 16]
    other = table.copy()
    other[0, 2] = 40  # inside request 0's window: its ids differ from the level's
    step.tables = [other, table]
    assert rows.stage(step, tree, perm, cu, query_start, kv_group=0) is None
