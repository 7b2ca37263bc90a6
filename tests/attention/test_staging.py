"""The planner's staging buffer: aligned views of exact length, one step's arrays written with the
plan's padding and copied to the device, and the key under which a staged plan is kept."""

import numpy as np
import torch

from vllm_relay.attention.staging import PARTS, StagingBuffer, same_key


def test_views_are_aligned_and_exact():
    sizes = [5, 5, 5, 17, 4, 3, 3, 3, 3, 3, 3, 2 * 9]
    buf = StagingBuffer(sizes, torch.device("cpu"))
    assert list(buf.views) == list(PARTS)
    for (name, view), n in zip(buf.views.items(), sizes):
        assert view.shape == (n,), name
        assert (view.data_ptr() - buf.dev.data_ptr()) % 128 == 0, name


def test_stage_writes_the_step_with_its_padding():
    B, T, depth, groups = 3, 4, 2, 3
    buf = StagingBuffer([B, B, B, 8, groups + 1, groups, groups, groups, groups, groups, groups, depth * T],
                        torch.device("cpu"))
    buf.dev.fill_(99)  # the device's last step: the whole span is copied over it
    facts = (np.array([0, 2]), np.array([1, 0]), np.array([48, 16]), np.array([5, 0]), np.array([0, -1]))
    row_index = np.array([[0, 1, -1, 2]], dtype=np.int32)
    buf.stage(B, T, depth, groups, np.array([5, 0, 5]), np.array([0, -1, 0]), np.array([1, 0, 2]),
              np.array([0, 1, 3]), np.array([0, 2, 3]), np.array([80, 32, 0]), facts, row_index)
    v = {name: view.tolist() for name, view in buf.views.items()}
    assert v["ctx_front"] == [5, 0, 5] and v["ctx_slot"] == [0, -1, 0] and v["ctx_skip"] == [1, 0, 2]
    assert v["perm"][:3] == [0, 1, 3]
    assert v["cu"] == [0, 2, 3, 3]  # the groups past the step's: empty
    assert v["group_row"][:2] == [0, 2] and v["group_own"][:2] == [48, 16] and v["group_slot"][:2] == [0, -1]
    assert v["lens"] == [80, 32, 0]
    assert v["row_index"] == [0, 1, -1, 2, -1, -1, -1, -1]  # the levels past the step's: none
    assert 99 not in buf.dev[: int(buf.offsets[11]) + depth * T].tolist()  # the used span, all of it


def test_a_staged_plan_is_kept_for_the_same_rows_and_tree_only():
    rows, tree = np.zeros(3, np.int32), object()
    key = (rows, tree, 8, True, 0)
    assert same_key(key, (rows, tree, 8, True, 0))
    assert not same_key(key, (rows.copy(), tree, 8, True, 0))  # equal rows, but another batch's facts
    assert not same_key(key, (rows, object(), 8, True, 0))
    assert not same_key(key, (rows, tree, 16, True, 0)) and not same_key(key, (rows, tree, 8, False, 0))
    assert not same_key(key, (rows, tree, 8, True, 1))  # a slot's pages changed
    assert not same_key(None, key)
