"""Refills: every system prompt's KV computed again through the weights the engine has now.

A prompt's pages hold KV computed through the weights its fill ran with. Whenever those may
have changed, relay gives the pages back and fills every prompt that holds a slot again:

- `reset_prefix_cache()`, the call RL and online-training loops make after each weight update
  (and vLLM's own pause(clear_cache=True) and sleep make). It works with relay on: the pages are
  given back first, so vLLM's reset finds the pool free where it would without relay;
- a weight update relay can see: `collective_rpc` of the workers' `reload_weights`,
  `update_weights` or `finish_weight_update` (LLM.update_weights, AsyncLLM.update_weights, RL
  frameworks). vLLM leaves its prefix cache stale there; relay resets it, running requests
  included (recomputed, as `reset_prefix_cache(reset_running_requests=True)` does), because a
  request must never read KV of other weights. Other ways to change weights (a function passed
  to collective_rpc, a write to a parameter) cannot be seen: call `reset_prefix_cache()` after
  them, as vLLM's own prefix cache needs anyway.
- sleep (levels 1 and 2) resets the prefix cache before the KV cache is discarded: the refills
  queue then, and run once the engine is awake and scheduling again.

A refill's fill request is added at the next `schedule` of an unpaused scheduler (never while
vLLM pauses or sleeps: a paused engine must be able to go idle). Until a prompt's refill is done,
the requests routed to it stay out of the scheduler's view (it gets queues without them for each
`schedule`); other requests run. A refill that
fails is retried; after MAX_FAILURES in a row (an abort is not a failure: sleep aborts them) the
prompt is dropped and its requests end with an error, never served from stale or missing KV.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable

from vllm_relay.engine.requests import INFO_ATTR
from vllm_relay.system_prompts import SystemPrompt, SystemPromptRegistry

if TYPE_CHECKING:
    from vllm_relay.engine.admin import RelayAdmin
    from vllm_relay.engine.pages import PromptPages
    from vllm_relay.stats import RelayCounters

# Worker methods (collective_rpc by name) that load new weights into the running model.
WEIGHT_UPDATES = frozenset({"reload_weights", "update_weights", "finish_weight_update"})
MAX_FAILURES = 3


def _logger():
    from vllm.logger import init_logger

    return init_logger("vllm.relay.engine")


class Refills:
    """The RelayEngine's stale prompts and their refills (busy-loop thread only). The fills
    themselves are started by the `refill` callable `schedule` is given (Fills.refill)."""

    def __init__(self, core: Any, registry: SystemPromptRegistry, pages: PromptPages,
                 counters: RelayCounters, admin: RelayAdmin) -> None:
        self.core, self.registry, self.pages = core, registry, pages
        self.counters, self.admin = counters, admin
        self.stale: dict[SystemPrompt, int] = {}  # prompt -> refills of it failed in a row
        self._pending: list[SystemPrompt] = []  # stale prompts whose fill request is still to add

    # ---- triggers ----------------------------------------------------------------------------

    def reset_prefix_cache(self, reset, reset_running_requests: bool, reset_connector: bool) -> bool:
        """`EngineCore.reset_prefix_cache` (vLLM's own is `reset`): give the pages back, reset,
        refill. If requests other than the prompts hold blocks and may not be preempted, vLLM's
        reset fails: it is left to fail as it would without relay, and nothing changes."""
        pool = self.core.scheduler.kv_cache_manager.block_pool
        used = pool.num_gpu_blocks - pool.get_num_free_blocks() - 1  # 1: the null block, always in use
        others = used - self.pages.num_blocks()
        if others > 0 and not reset_running_requests:
            return reset(reset_running_requests, reset_connector)
        self.pages.release_all()
        try:
            return reset(reset_running_requests, reset_connector)
        finally:
            self.start([p for p in self.registry.prompts() if p.state != "filling"])

    def weights_updated(self, method: str) -> None:
        """After `collective_rpc(method)`, one of WEIGHT_UPDATES: reset and refill."""
        _logger().info("vllm-relay: the workers ran %s: resetting the prefix cache (running requests are "
                       "recomputed) and filling the system prompts again through the new weights", method)
        self.core.reset_prefix_cache(reset_running_requests=True)

    def start(self, prompts: list[SystemPrompt]) -> None:
        """Refill `prompts` (their pages given back already); a refill in flight goes on."""
        for prompt in prompts:
            if prompt in self.stale:  # pending, queued, or preempted by the reset: it recomputes from zero
                continue
            self.stale[prompt] = 0
            self._pending.append(prompt)
        if prompts:
            _logger().info("vllm-relay: refilling system prompts %s", [p.name for p in prompts])

    # ---- the scheduler -----------------------------------------------------------------------

    def schedule(self, schedule, refill: Callable[[SystemPrompt], None]):
        """Relay's `schedule` (engine/scheduler.py) while prompts refill: pending refills are
        started (`refill`, of the unpaused scheduler only); the refilling prompts' requests are
        taken out of the waiting queues for the call and put back after, in their order, at the
        front."""
        from vllm.v1.core.sched.interface import PauseState

        sched = self.core.scheduler
        self._abort_orphans()
        if self._pending and sched.pause_state == PauseState.UNPAUSED:
            pending, self._pending = self._pending, []
            for prompt in pending:
                if self.registry.owns_slot(prompt):
                    refill(prompt)
                else:
                    del self.stale[prompt]
        queues = [(q, [r for r in q if self._waits(r)]) for q in (sched.waiting, sched.kv_holding_waiting)]
        for q, out in queues:
            if out:
                q.remove_requests(out)
        try:
            return schedule()
        finally:
            for q, out in queues:
                if out:
                    q.prepend_requests(list(reversed(out)))

    def _abort_orphans(self) -> None:
        """Abort the refill of a prompt deleted meanwhile, before it runs again: its slot may be
        given to a new registration, whose pages it must not overwrite."""
        from vllm.v1.request import RequestStatus

        from vllm_relay.system_prompts.fill import fill_request_id

        sched = self.core.scheduler
        orphans = [fill_request_id(p) for p in self.stale if not self.registry.owns_slot(p)]
        if orphans := [rid for rid in orphans if rid in sched.requests]:
            sched.finish_requests(orphans, RequestStatus.FINISHED_ABORTED)

    def refilling(self, prompt: SystemPrompt) -> bool:
        return prompt in self.stale

    def _waits(self, request) -> bool:
        info = getattr(request, INFO_ATTR, None)
        return info is not None and not info.fill and info.prompt in self.stale

    # ---- outcomes ----------------------------------------------------------------------------

    def finished(self, prompt: SystemPrompt, reason: str | None, aborted: bool) -> None:
        """The refill of `prompt` ended (Fills.finish): done, retried, or the prompt dropped."""
        if reason is None:
            del self.stale[prompt]
            self.counters.refills += 1
            return
        if not self.registry.owns_slot(prompt):  # nobody left to serve: its requests all ended
            del self.stale[prompt]
            return
        failures = self.stale[prompt] + (0 if aborted else 1)
        if failures < MAX_FAILURES:
            self.stale[prompt] = failures
            self._pending.append(prompt)
            return
        del self.stale[prompt]
        self._drop(prompt, reason)

    def _drop(self, prompt: SystemPrompt, reason: str) -> None:
        """Give up on `prompt`: no new request routes to it; those routed to it end with an error."""
        from vllm.v1.request import RequestStatus

        sched = self.core.scheduler
        _logger().error("vllm-relay: system prompt %r could not be filled again (%s, %d times); it is "
                        "dropped and its requests end with an error", prompt.name, reason, MAX_FAILURES)
        if self.registry.get(prompt.name) is prompt:
            self.registry.drain(prompt.name)
            self.admin.on_fill_failed(prompt, f"refill failed: {reason}")
        ids = [rid for rid, r in sched.requests.items()
               if (info := getattr(r, INFO_ATTR, None)) is not None and info.prompt is prompt]
        finished = sched.finish_requests(ids, RequestStatus.FINISHED_ERROR)
        send_error = getattr(self.core, "_send_error_outputs_to_client", None)
        for r in finished:
            if send_error is not None:
                send_error([r.request_id], r.client_index)
        self.pages.sweep(self.registry)
