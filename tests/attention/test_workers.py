"""This worker's planners as the hooks see them: the first one answers the step's questions, every
one's stats are summed (a maximum for `max_level_rows`)."""

from types import SimpleNamespace

import pytest

from vllm_relay.attention import workers


@pytest.fixture
def planners(monkeypatch):
    made = []
    monkeypatch.setattr(workers, "_planners", made)
    return made


def fake(stats, unsplit_from=None):
    asked = []

    def levels_for(step):
        asked.append(("levels", step))
        step.tree = "found"

    def runs_unsplit(tree, num_tokens):
        asked.append(("unsplit", tree, num_tokens))
        return unsplit_from is not None and num_tokens >= unsplit_from

    return SimpleNamespace(stats=stats, levels_for=levels_for, runs_unsplit=runs_unsplit, asked=asked)


def test_no_planner_answers_nothing_and_counts_zero(planners):
    step = SimpleNamespace(tree="t")
    workers.find_step_levels(step)
    assert step.tree == "t" and not workers.step_runs_unsplit(step, 256)
    stats = workers.worker_stats()
    assert set(stats) == set(workers.STATS) and not any(stats.values())


def test_the_first_planner_answers_and_all_are_summed(planners):
    first = fake({"planned_steps": 3, "unsplit_graph_steps": 2, "max_level_rows": 40}, unsplit_from=256)
    second = fake({"planned_steps": 4, "unsplit_graph_steps": 1, "max_level_rows": 70})
    workers.register(first)
    workers.register(second)
    step = SimpleNamespace(tree=None)
    assert not workers.step_runs_unsplit(step, 512)  # no levels: nothing to run unsplit, the rule not asked
    workers.find_step_levels(step)
    assert step.tree == "found" and first.asked == [("levels", step)] and second.asked == []
    assert workers.step_runs_unsplit(step, 512) and not workers.step_runs_unsplit(step, 128)
    assert first.asked[1:] == [("unsplit", "found", 512), ("unsplit", "found", 128)] and second.asked == []
    stats = workers.worker_stats()
    assert (stats["planned_steps"], stats["unsplit_graph_steps"], stats["max_level_rows"]) == (7, 3, 70)
