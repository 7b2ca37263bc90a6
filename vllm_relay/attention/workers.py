"""A worker's relay planners, found where vLLM keeps them: on the relay metadata builders of the
model runner's attention groups (`attn_groups`, the V1 runner's and Model Runner V2's alike). Relay
serves one KV-cache group, so the first planner answers the step's questions; every planner's stats
are summed (the engine's `relay_worker_stats`)."""

from __future__ import annotations

from vllm_relay.attention.planner import STATS, RelayPlanner
from vllm_relay.stats import sum_stats


def planners(attn_groups) -> list[RelayPlanner]:
    """The planners of the relay metadata builders among a runner's `attn_groups` (per KV-cache
    group, its attention groups, each with its builders), in order."""
    return [builder.planner for groups in attn_groups for group in groups for builder in group.metadata_builders
            if isinstance(getattr(builder, "planner", None), RelayPlanner)]


def worker_stats(worker) -> dict:
    """What `worker`'s planners did, summed: steps planned (full-graph ones, and those replaying the
    graph with the levels, too), requests that read their system pages through the prefix path, level
    rows (`shared_tokens`), levels, KV tokens and bytes not read again thanks to them, tokens by how
    many levels they read, and the most rows one level had (a maximum, not a sum). Callable through
    `LLM.collective_rpc(worker_stats)`."""
    found = planners(getattr(worker.model_runner, "attn_groups", ()))
    return sum_stats([dict.fromkeys(STATS, 0), *(planner.stats for planner in found)])
