"""What both backends read off their layers (attention/common.py): a KV-cache group's sliding window."""

from types import SimpleNamespace as NS

import pytest

from vllm_relay.attention.common import window_of


@pytest.mark.parametrize("windows, want", [
    ([None, None], 0), ([-1], 0), ([(-1, -1)], 0),  # none, as vLLM's CPU and FlashAttention backends keep it
    ([64, 64], 64),  # the CPU backend: W
    ([(63, 0), (63, 0)], 64),  # FlashAttention: (W - 1, 0)
    ([], 0),
])
def test_window_of_a_groups_layers(windows, want):
    assert window_of([NS(sliding_window=w) for w in windows]) == want


def test_layers_of_one_group_with_different_windows_are_refused():
    with pytest.raises(NotImplementedError, match=r"different sliding windows \(\[0, 64\]\)"):
        window_of([NS(sliding_window=64), NS(sliding_window=None)])
