"""vllm_relay/ops/window_launch.py: the window level's launch rules, against the grids they are held to
(the kernel's results with these launches: tests/ops/test_window_level.py)."""

from vllm_relay.ops.window_launch import MAX_SPLITS, num_splits, tiles


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
