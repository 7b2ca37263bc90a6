"""Fills: computing a registered system prompt's KV into its slot of the store, and their outcomes.

A fill is an ordinary scheduler request (prompt = the system tokens, max_tokens=1, tagged
fill=True) that the workers capture; the scheduler may chunk or preempt it like any other. Its
outcome is recorded when the scheduler frees it (`on_free`) and applied between steps (`finish`):
the prompt becomes ready and the requests held for it are admitted, routed; or the prompt is
marked failed with the reason and they run the ordinary way (full prompt), exactly.

A failed fill never takes the engine down: it may be aborted (abort_requests, pause(mode="abort"),
shutdown), end in an error status, or raise while its outcome is applied; each marks the prompt
failed with the reason, and the engine keeps serving. (An exception in the model's forward pass
is another matter: vLLM treats it as fatal for the engine, whichever requests were in the step.)
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any, Callable

from vllm_relay.engine.requests import INFO_ATTR, RelayInfo
from vllm_relay.engine.vllm_calls import vllm_method
from vllm_relay.hooks._patch import swap
from vllm_relay.protocol import RelayTag, tag
from vllm_relay.system_prompts import SystemPrompt, SystemPromptRegistry
from vllm_relay.system_prompts.fill import fill_request_id, fill_salt
from vllm_relay.validate import PromptTools, resolve_prompt

if TYPE_CHECKING:
    from vllm_relay.config import RelayConfig
    from vllm_relay.engine.admin import RelayAdmin
    from vllm_relay.engine.pages import PromptPages
    from vllm_relay.engine.refills import Refills
    from vllm_relay.stats import RelayCounters

# Start-up fill: consecutive engine steps that run no model before the fill is declared stuck.
MAX_IDLE_STARTUP_STEPS = 1000

ABORTED = "its fill request was aborted (abort_requests, pause(mode='abort') or shutdown)"


def _logger():
    from vllm.logger import init_logger

    return init_logger("vllm.relay.engine")


def failure_reason(request) -> str | None:
    """Why a freed fill request did not compute its prompt; None if it did."""
    from vllm.v1.request import RequestStatus

    if request.status in (RequestStatus.FINISHED_LENGTH_CAPPED, RequestStatus.FINISHED_STOPPED):
        return None
    if request.status == RequestStatus.FINISHED_ABORTED:
        return ABORTED
    return f"its fill request ended with status {request.status.name}"


def internal_wave(core, startup: bool) -> int:
    """The data-parallel wave to add an engine-internal request with.

    Only `DPEngineCoreProc` (MoE models under data parallelism) keeps waves: its ranks step
    together while any has work, and the front end starts a wave when it sends a request to
    paused engines. A run-time fill comes from no client, so it is added as a request of the
    completed wave: vLLM's own `DPEngineCoreProc.add_request` then restarts paused engines
    (start_wave to the coordinator, so every rank steps with this one). Start-up fills run
    before the ranks' busy loops, the same on every rank, and keep the current wave.
    """
    wave = getattr(core, "current_wave", 0)
    return wave if startup else wave - 1


class Fills:
    """The RelayEngine's fills in flight and their outcomes (busy-loop thread only). A finished
    fill's outcome goes to the registry, or to `refills` for a refill; then `admit_held(prompt)`
    (RelayEngine.admit_held) adds the requests held for the prompt."""

    def __init__(self, core: Any, config: RelayConfig, registry: SystemPromptRegistry, pages: PromptPages,
                 secret: str, counters: RelayCounters, admin: RelayAdmin, refills: Refills,
                 admit_held: Callable[[SystemPrompt], None]) -> None:
        self.core, self.config, self.registry, self.pages, self.secret = core, config, registry, pages, secret
        self.counters, self.admin, self.refills, self.admit_held = counters, admin, refills, admit_held
        self.tools = PromptTools(core.vllm_config)
        self.in_flight: dict[str, SystemPrompt] = {}  # fill request id -> prompt
        self.hidden: set[str] = set()  # fill ids whose outputs must still be hidden from clients
        self._outcomes: list[tuple[str, SystemPrompt, str | None]] = []  # (id, prompt, failure reason)

    # ---- registration ------------------------------------------------------------------------

    def startup(self) -> None:
        """Register every configured prompt and step the engine until all are filled."""
        if not self.config.system_prompts:
            return
        for name, spec in self.config.system_prompts.items():
            self.register(name, spec, startup=True)
        idle = 0
        while self.in_flight:
            _outputs, executed = self.core.step_fn()  # fill outputs are for nobody
            self.core.post_step(executed)
            idle = 0 if executed else idle + 1
            if idle > MAX_IDLE_STARTUP_STEPS:
                raise RuntimeError(
                    f"vllm-relay: system prompt fills made no progress: {list(self.in_flight)}")
        failed = [f for f in self.admin.failed() if f["name"] in self.config.system_prompts]
        if failed:
            raise RuntimeError("vllm-relay: system prompts failed to fill: "
                               + "; ".join(f"{f['name']!r}: {f['error']}" for f in failed))

    def register(self, name: str, spec: Any, startup: bool = False) -> SystemPrompt:
        """Resolve `spec` to tokens, register it as `name` and start its fill unless the same
        tokens are ready or filling already. Raises ValueError, registering nothing, if it is bad."""
        ids = resolve_prompt(name, spec, self.config, self.core.vllm_config, self.tools,
                             self.pages.block_size)
        prompt = self.registry.register(name, ids)
        self.pages.sweep(self.registry)  # a replaced registration gives its blocks back
        self.admin.on_registered(prompt, spec)
        if prompt.state == "filling" and fill_request_id(prompt) not in self.in_flight:
            try:
                self._start(prompt, startup)
            except BaseException:
                self.registry.abort_fill(name)
                raise
        return prompt

    def refill(self, prompt: SystemPrompt) -> None:
        """Fill `prompt`, ready or draining, again (engine/refills.py): its outcome goes to the
        refills, not to the registry."""
        self._start(prompt, startup=False)

    def _start(self, prompt: SystemPrompt, startup: bool) -> None:
        """Add the request that computes `prompt`'s whole blocks at positions 0..S-1 (S its relay
        length: the workers capture their KV; relay requests compute the rest of the prompt). Then
        the last blocks a sliding window reads back from the first token past them were in the window
        of every chunk of the fill (the scheduler lets a window layer's earlier blocks go as it runs).

        It never reads the prefix cache (every token must be computed to be captured) and its
        salt keeps anything else from reading its blocks. It enters through the engine core's own
        `add_request`, as a client's request would (data parallelism's bookkeeping included).
        """
        from vllm.sampling_params import SamplingParams
        from vllm.v1.engine import EngineCoreRequest

        core, rid = self.core, fill_request_id(prompt)
        params = SamplingParams(
            max_tokens=1, temperature=0.0, skip_reading_prefix_cache=True,
            extra_args=tag(None, RelayTag(prompt.slot, prompt.num_tokens, fill=True)),
        )
        request = EngineCoreRequest(
            request_id=rid, prompt_token_ids=list(prompt.token_ids[: self.pages.fill_len(prompt)]),
            mm_features=None,
            sampling_params=params, pooling_params=None, arrival_time=time.time(),
            lora_request=None, cache_salt=fill_salt(prompt, self.secret), data_parallel_rank=None,
        )
        req, _ = vllm_method("preprocess_add_request")(core, request)
        swap(req, INFO_ATTR, RelayInfo(prompt, fill=True))
        self.in_flight[rid] = prompt
        self.hidden.add(rid)
        try:
            core.add_request(req, internal_wave(core, startup))
        except BaseException:
            del self.in_flight[rid]
            self.hidden.discard(rid)
            raise

    # ---- outcomes ----------------------------------------------------------------------------

    def on_free(self, request, prompt: SystemPrompt) -> None:
        """The scheduler frees fill `request` (finished, aborted or failed): record the outcome.

        A fill that computed its prompt leaves its whole blocks to the prompt (its pages), kept
        here before the scheduler frees the request's blocks.
        """
        reason = failure_reason(request)
        if reason is None:
            try:
                self.pages.keep(prompt, request.request_id)
            except Exception as e:  # noqa: BLE001 - contained: the prompt fails, the engine serves on
                _logger().exception("vllm-relay: keeping the blocks of system prompt %r raised", prompt.name)
                reason = f"keeping its blocks raised {type(e).__name__}: {e}"
        self._outcomes.append((request.request_id, prompt, reason))

    def finish(self) -> None:
        """Apply recorded outcomes: prompts become ready or failed, and held requests are admitted."""
        outcomes, self._outcomes = self._outcomes, []
        scrub_later = getattr(self.core.scheduler, "finished_req_ids_dict", None) is not None
        for rid, prompt, reason in outcomes:
            self.in_flight.pop(rid, None)
            if not scrub_later:  # no finished-id set will carry it: nothing left to hide
                self.hidden.discard(rid)
            if self.refills.refilling(prompt):
                self.refills.finished(prompt, reason, aborted=reason == ABORTED)
                continue
            if reason is None:
                try:
                    self.registry.mark_ready(prompt.name)
                    self.counters.fills_completed += 1
                except Exception as e:  # noqa: BLE001 - contained: the prompt fails, the engine serves on
                    _logger().exception("vllm-relay: finishing the fill of system prompt %r raised",
                                        prompt.name)
                    reason = f"finishing its fill raised {type(e).__name__}: {e}"
            if reason is not None and self.admin.fill_cancelled(rid):  # deleted while it filled
                if self.registry.get(prompt.name) is prompt and prompt.state == "filling":
                    self.registry.abort_fill(prompt.name)
            elif reason is not None:
                self.fail(prompt, reason)
            self.admit_held(prompt)
        if outcomes:
            self.pages.sweep(self.registry)  # a failed prompt gives back any blocks it kept

    def fail(self, prompt: SystemPrompt, reason: str) -> None:
        """Drop `prompt` (if it is still this filling registration), count it, and have it listed
        as failed, with `reason`, until its name is registered again or deleted."""
        if self.registry.get(prompt.name) is not prompt or prompt.state != "filling":
            return
        self.registry.abort_fill(prompt.name)
        self.counters.fills_failed += 1
        self.admin.on_fill_failed(prompt, reason)
        _logger().warning("vllm-relay: the fill of system prompt %r failed: %s; requests that begin with it "
                          "take the ordinary path", prompt.name, reason)

    def hide(self, eco) -> None:
        """Drop fill outputs (and their ids in finished sets) from one client's EngineCoreOutputs."""
        if not self.hidden:
            return
        if eco.outputs:
            eco.outputs = [o for o in eco.outputs if o.request_id not in self.hidden]
        if eco.finished_requests and (done := eco.finished_requests & self.hidden):
            eco.finished_requests -= done
            self.hidden -= done
