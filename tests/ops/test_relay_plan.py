"""Host planning of the shared level: the split rule and the stable grouping of tokens by slot."""

import numpy as np
import pytest

from vllm_relay.ops import SHARED_MAX_QUERY_LEN, choose_shared, group_rows


def test_group_rows_against_a_naive_loop():
    rng = np.random.default_rng(3)
    for T, G in [(0, 3), (1, 1), (37, 4), (513, 7)]:
        groups = rng.integers(-1, G, size=T)
        perm, cu, row_index = group_rows(groups, G)
        expected = [t for g in range(G) for t in range(T) if groups[t] == g]  # stable, by group
        assert perm.tolist() == expected
        assert cu.tolist() == [0] + np.cumsum([np.sum(groups == g) for g in range(G)]).tolist()
        for row, t in enumerate(perm):
            assert row_index[t] == row
        assert (row_index[groups < 0] == -1).all()
        assert perm.dtype == cu.dtype == row_index.dtype == np.int32


def test_group_rows_rejects_out_of_range_groups():
    with pytest.raises(ValueError, match="groups must be in"):
        group_rows(np.array([0, 3]), 3)
    with pytest.raises(ValueError, match="groups must be in"):
        group_rows(np.array([-2]), 3)


@pytest.mark.parametrize("min_group", [0, 1, 2, 3, 10])
def test_choose_shared_against_a_naive_rule(min_group):
    rng = np.random.default_rng(min_group)
    slots = rng.integers(-1, 4, size=200)
    q_lens = rng.choice([1, 1, 1, 2, 7, 128], size=200)
    got = choose_shared(slots, q_lens, min_group)
    for b in range(200):
        decode = slots[b] >= 0 and q_lens[b] <= SHARED_MAX_QUERY_LEN
        peers = sum(1 for c in range(200) if slots[c] == slots[b] and q_lens[c] <= SHARED_MAX_QUERY_LEN)
        assert got[b] == (decode and peers >= max(min_group, 1)), b


def test_choose_shared_without_relay_requests():
    assert not choose_shared(np.array([-1, -1]), np.array([1, 1]), 1).any()
    assert choose_shared(np.array([], dtype=np.int64), np.array([], dtype=np.int64), 1).shape == (0,)
