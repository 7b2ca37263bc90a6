"""vllm_relay/ops/window_launch.py: the window level's launch rules, against the grids they are held to
(the kernel's results with these launches: tests/ops/test_window_level.py)."""

import pytest

from vllm_relay.ops.window_launch import MAX_SPLITS, launch, num_splits, one_group_variants, tiles


def test_large_heads_take_small_tiles_while_the_grid_stays_small():
    assert tiles(64, 2, 256, 8, 132)[:2] == (16, 32)  # one group of 8 KV heads: 64 programs
    assert tiles(64, 2, 256, 66 * 8, 132)[:2] == (64, 16)  # a 64-token graph's 66 groups: 4,224 programs
    assert tiles(64, 8, 64, 8, 132)[:2] == (64, 64)  # heads of 64: tiles of 64 pairs as ever
    assert tiles(300, 2, 256)[:2] == (16, 32)  # no multiprocessor count: the small tiles


def test_splits_fill_the_multiprocessors_twice_and_no_more():
    assert num_splits(132, 132) == num_splits(1000, 132) == 1
    assert num_splits(64, 132) == 8  # 5 ranges would make 320 programs: a power of two, 8
    assert num_splits(8, 132) == num_splits(1, 132) == MAX_SPLITS
    assert num_splits(100, 132) == 4


def test_no_more_ranges_than_a_rows_keys_fill():
    """`keys`: the most keys a row reads (a window's length): ranges of MIN_SPLIT_KEYS (128) at least, a
    power of two of them."""
    assert num_splits(8, 132, keys=128) == num_splits(8, 132, keys=100) == 1  # gpt-oss's windows
    assert num_splits(8, 132, keys=700) == 4
    assert num_splits(8, 132, keys=1024) == 8  # Gemma 3's
    assert num_splits(8, 132, keys=10**6) == num_splits(8, 132) == MAX_SPLITS
    assert num_splits(1000, 132, keys=10**6) == 1


def test_a_graphs_call_and_an_eager_steps_share_a_compiled_variant():
    """Gemma 3's window layers, 64 samples of a 4096-token prompt on an H100: the decode graph's call (its
    66 groups, 64 tokens) and the eager step of the 63 siblings (one group) launch the same constants, so
    no compilation waits in the first step that reads the level."""
    graph_grid, graph = launch(64, 2, 8, 256, 66, 64, 1024, 132)
    eager_grid, eager = launch(63, 2, 8, 256, 1, 63, 1024, 132)
    assert graph == eager and graph["COMPACT"] and graph["SPLITS"] == 8
    assert graph_grid == eager_grid == (264,)  # (2 programs a multiprocessor, looping over the real tiles)


def test_the_grid_by_group_launches_every_tile_of_every_group(monkeypatch):
    import vllm_relay.ops.window_launch as rules

    monkeypatch.setattr(rules, "COMPACT_FROM_GROUPS", None)
    grid, consts = launch(64, 2, 8, 256, 66, 64, 1024, 132)
    assert not consts["COMPACT"] and consts["BLOCK_G"] == 1
    assert grid == (66, 8, 64 // (consts["BLOCK_M"] // 2) * consts["SPLITS"])


@pytest.mark.parametrize("hq, hkv, d, keys", [(16, 8, 256, 1024), (64, 8, 64, 128), (32, 8, 128, 4096),
                                              (12, 4, 80, None), (8, 8, 200, 700)])
@pytest.mark.parametrize("num_sms", [132, 78, 7])
def test_one_group_variants_are_every_row_counts(hq, hkv, d, keys, num_sms):
    """What the warm-up compiles (`one_group_variants`, which stops at the first row count taking the
    largest count's constants) is every row count's constants, each first met at the count it names."""
    every = {}
    for rows in range(1, 2500):
        consts = tuple(sorted(launch(1, hq // hkv, hkv, d, 1, rows, keys, num_sms)[1].items()))
        every.setdefault(consts, rows)
    assert one_group_variants(hq // hkv, hkv, d, 2499, keys, num_sms) == every
