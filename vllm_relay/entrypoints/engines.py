"""The front end's calls into the engine cores' relay utility methods (engine/core.py UTILITY_CALLS).

Each engine core has its own registry and system-prompt store, so registering and deleting go
to every engine this front end manages (one, or several with data parallelism), and listings
and stats are read from each. vLLM's `EngineClient` protocol has no per-engine utility call: the
async engine-core client's (`AsyncMPClient._call_utility_async`, the method its own
`call_utility_async` and data-parallel broadcast use) is used when there are several engines.
"""

from __future__ import annotations

import asyncio
from typing import Any

# The state of a prompt that decides the merged state of the same registration across engines:
# any engine still filling (or failed) makes the whole registration so.
_STATE_ORDER = ("failed", "filling", "draining", "ready", "removed")
_SUMMED = ("live_requests", "requests_served", "tokens_reused", "chat_mismatches")


def engine_ranks(engine_client) -> list[int]:
    return list(getattr(engine_client.engine_core, "engine_ranks_managed", None) or [0])


def is_first_front_end(engine_client) -> bool:
    """Whether this API server process is the first (client index 0) of several, or the only one."""
    return getattr(engine_client.engine_core, "client_index", 0) == 0


async def call_each(engine_client, method: str, *args) -> dict[int, Any]:
    """`method(*args)` on every engine core this front end manages: {engine rank: result}."""
    core = engine_client.engine_core
    ranks = engine_ranks(engine_client)
    engines = getattr(core, "core_engines", None) or []
    if len(engines) > 1 and len(engines) == len(ranks) and hasattr(core, "_call_utility_async"):
        results = await asyncio.gather(*[core._call_utility_async(method, *args, engine=e) for e in engines])
        return dict(zip(ranks, results))
    return {ranks[0]: await core.call_utility_async(method, *args)}


def first_error(results: dict[int, Any]) -> dict | None:
    for result in results.values():
        if isinstance(result, dict) and "error" in result:
            return result["error"]
    return None


def merge_listings(listings: list[list[dict]]) -> list[dict]:
    """One listing from each engine's: the same registration (name, generation, slot) once, its
    counters summed, its state the least advanced of them; in the first engine's order."""
    merged: dict[tuple, dict] = {}
    for listing in listings:
        for entry in listing:
            key = (entry["name"], entry["generation"], entry["slot"])
            if key not in merged:
                merged[key] = dict(entry)
                continue
            into = merged[key]
            for field in _SUMMED:
                into[field] += entry[field]
            into["created_at"] = min(into["created_at"], entry["created_at"])
            into["state"] = min(into["state"], entry["state"], key=_STATE_ORDER.index)
    return list(merged.values())
