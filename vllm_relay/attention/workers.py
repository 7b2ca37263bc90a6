"""A worker's relay planners, found where vLLM keeps them: on the relay metadata builders of the
model runner's attention groups (`attn_groups`, the V1 runner's and Model Runner V2's alike). The
step's levels are found by one planner (`level_planner`) in its KV-cache group's tables, and read by
every planner; every planner's stats are summed (the engine's `relay_worker_stats`)."""

from __future__ import annotations

from vllm_relay.attention.planner import STATS, RelayPlanner
from vllm_relay.stats import sum_stats


def planners(attn_groups) -> list[RelayPlanner]:
    """The planners of the relay metadata builders among a runner's `attn_groups` (per KV-cache
    group, its attention groups, each with its builders), in order, each told its group's index
    (`kv_group`: the slot pages it reads are that group's)."""
    return _planners((index, group) for index, groups in enumerate(attn_groups) for group in groups)


def drafter_planners(runner) -> list[RelayPlanner]:
    """The planners of the relay builders a drafter model made for its own layers (vLLM's EAGLE
    proposer keeps attention groups of its own, `draft_attn_groups`, each naming its KV-cache group):
    its layers read the step's system-prompt pages as the target's do."""
    groups = getattr(getattr(runner, "drafter", None), "draft_attn_groups", ())
    return _planners((group.kv_cache_group_id, group) for group in groups)


def _planners(indexed_groups) -> list[RelayPlanner]:
    """The relay planners of the builders of (KV-cache group index, attention group) pairs, each told
    its group's index."""
    found = []
    for index, group in indexed_groups:
        for builder in group.metadata_builders:
            planner = getattr(builder, "planner", None)
            if isinstance(planner, RelayPlanner):
                planner.kv_group = index
                found.append(planner)
    return found


def level_planner(found: list[RelayPlanner]) -> RelayPlanner | None:
    """The planner that finds each step's levels: the first of full-attention layers that may read
    levels, else the first of sliding-window ones (a model with windows in every layer; a window
    group's tables hold each row's blocks from its window on only, so a full group's are the ones to
    search), None when no layer may read levels."""
    may = [planner for planner in found if planner.levels]
    return next((planner for planner in may if not planner.window), may[0] if may else None)


def worker_stats(worker) -> dict:
    """What `worker`'s planners did, summed: steps planned (full-graph ones, and those replaying the
    graph with the levels, too), requests that read their system pages through the prefix path, level
    rows (`shared_tokens`), levels, KV tokens and bytes not read again thanks to them, tokens by how
    many levels they read, and the most rows one level had (a maximum, not a sum). Callable through
    `LLM.collective_rpc(worker_stats)`."""
    found = planners(getattr(worker.model_runner, "attn_groups", ()))
    return sum_stats([dict.fromkeys(STATS, 0), *(planner.stats for planner in found)])
