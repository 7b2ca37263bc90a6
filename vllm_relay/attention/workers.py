"""This worker's relay planners: what the runner and dispatcher hooks ask of them each step, and
what they did (the engine's `relay_worker_stats`). Relay serves one KV-cache group, so the hooks ask
the first planner; every planner's stats are summed."""

from __future__ import annotations

from vllm_relay.attention import step as relay_step
from vllm_relay.attention.rules import MAX_LEVELS
from vllm_relay.stats import sum_stats

STATS = ("planned_steps", "graph_steps", "level_graph_steps", "one_split_steps", "unsplit_graph_steps",
         "joint_steps", "prefix_requests", "shared_tokens", "level_groups", "saved_kv_tokens",
         "saved_kv_bytes",
         *(f"tokens_under_{k}_levels" for k in range(1, MAX_LEVELS + 1)), "max_level_rows")

# Every planner of this worker process (attention.planner.RelayPlanner), in the order they were made.
_planners: list = []


def register(planner) -> None:
    _planners.append(planner)


def worker_stats(_worker=None) -> dict:
    """What this worker's planners did, summed: steps planned (full-graph ones, and those replaying
    the graph with the levels, too), requests that read their system pages through the prefix path,
    level rows (`shared_tokens`), levels, KV tokens and bytes not read again thanks to them, tokens by
    how many levels they read, and the most rows one level had (a maximum, not a sum). Callable
    through `LLM.collective_rpc(worker_stats)` (the worker argument is ignored)."""
    return sum_stats([dict.fromkeys(STATS, 0), *(planner.stats for planner in _planners)])


def find_step_levels(step: relay_step.RelayStep) -> None:
    """The step's levels, found once by this worker's planner, right after the runner prepared the
    step's inputs: before vLLM picks its CUDA graph."""
    if _planners:
        _planners[0].levels_for(step)


def step_runs_unsplit(step: relay_step.RelayStep, num_tokens: int) -> bool:
    """Whether `step`, a decode step with levels replayed in a full graph of `num_tokens` (padded),
    runs its joint call unsplit: what the planner's plan will decide for it, asked before vLLM picks
    the graph (hooks/graphs.py)."""
    return bool(_planners) and step.tree is not None and _planners[0].runs_unsplit(step.tree, num_tokens)
