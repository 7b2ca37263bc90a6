"""Relay counters (kept by the engine core, with how they are merged, summed and logged) and front-end
helpers to register prompts and read them.

The engine core exposes four utility calls (see `vllm_relay.engine.RelayEngine`):
`relay_register_system_prompt(name, prompt)`, `relay_unregister_system_prompt(name)`,
`relay_system_prompts()` and `relay_stats()`. The helpers below make them for a `vllm.LLM`
(`call_utility`, or a direct call when vLLM runs the engine in-process) and for an `AsyncLLM`
(`call_utility_async`). A failed call raises with the engine core's message.

Under data parallelism every engine core (one per rank) holds its own prompts and counters: the
AsyncLLM helpers register on each, wait for each, and add up their counters.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from typing import Any

# How often `register_system_prompt(wait=True)` asks whether the fill is done.
POLL_INTERVAL_S = 0.05


@dataclass(slots=True)
class RelayCounters:
    """Engine-core counters, cumulative since start-up."""

    relay_requests: int = 0  # requests admitted to the scheduler with a relay tag
    relay_tokens: int = 0  # scheduled tokens of relay requests (computed with relay attention)
    system_tokens_reused: int = 0  # S per relay request each time it starts from zero tokens
    fill_tokens: int = 0  # scheduled tokens of fill requests
    fills_completed: int = 0
    fills_failed: int = 0
    refills: int = 0  # prompts filled again through new weights (engine/refills.py)


def merge_worker_stats(workers: list[dict]) -> dict:
    """One engine's workers' planner stats (`attention.workers.worker_stats` of each) as one:
    every tensor-parallel rank plans the same steps, so counts are the first worker's; KV bytes
    (each rank reads its own KV heads) are summed over the workers."""
    if not workers:
        return {}
    return {**workers[0], "saved_kv_bytes": sum(w.get("saved_kv_bytes", 0) for w in workers)}


def level_summary(planners: dict) -> dict:
    """From merged planner stats, the shared levels the workers ran: decode tokens that read one or
    more (`level_tokens`), levels (`level_groups`), and KV-cache bytes not read again thanks to them
    (`kv_bytes_saved`, every layer)."""
    return {"level_tokens": sum(v for k, v in planners.items() if k.startswith("tokens_under_")),
            "level_groups": planners.get("level_groups", 0), "kv_bytes_saved": planners.get("saved_kv_bytes", 0)}


def sum_stats(parts: list[dict]) -> dict:
    """Planner stats added up (the planners of one worker, or several engines: data-parallel
    ranks); `max_*` keys take the max."""
    total: dict = {}
    for stats in parts:
        add_stats(total, stats)
    return total


def add_stats(total: dict, stats: dict) -> None:
    """Add `stats` into `total` in place (`max_*` keys take the max): `sum_stats` of two, without a
    new dict (the planner counts every step)."""
    for key, value in stats.items():
        total[key] = (max if key.startswith("max_") else int.__add__)(total.get(key, 0), value)


def log_loop(ref, interval_s: float) -> None:
    """Every `interval_s`, the engine's summary logged if it changed (`ref`: a weak reference to its
    RelayEngine); ends with the engine. Its own thread, so an idle engine still logs its last change.
    Reads counters without a lock: a log line may mix two steps' values, nothing else."""
    while True:
        time.sleep(interval_s)
        relay = ref()
        if relay is None:
            return
        relay.log_if_changed()
        del relay


def summary_line(counters: RelayCounters, prompts: list[dict], held: int) -> str:
    """The one-line summary the engine core logs (prompts as `relay_system_prompts` gives them)."""
    listed = ", ".join(
        f"{p['name']}[slot {p['slot']}, {p['state']}, {p['tokens']} tok, {p['refcount']} refs]"
        for p in prompts
    )
    c = counters
    return (
        f"prompts: {listed or 'none'}; relay requests {c.relay_requests}, relay tokens "
        f"{c.relay_tokens}, system tokens reused {c.system_tokens_reused}, fills "
        f"{c.fills_completed} ok / {c.fills_failed} failed, held requests {held}"
    )


# ---- vllm.LLM ------------------------------------------------------------------------------


def _call(llm, method: str, *args) -> Any:
    client = llm.llm_engine.engine_core
    if hasattr(client, "call_utility"):  # the engine core runs in its own process
        return client.call_utility(method, *args)
    return getattr(client.engine_core, method)(*args)  # in-process (VLLM_ENABLE_V1_MULTIPROCESSING=0)


def register_system_prompt(llm, name: str, prompt, wait: bool = True, timeout_s: float = 600.0) -> dict:
    """Register `prompt` (text, token ids or {"chat_system": text}) as `name` in `llm`'s engine.

    The engine fills it through its scheduler, between other requests. With `wait`, return once
    it is ready (requests sent before then that start with it are held until it is); raise if
    the fill fails or takes longer than `timeout_s`.
    """
    state = _call(llm, "relay_register_system_prompt", name, prompt)
    deadline = time.monotonic() + timeout_s
    while wait and state["state"] != "ready":
        if not hasattr(llm.llm_engine.engine_core, "call_utility"):
            # In-process: nothing else runs the engine. Stepping would also consume the outputs
            # of other requests in flight, so refuse rather than lose them.
            if llm.llm_engine.output_processor.has_unfinished_requests():
                raise RuntimeError("register_system_prompt(wait=True) with the in-process engine "
                                   "needs no other requests in flight; use wait=False")
            llm.llm_engine.step()
        else:
            time.sleep(POLL_INTERVAL_S)
        state = _find(name, _call(llm, "relay_system_prompts"), state)
        if time.monotonic() > deadline:
            raise TimeoutError(f"system prompt {name!r} not ready after {timeout_s} s: {state}")
    return state


def unregister_system_prompt(llm, name: str) -> None:
    _call(llm, "relay_unregister_system_prompt", name)


def system_prompts(llm) -> list[dict]:
    """Every registered prompt: {name, slot, state, tokens, refcount, generation}."""
    return _call(llm, "relay_system_prompts")


def relay_stats(llm) -> dict:
    """The engine core's counters (`RelayCounters`), the shared levels the workers ran
    (`level_tokens`, `level_groups`, `kv_bytes_saved`), `whole_prompt_hits` (requests whose prompt was
    computed before, which computed its last token only: `engine/cache_hits.py`), `held_requests` and
    `prompts`."""
    return _call(llm, "relay_stats")


def planner_stats(llm) -> dict:
    """What the workers' relay planners did (steps planned, levels, tokens under them, KV bytes
    not read again: `attention.workers.worker_stats`), for this engine's workers."""
    return _call(llm, "relay_planner_stats")


def _find(name: str, prompts: list[dict], registered: dict) -> dict:
    for p in prompts:
        if p["name"] == name and p["generation"] == registered["generation"]:
            if p["state"] == "failed":
                raise RuntimeError(f"system prompt {name!r} failed to fill: {p['error']}")
            return p
    raise RuntimeError(f"system prompt {name!r} was unregistered or replaced while filling")


# ---- AsyncLLM (the OpenAI server's engine client) -----------------------------------------


async def _on_each_engine(engine, method: str, *args) -> list:
    """Utility call `method` on every engine core of an AsyncLLM, in rank order. (vLLM's own
    `call_utility_async` reaches every data-parallel rank too, but returns only the first one's
    answer.)"""
    from vllm_relay.entrypoints.engines import call_each

    return list((await call_each(engine, method, *args)).values())


async def async_register_system_prompt(engine, name: str, prompt, wait: bool = True,
                                       timeout_s: float = 600.0) -> dict:
    """`register_system_prompt` for an `AsyncLLM`: on every engine core (data-parallel rank);
    with `wait`, until it is ready on all of them. Returns the first rank's state."""
    states = await _on_each_engine(engine, "relay_register_system_prompt", name, prompt)
    deadline = time.monotonic() + timeout_s
    while wait and any(s["state"] != "ready" for s in states):
        await asyncio.sleep(POLL_INTERVAL_S)
        listed = await _on_each_engine(engine, "relay_system_prompts")
        states = [_find(name, prompts, state) for prompts, state in zip(listed, states, strict=True)]
        if time.monotonic() > deadline:
            raise TimeoutError(f"system prompt {name!r} not ready after {timeout_s} s: {states}")
    return states[0]


async def async_relay_stats(engine) -> dict:
    """`relay_stats` for an `AsyncLLM`. Under data parallelism: the counters added up over the
    engine cores, `prompts` as the first one lists them, and each one's own stats in `engines`."""
    per_engine = await _on_each_engine(engine, "relay_stats")
    if len(per_engine) == 1:
        return per_engine[0]
    keys = (*RelayCounters.__dataclass_fields__, "level_tokens", "level_groups", "kv_bytes_saved",
            "whole_prompt_hits", "held_requests")
    summed = {k: sum(e[k] for e in per_engine) for k in keys}
    return {**summed, "prompts": per_engine[0]["prompts"], "engines": per_engine}


async def async_planner_stats(engine) -> dict:
    """`planner_stats` for an `AsyncLLM`: summed over every engine core (data-parallel rank) and,
    within each, merged over its workers (`merge_worker_stats`)."""
    return sum_stats(await _on_each_engine(engine, "relay_planner_stats"))
