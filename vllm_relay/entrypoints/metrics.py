"""Relay series in the server's `/metrics`, from the engine cores' `relay_serving_stats`.

Named like vLLM's own series and labelled like them (`model_name`, `engine`: the data-parallel
rank). The engine core keeps cumulative counters; `update` turns each new reading into counter
increments, so the series behave as Prometheus counters also in multiprocess mode (several API
server processes, `PROMETHEUS_MULTIPROC_DIR`), where only the first API server process exports
them (vLLM sums a counter over processes).

Per-prompt series carry `name` and `slot`: at most one per slot exists at a time (a prompt's series
are removed when it leaves its slot), so their number is bounded by `max_prompts`. In multiprocess
mode prometheus_client cannot remove series: a removed prompt's gauges are set to 0 first, and its
series stay until the server restarts.
"""

from __future__ import annotations

import warnings

from prometheus_client import REGISTRY, CollectorRegistry, Counter, Gauge

PREFIX = "vllm_relay_"
STATES = ("filling", "ready", "draining", "failed")
FILL_RESULTS = {"ok": "fills_completed", "failed": "fills_failed", "cancelled": "fills_cancelled"}
# Engine-wide counters: series name (without _total) -> key of relay_serving_stats.
COUNTERS = {
    "vllm_relay_requests": (
        "relay_requests",
        "Requests served with relay attention (routed to a system prompt).",
    ),
    "vllm_relay_prompt_tokens_reused": (
        "system_tokens_reused",
        "System-prompt tokens relay requests did not compute (its length per request start).",
    ),
    "vllm_relay_scheduled_tokens": (
        "relay_tokens",
        "Tokens of relay requests computed with relay attention.",
    ),
    "vllm_relay_fill_tokens": ("fill_tokens", "Tokens computed to fill system prompts into the store."),
    "vllm_relay_refills": (
        "refills",
        "System prompts filled again through the current weights (after a prefix-cache reset, a weight "
        "update or a wake-up from sleep).",
    ),
    "vllm_relay_level_tokens": (
        "level_tokens",
        "Decode tokens that read shared levels (prefixes several requests share: registered system "
        "prompts, and what the prefix cache shares below them), each level read once per step.",
    ),
    "vllm_relay_levels": ("level_groups", "Shared levels run (one per shared prefix per step)."),
    "vllm_relay_kv_bytes_saved": (
        "kv_bytes_saved",
        "KV-cache bytes (all layers) not read again because shared levels read each prefix once.",
    ),
    "vllm_relay_whole_prompt_hits": (
        "whole_prompt_hits",
        "Requests whose prompt was computed before (the n samples of a prompt), which computed its last "
        "token only (into a copy of their last block; vLLM alone computes that block's tokens again).",
    ),
    "vllm_relay_chat_mismatches": (
        "chat_mismatches",
        "Chat requests whose system message is a registered prompt's text but whose tokens do not "
        "start with it (see the engine log for why).",
    ),
}
# Engine-wide gauges of the paged KV cache: key of relay_serving_stats -> (series name, documentation).
BLOCK_GAUGES = {
    "pinned_blocks": ("vllm_relay_pinned_kv_blocks", "KV-cache blocks held as the system prompts' pages."),
    "free_blocks": ("vllm_relay_free_kv_blocks", "Free KV-cache blocks of the engine (vLLM's block pool)."),
}
# Per-prompt series: name (without _total) -> (key of a listing entry, documentation).
PROMPT_COUNTERS = {
    "vllm_relay_system_prompt_requests": ("requests_served", "Requests served by this system prompt."),
    "vllm_relay_system_prompt_tokens_reused": (
        "tokens_reused",
        "System tokens reused by this prompt's requests.",
    ),
}
PROMPT_GAUGES = {
    "vllm_relay_system_prompt_live_requests": ("live_requests", "Requests running on this system prompt."),
    "vllm_relay_system_prompt_tokens": ("tokens", "Tokens of this system prompt."),
}


class RelayMetrics:
    def __init__(
        self, model_name: str, engines: list[int], max_prompts: int, registry: CollectorRegistry = REGISTRY
    ) -> None:
        if registry is REGISTRY:
            _unregister_ours(registry)  # a second server app in this process (tests) starts afresh
        self.model_name = model_name
        labels = ["model_name", "engine"]
        self.counters = {
            name: Counter(name, doc, labels, registry=registry) for name, (_, doc) in COUNTERS.items()
        }
        self.fills = Counter(
            "vllm_relay_fills",
            "System-prompt fills by result: ok, failed, or cancelled (deleted while filling).",
            [*labels, "result"],
            registry=registry,
        )
        self.held = Gauge(
            "vllm_relay_held_requests",
            "Requests waiting for their system prompt's fill.",
            labels,
            registry=registry,
            multiprocess_mode="mostrecent",
        )
        self.blocks = {
            key: Gauge(name, doc, labels, registry=registry, multiprocess_mode="mostrecent")
            for key, (name, doc) in BLOCK_GAUGES.items()
        }
        self.prompts = Gauge(
            "vllm_relay_system_prompts",
            "System prompts by state.",
            [*labels, "state"],
            registry=registry,
            multiprocess_mode="mostrecent",
        )
        self.slots = Gauge(
            "vllm_relay_system_prompt_slots",
            "Slots of the system-prompt store (max_prompts).",
            labels,
            registry=registry,
            multiprocess_mode="mostrecent",
        )
        prompt_labels = [*labels, "name", "slot"]
        self.prompt_counters = {
            name: Counter(name, doc, prompt_labels, registry=registry)
            for name, (_, doc) in PROMPT_COUNTERS.items()
        }
        self.prompt_gauges = {
            name: Gauge(name, doc, prompt_labels, registry=registry, multiprocess_mode="mostrecent")
            for name, (_, doc) in PROMPT_GAUGES.items()
        }
        self._last: dict[tuple, float] = {}  # (engine, series key) -> last cumulative value read
        self._live: dict[int, dict[tuple[str, str], int]] = {
            e: {} for e in engines
        }  # (name, slot) -> generation
        for engine in engines:
            self.slots.labels(model_name, str(engine)).set(max_prompts)

    def update(self, engine: int, stats: dict) -> None:
        """Apply one `relay_serving_stats` reading of engine `engine`."""
        labels = (self.model_name, str(engine))
        for name, (key, _) in COUNTERS.items():
            self._advance(self.counters[name].labels(*labels), (engine, name), stats[key])
        for result, key in FILL_RESULTS.items():
            self._advance(self.fills.labels(*labels, result), (engine, "fills", result), stats[key])
        self.held.labels(*labels).set(stats["held_requests"])
        for key, gauge in self.blocks.items():
            gauge.labels(*labels).set(stats[key])
        prompts = stats["prompts"]
        for state in STATES:
            self.prompts.labels(*labels, state).set(sum(p["state"] == state for p in prompts))
        self._update_prompts(engine, labels, [p for p in prompts if p["slot"] is not None])

    def _update_prompts(self, engine: int, labels: tuple[str, str], prompts: list[dict]) -> None:
        live, seen = self._live.setdefault(engine, {}), {}
        for p in prompts:
            series = (p["name"], str(p["slot"]))
            if live.get(series, p["generation"]) != p["generation"]:
                self._remove(engine, labels, series)  # the same name in the same slot: a new registration
            seen[series] = p["generation"]
            for name, (key, _) in PROMPT_COUNTERS.items():
                child = self.prompt_counters[name].labels(*labels, *series)
                self._advance(child, (engine, name, *series), p[key])
            for name, (key, _) in PROMPT_GAUGES.items():
                self.prompt_gauges[name].labels(*labels, *series).set(p[key])
        for series in [s for s in live if s not in seen]:
            self._remove(engine, labels, series)
        self._live[engine] = seen

    def _advance(self, child, key: tuple, value: float) -> None:
        last = self._last.get(key, 0)
        child.inc(value - last if value >= last else value)  # below: a new registration restarted it
        self._last[key] = value

    def _remove(self, engine: int, labels: tuple[str, str], series: tuple[str, str]) -> None:
        for gauge in self.prompt_gauges.values():
            gauge.labels(*labels, *series).set(0)
        with warnings.catch_warnings():  # multiprocess mode: "not implemented", the series stays
            warnings.simplefilter("ignore", UserWarning)
            for metric in (*self.prompt_gauges.values(), *self.prompt_counters.values()):
                metric.remove(*labels, *series)
        for name in self.prompt_counters:
            self._last.pop((engine, name, *series), None)


def _unregister_ours(registry: CollectorRegistry) -> None:
    for collector in list(registry._collector_to_names):
        if any(name.startswith(PREFIX) for name in registry._collector_to_names[collector]):
            registry.unregister(collector)
