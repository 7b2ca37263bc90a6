"""metrics.py: engine readings become Prometheus counters and gauges; per-prompt series stay bounded."""

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from vllm_relay.entrypoints.metrics import RelayMetrics


def reading(requests=0, reused=0, prompts=(), **extra):
    return {
        "relay_requests": requests,
        "system_tokens_reused": reused,
        "relay_tokens": 0,
        "fill_tokens": 0,
        "chat_mismatches": 0,
        "fills_completed": 1,
        "fills_failed": 0,
        "fills_cancelled": 0,
        "refills": 0,
        "level_tokens": 0,
        "level_groups": 0,
        "kv_bytes_saved": 0,
        "whole_prompt_hits": 0,
        "held_requests": 0,
        "pinned_blocks": 0,
        "free_blocks": 0,
        "prompts": list(prompts),
        **extra,
    }


def prompt(name, slot, generation, served=0, state="ready", live=0):
    return {
        "name": name,
        "slot": slot,
        "generation": generation,
        "state": state,
        "requests_served": served,
        "tokens_reused": 10 * served,
        "live_requests": live,
        "tokens": 10,
    }


def scrape(registry):
    samples = {}
    for family in text_string_to_metric_families(generate_latest(registry).decode()):
        for s in family.samples:
            if not s.name.endswith("_created"):
                samples[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return samples


def value(samples, metric, **labels):
    return samples[(metric, tuple(sorted({"model_name": "m", "engine": "0", **labels}.items())))]


def test_counters_follow_the_engine_totals():
    registry = CollectorRegistry()
    m = RelayMetrics("m", [0], max_prompts=2, registry=registry)
    m.update(0, reading(3, 30, [prompt("a", 0, 1, served=3)]))
    m.update(0, reading(5, 50, [prompt("a", 0, 1, served=5, live=2)], held_requests=4))
    s = scrape(registry)
    assert (
        value(s, "vllm_relay_requests_total") == 5 and value(s, "vllm_relay_prompt_tokens_reused_total") == 50
    )
    assert value(s, "vllm_relay_fills_total", result="ok") == 1 and value(s, "vllm_relay_held_requests") == 4
    assert value(s, "vllm_relay_system_prompts", state="ready") == 1
    assert value(s, "vllm_relay_system_prompts", state="draining") == 0
    assert value(s, "vllm_relay_system_prompt_slots") == 2
    assert value(s, "vllm_relay_system_prompt_requests_total", name="a", slot="0") == 5
    assert value(s, "vllm_relay_system_prompt_live_requests", name="a", slot="0") == 2


def test_per_prompt_series_are_removed_with_their_prompt_and_restart_for_a_new_registration():
    registry = CollectorRegistry()
    m = RelayMetrics("m", [0], max_prompts=2, registry=registry)
    m.update(0, reading(4, 0, [prompt("a", 0, 1, served=4), prompt("b", 1, 2, served=0)]))
    m.update(0, reading(4, 0, [prompt("a", 0, 3, served=0)]))  # b deleted; a re-registered in slot 0
    s = scrape(registry)
    assert value(s, "vllm_relay_system_prompt_requests_total", name="a", slot="0") == 0
    assert not [k for k in s if ("name", "b") in k[1]]
    failed = dict(prompt("c", None, 4, state="failed"))
    m.update(0, reading(4, 0, [failed]))
    s = scrape(registry)
    assert value(s, "vllm_relay_system_prompts", state="failed") == 1
    assert not [k for k in s if k[0].startswith("vllm_relay_system_prompt_") and ("name", "a") in k[1]]


def test_engines_are_labelled_separately():
    registry = CollectorRegistry()
    m = RelayMetrics("m", [0, 1], max_prompts=1, registry=registry)
    m.update(0, reading(2))
    m.update(1, reading(7))
    s = scrape(registry)
    assert (
        value(s, "vllm_relay_requests_total") == 2 and value(s, "vllm_relay_requests_total", engine="1") == 7
    )


def test_level_and_block_series_follow_the_engine():
    registry = CollectorRegistry()
    m = RelayMetrics("m", [0], max_prompts=1, registry=registry)
    m.update(0, reading(level_tokens=7, level_groups=2, kv_bytes_saved=4096, refills=1))
    m.update(0, reading(level_tokens=19, level_groups=5, kv_bytes_saved=8192, refills=3, pinned_blocks=6,
                        free_blocks=90))
    s = scrape(registry)
    assert value(s, "vllm_relay_level_tokens_total") == 19
    assert value(s, "vllm_relay_levels_total") == 5
    assert value(s, "vllm_relay_kv_bytes_saved_total") == 8192
    assert value(s, "vllm_relay_refills_total") == 3
    assert value(s, "vllm_relay_pinned_kv_blocks") == 6 and value(s, "vllm_relay_free_kv_blocks") == 90
