"""stats.py: planner stats merged over one engine's workers, summed over engines and summarized; the
engine's log loop."""

from vllm_relay.stats import level_summary, log_loop, merge_worker_stats, sum_stats


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


def test_log_loop_logs_while_its_engine_lives_and_ends_with_it():
    calls = []
    engine = type("Engine", (), {"log_if_changed": lambda self: calls.append("logged")})()
    refs = iter([engine, engine, None])
    log_loop(lambda: next(refs), 0.0)  # returns: the engine is gone at the third look
    assert calls == ["logged", "logged"]


def test_level_summary_counts_level_tokens_levels_and_saved_bytes():
    planners = {"tokens_under_1_levels": 5, "tokens_under_2_levels": 3, "level_groups": 4, "saved_kv_bytes": 4096,
                "planned_steps": 9}
    assert level_summary(planners) == {"level_tokens": 8, "level_groups": 4, "kv_bytes_saved": 4096}
    assert level_summary({}) == {"level_tokens": 0, "level_groups": 0, "kv_bytes_saved": 0}
