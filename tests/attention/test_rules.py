"""attention/rules.py: the MLA step's unsplit rule (the other rules are checked where the planner applies
them: test_planner_graphs.py, test_planner_joint.py)."""

from vllm_relay.attention.rules import MLA_TILE_ROWS, mla_one_split


def test_an_mla_step_runs_unsplit_once_its_query_tiles_fill_the_multiprocessors():
    # DeepSeek-V2-Lite on one H100: 16 query heads, 132 multiprocessors, tiles of 64 rows
    assert MLA_TILE_ROWS == 64
    assert not mla_one_split(524, 16, 132)  # 8384 rows: 131 tiles
    assert mla_one_split(525, 16, 132)  # 8400 rows: 132 tiles (the last one partly filled)
    assert mla_one_split(16384, 16, 132)  # the step that asked FA3 for 2 GiB of split buffers
    assert not mla_one_split(64, 16, 132) and not mla_one_split(1024, 128, 1024 * 2 + 1)
    assert mla_one_split(66, 128, 132)  # DeepSeek-V3's 128 heads on one GPU: from 66 tokens
