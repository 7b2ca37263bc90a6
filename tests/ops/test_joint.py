"""vllm_relay/ops/joint.py: a joint call's layout, the levels' rows in sequences then one per token."""

import numpy as np
import pytest

from vllm_relay.ops.joint import joint_capacity, joint_layout


@pytest.mark.parametrize("seed", range(8))
def test_layout_covers_every_row_once_in_order(seed):
    """Random levels (some of one row, some long) cut into sequences of at most `per` rows that never
    span two levels, padded with empty ones to the capacity, then one query row per token."""
    rng = np.random.default_rng(seed)
    sizes = rng.integers(1, 90, size=int(rng.integers(0, 7)))
    cu = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int32)
    per, T = int(rng.choice([1, 8, 16, 64])), int(rng.integers(1, 40))
    seqs = joint_capacity(int(cu[-1]), len(sizes), per) + int(rng.integers(0, 3))
    group, cu_joint = joint_layout(cu, per, T, num_seqs=seqs)
    n = int(cu[-1])
    assert cu_joint.shape == (seqs + T + 1,) and cu_joint.dtype == np.int32
    assert (np.diff(cu_joint) >= 0).all() and cu_joint[0] == 0
    J = group.shape[0]
    lens = np.diff(cu_joint[: J + 1])
    assert (lens > 0).all() and (lens <= per).all()  # real sequences: 1..per rows
    assert (cu_joint[J: seqs + 1] == n).all()  # padding: empty
    assert (np.diff(cu_joint[seqs:]) == 1).all() and cu_joint[-1] == n + T  # a row per token, after the levels'
    for g in range(len(sizes)):  # each level's rows, exactly, in its own sequences
        mine = np.flatnonzero(group == g)
        assert cu_joint[mine[0]] == cu[g] and cu_joint[mine[-1] + 1] == cu[g + 1]
        assert mine.shape[0] == -(-sizes[g] // per)


def test_layout_without_capacity_and_over_it():
    group, cu_joint = joint_layout(np.array([0, 3, 8]), 4, 2)
    assert group.tolist() == [0, 1, 1] and cu_joint.tolist() == [0, 3, 7, 8, 9, 10]
    _, cu_joint = joint_layout(np.array([0]), 4, 3)  # no level: the tokens alone
    assert cu_joint.tolist() == [0, 1, 2, 3]
    with pytest.raises(ValueError, match="exceed"):
        joint_layout(np.array([0, 3, 8]), 4, 2, num_seqs=2)
