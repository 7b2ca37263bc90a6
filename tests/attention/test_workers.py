"""A worker's planners as the hooks find them: on the relay metadata builders of the runner's
attention groups, in order, each told its KV-cache group; the one that finds the levels; every one's stats
summed (a maximum for `max_level_rows`)."""

from types import SimpleNamespace

from vllm_relay.attention import workers
from vllm_relay.attention.planner import STATS, RelayPlanner


def planner(stats):
    made = RelayPlanner.__new__(RelayPlanner)  # only its stats are read here
    made.stats = dict.fromkeys(STATS, 0) | stats
    return made


def groups(*builders_per_group):
    """vLLM's `attn_groups`: per KV-cache group, its attention groups, each with its builders."""
    return [[SimpleNamespace(metadata_builders=list(builders)) for builders in builders_per_group]]


def test_the_relay_builders_planners_in_order_and_no_other_builders():
    first, second = planner({}), planner({})
    vllm_builder = SimpleNamespace()  # a builder of vLLM's own (another backend's layers)
    odd = SimpleNamespace(planner="not a relay planner")
    found = workers.planners(groups([SimpleNamespace(planner=first), vllm_builder], [odd, SimpleNamespace(
        planner=second)]))
    assert found == [first, second] and found[0] is first
    assert workers.planners([]) == []


def test_worker_stats_sum_every_planner_and_count_zero_without_one():
    first = planner({"planned_steps": 3, "unsplit_graph_steps": 2, "max_level_rows": 40})
    second = planner({"planned_steps": 4, "unsplit_graph_steps": 1, "max_level_rows": 70})
    worker = SimpleNamespace(model_runner=SimpleNamespace(attn_groups=groups(
        [SimpleNamespace(planner=first)], [SimpleNamespace(planner=second)])))
    stats = workers.worker_stats(worker)
    assert (stats["planned_steps"], stats["unsplit_graph_steps"], stats["max_level_rows"]) == (7, 3, 70)
    empty = workers.worker_stats(SimpleNamespace(model_runner=SimpleNamespace(attn_groups=[])))
    assert set(empty) == set(STATS) and not any(empty.values())


def test_each_planner_learns_its_kv_cache_group_and_a_full_attention_one_finds_the_levels():
    """Two KV-cache groups (a model's sliding-window layers, then its full-attention ones): each planner is
    told its group's index, and the levels are found by the first planner of full-attention layers (a
    window group's tables hold each row's blocks from its window on only); by a window group's when every
    layer has a window; by none when no layer may read levels."""
    window, full = planner({}), planner({})
    window.levels, window.window, full.levels, full.window = True, 64, True, 0
    found = workers.planners([*groups([SimpleNamespace(planner=window)]), *groups([SimpleNamespace(planner=full)])])
    assert found == [window, full] and (window.kv_group, full.kv_group) == (0, 1)
    assert workers.level_planner(found) is full
    assert workers.level_planner([window]) is window
    window.levels = False
    assert workers.level_planner([window]) is None
