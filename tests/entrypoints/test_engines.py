"""engines.py: one listing from several engines' (data parallelism)."""

import asyncio

from vllm_relay.entrypoints.engines import call_each, first_error, merge_listings


def entry(name, state="ready", served=1, generation=1, slot=0, created=100):
    return {
        "name": name,
        "state": state,
        "slot": slot,
        "generation": generation,
        "live_requests": 1,
        "requests_served": served,
        "tokens_reused": 10 * served,
        "chat_mismatches": 0,
        "created_at": created,
    }


def test_merge_sums_counters_and_keeps_the_least_advanced_state():
    merged = merge_listings(
        [[entry("a", served=2, created=50), entry("b")], [entry("a", served=3), entry("b", state="filling")]]
    )
    assert [(e["name"], e["state"], e["requests_served"], e["live_requests"]) for e in merged] == [
        ("a", "ready", 5, 2),
        ("b", "filling", 2, 2),
    ]
    assert merged[0]["created_at"] == 50 and merged[0]["tokens_reused"] == 50
    assert len(merge_listings([[entry("a", generation=1)], [entry("a", generation=2, slot=1)]])) == 2


class OneEngine:
    engine_ranks_managed = [0]

    async def call_utility_async(self, method, *args):
        return {"error": {"status": 409, "message": method}} if args else [method]


class Client:
    engine_core = OneEngine()


def test_call_each_and_first_error():
    assert asyncio.run(call_each(Client(), "relay_prompt_list")) == {0: ["relay_prompt_list"]}
    results = asyncio.run(call_each(Client(), "relay_prompt_add", "a"))
    assert first_error(results) == {"status": 409, "message": "relay_prompt_add"}
    assert first_error({0: {"prompt": {}}}) is None
