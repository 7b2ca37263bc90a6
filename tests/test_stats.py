"""stats.py: planner stats merged over one engine's workers, and summed over engines."""

from vllm_relay.stats import merge_worker_stats, sum_stats


def test_tensor_parallel_workers_count_steps_once_and_sum_their_bytes():
    ranks = [{"planned_steps": 7, "level_groups": 3, "saved_kv_bytes": 1000, "max_level_rows": 5},
             {"planned_steps": 7, "level_groups": 3, "saved_kv_bytes": 1000, "max_level_rows": 5}]
    assert merge_worker_stats(ranks) == {"planned_steps": 7, "level_groups": 3, "saved_kv_bytes": 2000,
                                         "max_level_rows": 5}
    assert merge_worker_stats([]) == {}


def test_engines_add_up_and_maxima_stay_maxima():
    engines = [{"planned_steps": 7, "saved_kv_bytes": 2000, "max_level_rows": 5},
               {"planned_steps": 4, "saved_kv_bytes": 300, "max_level_rows": 9}, {}]
    assert sum_stats(engines) == {"planned_steps": 11, "saved_kv_bytes": 2300, "max_level_rows": 9}
