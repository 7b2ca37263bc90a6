"""`RelayEngine`: the engine core's system prompts, the requests routed to them, and counters.

The patches in hooks/engine.py only forward to it; it never imports them. A request's path:

1. `preprocess` (the engine core's input thread): route by longest registered prefix. A ready
   prompt is acquired and the request rewritten to its own tokens, a relay tag and a relay salt;
   a longer prompt that is still filling marks it held instead. Others pass unchanged.
2. `add` (busy loop): held requests wait in `_held` until their fill finishes; if it fails they
   run the ordinary way (full prompt). Others go to the scheduler.
3. `on_schedule` / `on_outputs` / `on_free` (the scheduler, busy loop): count, hide fill outputs
   from clients, release the prompt once the request is freed, finish fills.

A fill is an ordinary scheduler request (prompt = the system tokens, max_tokens=1, tagged
fill=True) that the workers capture; the scheduler may chunk or preempt it like any other.
"""

from __future__ import annotations

import copy
import threading
import time
import weakref
from dataclasses import asdict
from typing import Any

from vllm_relay.config import RelayConfig, check_prompt_spec
from vllm_relay.engine.admin import RelayAdmin
from vllm_relay.hooks._patch import original
from vllm_relay.engine.pages import PromptPages
from vllm_relay.engine.requests import (
    ENGINE_ATTR,
    INFO_ATTR,
    RelayInfo,
    relay_eligible,
    strip_forged_tag,
    with_sampling,
)
from vllm_relay.protocol import RelayTag, tag
from vllm_relay.stats import RelayCounters, summary_line
from vllm_relay.system_prompts import SystemPrompt, SystemPromptRegistry, match_filling, route
from vllm_relay.system_prompts.fill import fill_request_id, fill_salt, prompt_token_ids, relay_salt

# Start-up fill: consecutive engine steps that run no model before the fill is declared stuck.
MAX_IDLE_STARTUP_STEPS = 1000


def _logger():
    from vllm.logger import init_logger

    return init_logger("vllm.relay.engine")


def _vllm(name: str):
    """vLLM's own (unpatched) EngineCore method `name`."""
    from vllm.v1.engine.core import EngineCore

    return original(EngineCore, name)


def describe(p: SystemPrompt) -> dict:
    return {"name": p.name, "slot": p.slot, "state": p.state, "tokens": p.num_tokens,
            "refcount": p.refcount, "generation": p.generation}


def _log_loop(ref: weakref.ref, interval_s: float) -> None:
    """Every `interval_s`, log the summary if it changed; ends with the engine. Its own thread,
    so an idle engine still logs its last change. Reads counters without a lock: a log line
    may mix two steps' values, nothing else."""
    while True:
        time.sleep(interval_s)
        relay = ref()
        if relay is None:
            return
        relay.log_if_changed()
        del relay


class RelayEngine:
    """Threads: `preprocess` runs on the engine core's input thread, everything else on its busy
    loop (which also serves utility calls); they share only the registry, which locks."""

    def __init__(self, core, config: RelayConfig) -> None:
        self.core = core
        self.config = config
        self.registry = SystemPromptRegistry.from_config(config)
        self.counters = RelayCounters()
        self.max_model_len: int = core.vllm_config.model_config.max_model_len
        self._held: dict[str, tuple[Any, int]] = {}  # request id -> (Request, wave)
        self._fills: dict[str, SystemPrompt] = {}  # fill request id -> prompt, while in flight
        self._fill_ids: set[str] = set()  # fill ids whose outputs must still be hidden
        self._fill_outcomes: list[tuple[str, SystemPrompt, bool]] = []
        self.pages = PromptPages(core.scheduler, core.vllm_config.cache_config.block_size)
        self._system_lens: dict[str, int] = {}  # tagged request in the scheduler -> tokens stripped (0: fill)
        self._freed: dict[str, int] = {}  # the same, for requests freed since the last outputs
        self._tokenizer: Any = None
        self._last_line = ""
        self.admin = RelayAdmin(self)  # per-prompt usage and the serving surface's utility calls

    # ---- start-up ----------------------------------------------------------------------------

    @classmethod
    def attach(cls, core) -> RelayEngine:
        """Attach to `core` and its scheduler, expose the utility calls, fill configured prompts."""
        relay = cls(core, RelayConfig.from_vllm(core.vllm_config.additional_config))
        setattr(core, ENGINE_ATTR, relay)
        setattr(core.scheduler, ENGINE_ATTR, relay)
        # Utility calls (`call_utility("relay_stats")`) look methods up on the EngineCore object.
        core.relay_register_system_prompt = relay.register_system_prompt
        core.relay_unregister_system_prompt = relay.unregister_system_prompt
        core.relay_system_prompts = relay.system_prompts
        core.relay_stats = relay.stats
        relay.admin.expose(core)
        relay.fill_startup_prompts()
        if relay.config.log_stats_interval_s:
            threading.Thread(target=_log_loop, args=(weakref.ref(relay), relay.config.log_stats_interval_s),
                             name="vllm-relay-stats", daemon=True).start()
        return relay

    def fill_startup_prompts(self) -> None:
        """Register every configured prompt and step the engine until all are filled."""
        if not self.config.system_prompts:
            return
        for name, spec in self.config.system_prompts.items():
            self._register(name, spec)
        idle = 0
        while self._fills:
            _outputs, executed = self.core.step_fn()  # fill outputs are for nobody
            self.core.post_step(executed)
            idle = 0 if executed else idle + 1
            if idle > MAX_IDLE_STARTUP_STEPS:
                raise RuntimeError(f"vllm-relay: system prompt fills made no progress: {list(self._fills)}")
        ready = {p.name for p in self.registry.ready_prompts()}
        failed = [n for n in self.config.system_prompts if n not in ready]
        if failed:
            raise RuntimeError(f"vllm-relay: system prompts failed to fill: {failed}")
        self._last_line = self.summary()
        _logger().info("vllm-relay: system prompts ready: %s", self._last_line)

    # ---- utility calls -----------------------------------------------------------------------

    def register_system_prompt(self, name: str, prompt: Any) -> dict:
        """Register `prompt` (text, token ids or {"chat_system": text}) as `name` and start its
        fill through the scheduler. Returns its state: "filling", or "ready" when the same
        tokens are already registered and filled."""
        spec = check_prompt_spec(f"system prompt {name!r}", prompt, self.config.max_prompt_tokens)
        return describe(self._register(name, spec))

    def unregister_system_prompt(self, name: str) -> None:
        self.registry.unregister(name)
        self.pages.sweep(self.registry)

    def system_prompts(self) -> list[dict]:
        return [describe(p) for p in self.registry.prompts()]

    def stats(self) -> dict:
        return {**asdict(self.counters), "held_requests": len(self._held), "prompts": self.system_prompts()}

    def summary(self) -> str:
        return summary_line(self.counters, self.system_prompts(), len(self._held))

    # ---- requests in -------------------------------------------------------------------------

    def preprocess(self, request) -> tuple[Any, int]:
        """`EngineCore.preprocess_add_request` for an EngineCoreRequest, routed (step 1 above)."""
        preprocess = _vllm("preprocess_add_request")
        request, expected = self.admin.take_chat_expectation(strip_forged_tag(request))
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
            req, wave = preprocess(self.core, self._rewrite(request, prompt))
        except BaseException:
            if filling is None:
                self.registry.release(prompt)
            raise
        held = filling is not None
        setattr(req, INFO_ATTR, RelayInfo(prompt, held=held, original=request if held else None,
                                          acquired=not held))
        return req, wave

    def _rewrite(self, request, prompt: SystemPrompt):
        """The request as the scheduler sees it: its own tokens, a relay tag, a relay salt.

        max_tokens is capped where the full prompt would reach max_model_len: the scheduler
        sees only the suffix, so it cannot apply that cap itself.
        """
        S, full_len = self.pages.relay_len(prompt), len(request.prompt_token_ids)
        sp = copy.copy(request.sampling_params)
        sp.extra_args = tag(sp.extra_args, RelayTag(prompt.slot, S))
        if sp.max_tokens is not None:
            sp.max_tokens = max(1, min(sp.max_tokens, self.max_model_len - full_len))
        return with_sampling(
            request, sp,
            prompt_token_ids=request.prompt_token_ids[S:],
            cache_salt=relay_salt(prompt, request.cache_salt),
        )

    def add(self, request, wave: int) -> None:
        """`EngineCore.add_request`: to the scheduler, or held while its prompt fills."""
        self.finish_fills()
        info: RelayInfo | None = getattr(request, INFO_ATTR, None)
        if info is not None and info.held:
            if self.registry.try_acquire(info.prompt):
                info.held, info.original, info.acquired = False, None, True
            elif self.registry.get(info.prompt.name) is info.prompt and info.prompt.state == "filling":
                self._held[request.request_id] = (request, wave)
                return
            else:  # its fill failed, or it was replaced meanwhile: run it the ordinary way
                request, _ = _vllm("preprocess_add_request")(self.core, info.original)
                info = None
        if info is None:
            return _vllm("add_request")(self.core, request, wave)
        try:
            _vllm("add_request")(self.core, request, wave)
        except BaseException:
            self._release(info)
            raise
        self._system_lens[request.request_id] = 0 if info.fill else self.pages.relay_len(info.prompt)
        if not info.fill:
            self.counters.relay_requests += 1
            self.admin.on_admitted(info.prompt)

    def abort(self, request_ids) -> None:
        """Held requests are not in the scheduler: aborting one only forgets it."""
        for rid in (request_ids,) if isinstance(request_ids, str) else request_ids:
            self._held.pop(rid, None)

    # ---- fills -------------------------------------------------------------------------------

    def _register(self, name: str, spec: Any) -> SystemPrompt:
        tools = self._text_tools() if not isinstance(spec, list) else (None, None)
        ids = prompt_token_ids(f"system prompt {name!r}", spec, self.config.max_prompt_tokens, *tools)
        vocab = self.core.vllm_config.model_config.get_vocab_size()
        if max(ids) >= vocab:
            raise ValueError(f"system prompt {name!r}: token id {max(ids)} is out of the model's "
                             f"vocabulary (size {vocab})")
        self._check_schedulable(name, len(ids))
        prompt = self.registry.register(name, ids)
        self.pages.sweep(self.registry)  # a replaced registration gives its blocks back
        self.admin.on_registered(prompt, spec)
        if prompt.state == "filling" and fill_request_id(prompt) not in self._fills:
            try:
                self._start_fill(prompt)
            except BaseException:
                self.registry.abort_fill(name)
                raise
        return prompt

    def _check_schedulable(self, name: str, num_tokens: int) -> None:
        sched = self.core.vllm_config.scheduler_config
        if num_tokens < self.pages.block_size:
            raise ValueError(
                f"system prompt {name!r}: {num_tokens} tokens, fewer than one KV cache block "
                f"({self.pages.block_size} tokens): relay shares whole blocks, so it would share nothing"
            )
        if num_tokens >= self.max_model_len:
            raise ValueError(
                f"system prompt {name!r}: {num_tokens} tokens leave no room for a request's own "
                f"tokens within max_model_len={self.max_model_len}"
            )
        if not sched.enable_chunked_prefill and num_tokens > sched.max_num_batched_tokens:
            raise ValueError(
                f"system prompt {name!r}: {num_tokens} tokens, more than max_num_batched_tokens="
                f"{sched.max_num_batched_tokens} with chunked prefill off: it could never be filled"
            )

    def _start_fill(self, prompt: SystemPrompt) -> None:
        """Add the request that computes `prompt` at positions 0..S-1 (the workers capture its KV).

        It never reads the prefix cache (every token must be computed to be captured) and its
        salt keeps anything else from reading its blocks.
        """
        from vllm.sampling_params import SamplingParams
        from vllm.v1.engine import EngineCoreRequest

        rid = fill_request_id(prompt)
        params = SamplingParams(
            max_tokens=1, temperature=0.0, skip_reading_prefix_cache=True,
            extra_args=tag(None, RelayTag(prompt.slot, prompt.num_tokens, fill=True)),
        )
        request = EngineCoreRequest(
            request_id=rid, prompt_token_ids=list(prompt.token_ids), mm_features=None,
            sampling_params=params, pooling_params=None, arrival_time=time.time(),
            lora_request=None, cache_salt=fill_salt(prompt), data_parallel_rank=None,
        )
        req, wave = _vllm("preprocess_add_request")(self.core, request)
        setattr(req, INFO_ATTR, RelayInfo(prompt, fill=True))
        self._fills[rid] = prompt
        self._fill_ids.add(rid)
        try:
            self.add(req, wave)
        except BaseException:
            del self._fills[rid]
            self._fill_ids.discard(rid)
            raise

    def finish_fills(self) -> None:
        """Mark finished fills ready (or drop failed ones) and admit the requests they held."""
        outcomes, self._fill_outcomes = self._fill_outcomes, []
        scrub_later = getattr(self.core.scheduler, "finished_req_ids_dict", None) is not None
        for rid, prompt, ok in outcomes:
            self._fills.pop(rid, None)
            if not scrub_later:  # no finished-id set will carry it: nothing left to hide
                self._fill_ids.discard(rid)
            if ok:
                self.registry.mark_ready(prompt.name)
                self.counters.fills_completed += 1
            elif self.admin.fill_cancelled(rid):  # its prompt was deleted while filling
                self.registry.abort_fill(prompt.name)
            else:
                self.registry.abort_fill(prompt.name)
                self.counters.fills_failed += 1
                self.admin.on_fill_failed(prompt)
                _logger().warning("vllm-relay: the fill of system prompt %r failed; dropped it", prompt.name)
            for rid_held, (req, wave) in list(self._held.items()):
                if getattr(req, INFO_ATTR).prompt is prompt:
                    del self._held[rid_held]
                    self.add(req, wave)

    # ---- scheduler callbacks -----------------------------------------------------------------

    def on_schedule(self, out) -> None:
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
        self.admin.on_schedule(out, lens)

    def on_free(self, request) -> None:
        """A request leaves the scheduler (finished, aborted or failed): release its prompt."""
        info: RelayInfo | None = getattr(request, INFO_ATTR, None)
        if info is None:
            return
        rid = request.request_id
        self._freed[rid] = self._system_lens.pop(rid, 0)
        if info.fill:
            from vllm.v1.request import RequestStatus

            ok = request.status in (RequestStatus.FINISHED_LENGTH_CAPPED, RequestStatus.FINISHED_STOPPED)
            if ok:  # its blocks now hold the prompt's KV: keep them as the prompt's pages
                self.pages.keep(info.prompt, rid)
            self._fill_outcomes.append((rid, info.prompt, ok))
        else:
            self._release(info)

    def on_outputs(self, outputs: dict) -> None:
        """Hide fill outputs, count the system prompt in prefill stats, finish fills, log."""
        for eco in outputs.values():
            if self._fill_ids:
                if eco.outputs:
                    eco.outputs = [o for o in eco.outputs if o.request_id not in self._fill_ids]
                if eco.finished_requests and (done := eco.finished_requests & self._fill_ids):
                    eco.finished_requests -= done
                    self._fill_ids -= done
            for o in eco.outputs:
                stats = o.prefill_stats
                S = self._system_lens.get(o.request_id) or self._freed.get(o.request_id)
                if stats is not None and S:
                    # The client sees the full prompt; its system part was never computed here.
                    stats.num_prompt_tokens += S
                    stats.num_cached_tokens += S
                    stats.num_local_cached_tokens += S
        self._freed.clear()
        self.finish_fills()
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

    # ---- tokenizer ---------------------------------------------------------------------------

    def _text_tools(self):
        """(encode, render_chat) from the model's own tokenizer and chat template; (None, None)
        when the engine has no tokenizer (skip_tokenizer_init)."""
        if self._tokenizer is None:
            from vllm.tokenizers.registry import cached_tokenizer_from_config

            self._tokenizer = cached_tokenizer_from_config(self.core.vllm_config.model_config) or False
        tok = self._tokenizer
        if tok is False:
            return None, None

        def encode(text: str, add_special_tokens: bool) -> list[int]:
            return list(tok.encode(text, add_special_tokens=add_special_tokens))

        def render_chat(messages: list[dict[str, str]]) -> str:
            from vllm.renderers.hf import safe_apply_chat_template

            return safe_apply_chat_template(
                self.core.vllm_config.model_config, tok, messages, tokenize=False, add_generation_prompt=True
            )

        return encode, render_chat
