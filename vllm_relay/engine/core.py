"""`RelayEngine`: the engine core's system prompts, the requests routed to them, and counters.

The patches in hooks/engine.py only forward to it; it never imports them. A request's path:

1. `preprocess` (the engine core's input thread): route by longest registered prefix. A ready
   prompt is acquired and the request rewritten to its own tokens, a relay tag and a relay salt;
   a longer prompt that is still filling marks it held instead. Others pass unchanged.
2. `add` (busy loop): held requests wait in `_held` until their fill finishes; if it fails they
   run the ordinary way (full prompt). Others go to the scheduler.
3. `on_schedule` / `on_outputs` / `on_free` (the scheduler, busy loop): count, hide fill outputs
   from clients, release the prompt once the request is freed, finish fills (engine/fills.py).
4. `finish_held` (the scheduler's `finish_requests`): aborts reach held requests too, by id or all
   at once (pause(mode="abort"), shutdown), and their clients get the same finish as the others.

Prefix-cache isolation: routed requests and fills carry salts made with a per-engine secret
(`salt_secret`), so no client-supplied `cache_salt` can share blocks with them.
"""

from __future__ import annotations

import threading
import weakref
from dataclasses import asdict
from typing import Any

from vllm_relay.config import RelayConfig, check_prompt_name, check_prompt_spec
from vllm_relay.engine.admin import RelayAdmin, error
from vllm_relay.engine.cache_hits import CacheHitMemo
from vllm_relay.engine.fills import Fills
from vllm_relay.engine.hashes import PromptHashMemo
from vllm_relay.engine.pages import PromptPages
from vllm_relay.engine.refills import Refills
from vllm_relay.engine.requests import (
    ENGINE_ATTR,
    INFO_ATTR,
    RelayInfo,
    SentPrompts,
    relay_eligible,
    rewrite,
    strip_forged_tag,
)
from vllm_relay.engine.vllm_calls import vllm_method
from vllm_relay.hooks._patch import swap
from vllm_relay.protocol import TAG_KEY
from vllm_relay.stats import RelayCounters, level_summary, log_loop, merge_worker_stats, summary_line
from vllm_relay.system_prompts import SystemPrompt, SystemPromptRegistry, match_filling, route
from vllm_relay.system_prompts.fill import salt_secret
from vllm_relay.validate import drafter_lookahead


def _logger():
    from vllm.logger import init_logger

    return init_logger("vllm.relay.engine")


# The engine core's utility calls (`call_utility("relay_stats")` looks them up on the EngineCore
# object): each is a RelayEngine method. The offline helpers (vllm_relay/stats.py) call the first
# five; the OpenAI server's relay endpoints and /metrics (vllm_relay/entrypoints/) the others.
UTILITY_CALLS = {
    "relay_register_system_prompt": "register_system_prompt",
    "relay_unregister_system_prompt": "unregister_system_prompt",
    "relay_system_prompts": "system_prompts",
    "relay_stats": "stats",
    "relay_planner_stats": "planner_stats",
    "relay_prompt_add": "prompt_add",
    "relay_prompt_delete": "prompt_delete",
    "relay_prompt_list": "prompt_list",
    "relay_prompt_texts": "prompt_texts",
    "relay_serving_stats": "serving_stats",
}


def describe(p: SystemPrompt) -> dict:
    return {"name": p.name, "slot": p.slot, "state": p.state, "tokens": p.num_tokens,
            "refcount": p.refcount, "generation": p.generation, "error": None}


class RelayEngine:
    """The one owner of the engine core's relay state (registry, pages, counters, secret, config,
    the vLLM core). Its helpers (RelayAdmin, Refills, Fills) get only the parts they use, and
    every utility call (UTILITY_CALLS) is one of its methods.

    Threads: `preprocess` runs on the engine core's input thread, everything else on its busy
    loop (which also serves utility calls); they share only the registry, which locks."""

    def __init__(self, core, config: RelayConfig) -> None:
        self.core = core
        self.config = config
        self.registry = SystemPromptRegistry.from_config(config)
        self.counters = RelayCounters()
        self.max_model_len: int = core.vllm_config.model_config.max_model_len
        # Starts every relay and fill salt; never leaves the engine core (see salt_secret).
        self.secret = salt_secret()
        self.pages = PromptPages(core.scheduler, core.vllm_config.cache_config.block_size,
                                 drafter_lookahead(core.vllm_config))
        # per-prompt usage, and what the serving surface's utility calls read and change
        self.admin = RelayAdmin(self.registry, self.pages, config, self.max_model_len)
        # prompts filled again after the weights may have changed
        self.refills = Refills(core, self.registry, self.pages, self.counters, self.admin)
        self.fills = Fills(core, config, self.registry, self.pages, self.secret, self.counters, self.admin,
                           self.refills, admit_held=self.admit_held)
        self._held: dict[str, tuple[Any, int]] = {}  # request id -> (Request, wave)
        self._system_lens: dict[str, int] = {}  # tagged request in the scheduler -> tokens stripped (0: fill)
        self._freed: dict[str, int] = {}  # the same, for requests freed since the last outputs
        self._last_line = ""
        self._steps = 0  # steps scheduled so far, and the workers' stats as of the last one asked
        self._level_stats: tuple[int, dict] = (-1, {})
        self.cache_hits: CacheHitMemo | None = None  # the scheduler's prefix-cache lookups (attach)
        self.sent_prompts = SentPrompts()  # the prompts a reference from the front end stands for

    # ---- start-up ----------------------------------------------------------------------------

    @classmethod
    def attach(cls, core) -> RelayEngine:
        """Attach to `core` and its scheduler, expose the utility calls, fill configured prompts.

        The scheduler must be relay's (`engine/scheduler.py`): it is what calls the RelayEngine."""
        from vllm_relay.engine.scheduler import check

        check(core.scheduler)
        relay = cls(core, RelayConfig.from_vllm(core.vllm_config.additional_config))
        swap(core, ENGINE_ATTR, relay)
        swap(core.scheduler, ENGINE_ATTR, relay)
        if core.request_block_hasher is not None:  # a prompt's blocks hashed once for its repeats
            swap(core, "request_block_hasher", PromptHashMemo(core.request_block_hasher,
                                                              core.scheduler.hash_block_size))
        # and looked up in the prefix cache once for them (None where vLLM's lookup is not the plain walk)
        relay.cache_hits = CacheHitMemo.install(core.scheduler.kv_cache_manager)
        for call, method in UTILITY_CALLS.items():
            swap(core, call, getattr(relay, method))
        relay.fills.startup()
        if relay.config.system_prompts:
            relay._last_line = relay.summary()
            _logger().info("vllm-relay: system prompts ready: %s", relay._last_line)
        if relay.config.log_stats_interval_s:
            threading.Thread(target=log_loop, args=(weakref.ref(relay), relay.config.log_stats_interval_s),
                             name="vllm-relay-stats", daemon=True).start()
        return relay

    # ---- utility calls -----------------------------------------------------------------------

    def register_system_prompt(self, name: str, prompt: Any) -> dict:
        """Register `prompt` (text, token ids or {"chat_system": text}) as `name` and start its
        fill through the scheduler. Returns its state: "filling", or "ready" when the same
        tokens are already registered and filled. A registration that fails later (its fill) is
        listed as "failed", with the reason, by `system_prompts`."""
        check_prompt_name(name)
        spec = check_prompt_spec(f"system prompt {name!r}", prompt, self.config.max_prompt_tokens)
        return describe(self.fills.register(name, spec))

    def unregister_system_prompt(self, name: str) -> None:
        self.registry.unregister(name)
        self.pages.sweep(self.registry)

    def system_prompts(self) -> list[dict]:
        """Every prompt holding a slot, by slot, then the last failed registrations, with why."""
        failed = [{"name": f["name"], "slot": None, "state": "failed", "tokens": f["tokens"], "refcount": 0,
                   "generation": f["generation"], "error": f.get("error")} for f in self.admin.failed()]
        return [describe(p) for p in self.registry.prompts()] + failed

    def stats(self) -> dict:
        """Counters, levels, held requests, prompts, and the paged KV cache's blocks: pinned as
        the prompts' pages, and free (what vLLM's scheduler can allocate)."""
        pool = self.core.scheduler.kv_cache_manager.block_pool
        whole = self.cache_hits.whole_prompt_hits if self.cache_hits is not None else 0
        return {**asdict(self.counters), **self.level_stats(), "whole_prompt_hits": whole,
                "held_requests": len(self._held),
                "pinned_blocks": self.pages.num_blocks(), "free_blocks": pool.get_num_free_blocks(),
                "prompts": self.system_prompts()}

    def level_stats(self) -> dict:
        """`stats.level_summary` of the workers' planners. Asked of the workers only when steps ran
        since the last time: an idle engine sends them no message (a message every metrics refresh
        would keep vLLM's idle workers spinning, not sleeping)."""
        if self._level_stats[0] == self._steps:
            return self._level_stats[1]
        planners = self.planner_stats()
        stats = level_summary(planners)
        if planners:
            self._level_stats = (self._steps, stats)
        return stats

    def planner_stats(self) -> dict:
        """The workers' planner stats, merged (`merge_worker_stats`); {} before they have any."""
        try:
            has_workers = hasattr(self.core, "model_executor")
            workers = self.core.collective_rpc("relay_worker_stats") if has_workers else []
        except NotImplementedError:  # no relay attention builder in the workers yet (start-up)
            workers = []
        return merge_worker_stats(workers)

    # The serving surface's calls: like those above, but they answer a caller's mistake with
    # {"error": {"status", "message"}} instead of raising (engine/admin.py).

    def prompt_add(
        self, name: str, token_ids: list[int], source: str, text: str | None = None, replace: bool = False
    ) -> dict:
        """Register `token_ids` as `name` and start its fill; {"prompt": entry} or {"error"}."""
        if (refused := self.admin.refuse_add(name, token_ids, source, replace)) is not None:
            return refused
        try:
            prompt = self.fills.register(name, token_ids)
        except ValueError as e:  # e.g. token ids outside the vocabulary
            return error(422, str(e))
        return self.admin.added(prompt, source, text)

    def prompt_delete(self, name: str) -> dict:
        return self.admin.delete(name, self.core.abort_requests)

    def prompt_list(self) -> list[dict]:
        return self.admin.listing()

    def prompt_texts(self) -> dict[str, dict]:
        return self.admin.texts()

    def serving_stats(self) -> dict:
        """What the server's /metrics shows: `stats`, the serving surface's counters, and prompts
        as `prompt_list` gives them."""
        return {**self.stats(), "fills_cancelled": self.admin.fills_cancelled,
                "chat_mismatches": self.admin.chat_mismatches, "prompts": self.prompt_list()}

    def summary(self) -> str:
        return summary_line(self.counters, self.system_prompts(), len(self._held))

    # ---- requests in -------------------------------------------------------------------------

    def preprocess(self, request) -> tuple[Any, int]:
        """`EngineCore.preprocess_add_request` for an EngineCoreRequest, routed (step 1 above)."""
        preprocess = vllm_method("preprocess_add_request")
        request = self.sent_prompts.resolve(request)  # first: a prompt sent once stands for this one too
        sent, request = request, strip_forged_tag(request)
        if request is not sent:
            _logger().warning_once("vllm-relay: dropped the %r key of a request's extra_args (vllm_xargs): "
                                   "only the engine core tags requests for relay", TAG_KEY)
        request, expected = self.admin.take_chat_expectation(request)
        if not relay_eligible(request):
            return preprocess(self.core, request)
        ids = request.prompt_token_ids
        routed = route(ids, self.registry, acquire=True)
        prompt = routed.prompt if routed is not None else None
        filling = match_filling(ids, self.registry, longer_than=routed.system_len if routed else 0)
        if filling is not None:
            if prompt is not None:
                self.registry.release(prompt)
            prompt = filling
        self.admin.check_chat(expected, ids)
        if prompt is None:
            return preprocess(self.core, request)
        try:
            routed_request = rewrite(request, prompt, self.pages.relay_len(prompt), self.max_model_len,
                                     self.secret)
            req, wave = preprocess(self.core, routed_request)
        except BaseException:
            if filling is None:
                self.registry.release(prompt)
            raise
        held = filling is not None
        swap(req, INFO_ATTR, RelayInfo(prompt, held=held, original=request if held else None,
                                          acquired=not held))
        return req, wave

    def add(self, request, wave: int) -> None:
        """`EngineCore.add_request`: to the scheduler, or held while its prompt fills."""
        self.fills.finish()
        info: RelayInfo | None = getattr(request, INFO_ATTR, None)
        if info is not None and info.held:
            if self.registry.try_acquire(info.prompt):
                info.held, info.original, info.acquired = False, None, True
            elif self.registry.get(info.prompt.name) is info.prompt and info.prompt.state == "filling":
                self._held[request.request_id] = (request, wave)
                return
            else:  # its fill failed, or it was replaced meanwhile: run it the ordinary way
                request, _ = vllm_method("preprocess_add_request")(self.core, info.original)
                info = None
        if info is None:
            return vllm_method("add_request")(self.core, request, wave)
        try:
            vllm_method("add_request")(self.core, request, wave)
        except BaseException:
            self._release(info)
            raise
        self._system_lens[request.request_id] = 0 if info.fill else self.pages.relay_len(info.prompt)
        if not info.fill:
            self.counters.relay_requests += 1
            self.admin.on_admitted(info.prompt)

    def admit_held(self, prompt: SystemPrompt) -> None:
        """Add the requests held for `prompt` (its fill finished): routed if it is ready, else the
        ordinary way. One that cannot be added gets an error output, like a request that fails
        in vLLM's input processing, instead of waiting forever."""
        for rid, (req, wave) in list(self._held.items()):
            if getattr(req, INFO_ATTR).prompt is not prompt:
                continue
            del self._held[rid]
            try:
                self.add(req, wave)
            except Exception:
                send_error = getattr(self.core, "_send_error_outputs_to_client", None)
                if send_error is None:  # in-process engine: the caller sees the exception
                    raise
                _logger().exception("vllm-relay: could not add request %s, held for system prompt %r",
                                    rid, prompt.name)
                send_error([rid], req.client_index)

    @staticmethod
    def client_requests(requests: list) -> list:
        """`requests` without fills: vLLM sends a finish output for each request finish_requests
        returns (pause, shutdown, errors), and a fill has no client to tell."""
        return [r for r in requests if not (info := getattr(r, INFO_ATTR, None)) or not info.fill]

    def finish_held(self, request_ids, status) -> list:
        """Relay's `finish_requests` (engine/scheduler.py) for held requests (not in the
        scheduler): those among `request_ids` (every one when None) leave with `status`. Returns
        their Requests, for the engine core to send their clients the same finish as the
        scheduler's (as pause(mode="abort") and shutdown do for the list finish_requests returns).
        `request_ids` must not be an iterator (the caller passes it on to vLLM's finish_requests)."""
        if request_ids is None:
            ids = list(self._held)
        else:
            ids = (request_ids,) if isinstance(request_ids, str) else request_ids
        finished = []
        for rid in ids:
            held = self._held.pop(rid, None)
            if held is not None:
                held[0].status = status
                finished.append(held[0])
        return finished

    # ---- scheduler callbacks -----------------------------------------------------------------

    def on_schedule(self, out) -> None:
        if out.total_num_scheduled_tokens:
            self._steps += 1
        if not self._system_lens:
            return
        lens, c = self._system_lens, self.counters
        for rid, n in out.num_scheduled_tokens.items():
            S = lens.get(rid)
            if S:
                c.relay_tokens += n
            elif S is not None:
                c.fill_tokens += n
        # New requests, and requests resumed after preemption, start from zero computed tokens:
        # each such start reuses the S system tokens instead of computing them.
        for r in out.scheduled_new_reqs:
            c.system_tokens_reused += lens.get(r.req_id, 0)
        for rid in out.scheduled_cached_reqs.resumed_req_ids:
            c.system_tokens_reused += lens.get(rid, 0)
        self.admin.on_schedule(out, lens, self.core.scheduler.requests)

    def on_free(self, request) -> None:
        """A request leaves the scheduler (finished, aborted or failed): release its prompt."""
        info: RelayInfo | None = getattr(request, INFO_ATTR, None)
        if info is None:
            return
        rid = request.request_id
        self._freed[rid] = self._system_lens.pop(rid, 0)
        if info.fill:
            self.fills.on_free(request, info.prompt)
        else:
            self._release(info)

    def on_outputs(self, outputs: dict) -> None:
        """Hide fill outputs, count the system prompt in prefill stats, finish fills, log."""
        for eco in outputs.values():
            self.fills.hide(eco)
            for o in eco.outputs:
                stats = o.prefill_stats  # on one output per request: look it up only then
                if stats is None:
                    continue
                S = self._system_lens.get(o.request_id) or self._freed.get(o.request_id)
                if S:
                    # The client sees the full prompt; its system part was never computed here.
                    stats.num_prompt_tokens += S
                    stats.num_cached_tokens += S
                    stats.num_local_cached_tokens += S
        self._freed.clear()
        self.fills.finish()
        self.pages.sweep(self.registry)  # prompts that left their slot give their blocks back

    def _release(self, info: RelayInfo) -> None:
        if info.acquired:
            info.acquired = False
            self.registry.release(info.prompt)

    def log_if_changed(self) -> None:
        line = self.summary()
        if line != self._last_line:
            _logger().info("vllm-relay: %s", line)
            self._last_line = line
