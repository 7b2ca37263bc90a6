"""Relay's scheduler: vLLM's `Scheduler` (and `AsyncScheduler`) with five methods that also call
the RelayEngine attached to it.

vLLM builds the class that `SchedulerConfig.get_scheduler_cls()` names (its `scheduler_cls`, else
`AsyncScheduler` with async scheduling and `Scheduler` without). `select(vllm_config)` names
relay's class there for an engine that selects relay: the front end calls it when
`EngineArgs.create_engine_config` builds the config (hooks/frontend.py), and the engine core again
before vLLM builds its scheduler (the `EngineCore.__init__` hook), for configs built without
`EngineArgs`. `RelayEngine.attach` refuses a scheduler that is not relay's. Engines that do not
select relay keep vLLM's class: nothing here runs for them.

- `schedule` / `update_from_output` / `_free_request`: count, hide fill outputs, finish fills,
  release prompts when their requests end (finished, aborted or failed); while prompts refill,
  their requests are kept out of `schedule`.
- `_handle_blocked_waiting_request` (vLLM's test of whether a waiting request is scheduled in this
  step): also no while a sibling computes its prompt in this step (`CacheHitMemo.waits_for_sibling`:
  in the next it computes its last token only). Not with a KV or aux-output connector (their lookups).
- `finish_requests`: aborts (by id, or of everything: pause(mode="abort"), shutdown) reach held
  requests too, and return them so their clients get the same finish; fills, which have no client,
  are left out of what it returns.

A `scheduler_cls` naming vLLM's own `Scheduler` or `AsyncScheduler` gets relay's subclass of it.
A user's own class is refused with relay, not composed: the class vLLM builds is named
by a string resolved in the spawned engine core (a class made by combining ours with the user's at
run time has no importable name), and these bodies rely on the internals of vLLM's `Scheduler`
(`_free_request` as the one exit of a request, the waiting queues `schedule` reads), which a
user's subclass may change.
"""

from __future__ import annotations

import functools

from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.core.sched.scheduler import Scheduler

from vllm_relay.engine.requests import ENGINE_ATTR


class RelaySchedulerMixin:
    """The five methods; each runs vLLM's alone until a RelayEngine is attached (at start-up)."""

    def schedule(self, *args, **kwargs):
        relay = getattr(self, ENGINE_ATTR, None)
        schedule = functools.partial(super().schedule, *args, **kwargs)
        if relay is None:
            return schedule()
        out = relay.refills.schedule(schedule, relay.fills.refill) if relay.refills.stale else schedule()
        relay.on_schedule(out)
        return out

    def update_from_output(self, scheduler_output, model_runner_output):
        outputs = super().update_from_output(scheduler_output, model_runner_output)
        relay = getattr(self, ENGINE_ATTR, None)
        if relay is not None:
            relay.on_outputs(outputs)
        return outputs

    def _handle_blocked_waiting_request(self, request) -> bool:
        if not super()._handle_blocked_waiting_request(request):
            return False
        relay = getattr(self, ENGINE_ATTR, None)
        memo = relay.cache_hits if relay is not None else None
        if memo is None or self.connector is not None or self.aux_output_connector is not None:
            return True  # (a connector's lookups are not the memo's)
        return not memo.waits_for_sibling(request)

    def finish_requests(self, request_ids, finished_status):
        relay = getattr(self, ENGINE_ATTR, None)
        if relay is None:
            return super().finish_requests(request_ids, finished_status)
        if request_ids is not None and not isinstance(request_ids, str):
            request_ids = list(request_ids)  # read twice: by the RelayEngine, then by vLLM
        held = relay.finish_held(request_ids, finished_status)
        finished = super().finish_requests(request_ids, finished_status)
        if request_ids is None:  # everything ends: fills too, and no request is left to admit
            relay.fills.finish()
        return relay.client_requests(finished) + held

    def _free_request(self, request, *args, **kwargs):
        relay = getattr(self, ENGINE_ATTR, None)
        if relay is not None:
            relay.on_free(request)
        return super()._free_request(request, *args, **kwargs)


class RelayScheduler(RelaySchedulerMixin, Scheduler):
    """vLLM's `Scheduler` for relay engines (async scheduling off)."""


class RelayAsyncScheduler(RelaySchedulerMixin, AsyncScheduler):
    """vLLM's `AsyncScheduler` for relay engines (async scheduling on)."""


SCHEDULERS = {False: f"{__name__}.RelayScheduler", True: f"{__name__}.RelayAsyncScheduler"}
_OURS = {RelayScheduler, RelayAsyncScheduler, *SCHEDULERS.values()}
# vLLM's own two classes, named by a user: relay's subclass of the same one runs instead
_VLLMS = {Scheduler: SCHEDULERS[False], AsyncScheduler: SCHEDULERS[True],
          "vllm.v1.core.sched.scheduler.Scheduler": SCHEDULERS[False],
          "vllm.v1.core.sched.async_scheduler.AsyncScheduler": SCHEDULERS[True]}


def select(vllm_config) -> None:
    """Name relay's scheduler class in the config of an engine that selects relay.

    Idempotent (relay's class, once named, stays); the class matches the config's async
    scheduling (vLLM has settled it by the time a VllmConfig exists). vLLM's own `Scheduler` or
    `AsyncScheduler`, named by the user, becomes relay's subclass of that class; any other
    `scheduler_cls` raises ValueError naming it. The name is a string, so the config pickles into
    a spawned engine core, which imports it there."""
    config = vllm_config.scheduler_config
    chosen = config.scheduler_cls
    wanted = SCHEDULERS[bool(config.async_scheduling)]
    if chosen is None:
        config.scheduler_cls = wanted
    elif chosen in _VLLMS:
        config.scheduler_cls = _VLLMS[chosen]
    if config.scheduler_cls in _OURS:
        return
    name = chosen if isinstance(chosen, str) else f"{chosen.__module__}.{chosen.__qualname__}"
    raise ValueError(
        f"scheduler_cls={name!r}: the relay attention backend runs its own scheduler ({wanted}, a "
        f"subclass of vLLM's) and cannot run with another; leave --scheduler-cls unset")


def check(scheduler) -> None:
    """Raise unless `scheduler` is relay's (`RelayEngine.attach`: no relay engine without it)."""
    if not isinstance(scheduler, RelaySchedulerMixin):
        cls = type(scheduler)
        raise ValueError(
            f"the relay attention backend needs its scheduler, but the engine core runs "
            f"{cls.__module__}.{cls.__qualname__}: build the VllmConfig with EngineArgs, or call "
            f"vllm_relay.engine.scheduler.select(vllm_config) before the scheduler is built")
