"""Refills (engine/refills.py) on a real vLLM Scheduler with a fake model (tests/engine/test_core.py).

A prefix-cache reset gives the prompt's pages back and succeeds where vLLM's would; the prompt is
filled again at the next step of an unpaused scheduler while its requests wait (others run); a
weight update the workers ran does the same with running requests recomputed; a refill that
fails is retried, then the prompt dropped and its requests ended with an error; a prompt deleted
while it refills has its refill aborted.
"""

import pytest

from tests.engine.test_core import OWN, SHARED, SYS, ecr, make_core, relay_of, run_until_idle, step, submit
from vllm_relay.engine.refills import MAX_FAILURES
from vllm_relay.system_prompts.fill import fill_request_id


@pytest.fixture
def core(model_path, request):
    batched = getattr(request, "param", 64)
    return make_core(model_path, relay={"system_prompts": {"sys": SYS}}, batched_tokens=batched)


@pytest.fixture(scope="module")
def model_path():
    from vllm_relay.testing.models import get_model

    return str(get_model("tiny-llama-gqa"))


def used_blocks(core) -> int:
    pool = core.scheduler.kv_cache_manager.block_pool
    return pool.num_gpu_blocks - pool.get_num_free_blocks() - 1


def scheduled(core) -> list[list[str]]:
    """Request ids each step scheduled, until the scheduler drains."""
    steps = []
    sched = core.scheduler
    original = sched.schedule

    def spy(*a, **k):
        out = original(*a, **k)
        steps.append(sorted(out.num_scheduled_tokens))
        return out

    sched.schedule = spy
    try:
        run_until_idle(core)
    finally:
        del sched.schedule
    return steps


def first(steps, rid) -> int:
    return next(i for i, s in enumerate(steps) if rid in s)


def last(steps, rid) -> int:
    return max(i for i, s in enumerate(steps) if rid in s)


def test_idle_reset_gives_the_pages_back_and_refills_while_the_prompts_requests_wait(core):
    relay, prompt = relay_of(core), relay_of(core).registry.get("sys")
    fill = fill_request_id(prompt)
    assert used_blocks(core) == relay.pages.num_blocks() == SHARED // 16
    assert core.reset_prefix_cache() is True  # vLLM's reset alone fails: the pages are in use
    assert used_blocks(core) == 0 and relay.refills.refilling(prompt)
    submit(core, ecr("relay", SYS + OWN, max_tokens=2))
    submit(core, ecr("plain", [1, 2, 3], max_tokens=2))
    steps = scheduled(core)
    assert steps[0] == sorted([fill, "plain"])  # the refill and other requests; not the prompt's own
    assert first(steps, "relay") > last(steps, fill)  # it ran only once the refill was done
    assert not relay.refills.refilling(prompt) and relay.counters.refills == 1
    assert relay.pages.num_blocks() == used_blocks(core) == SHARED // 16  # the new pages, kept
    assert core.relay_stats()["relay_requests"] == 1


def test_reset_fails_as_without_relay_while_requests_hold_blocks(core):
    relay = relay_of(core)
    submit(core, ecr("r", SYS + OWN, max_tokens=20))
    step(core)
    kept = relay.pages.num_blocks()
    assert core.reset_prefix_cache() is False
    assert relay.pages.num_blocks() == kept and not relay.refills.stale  # nothing changed
    run_until_idle(core)


def test_reset_with_running_requests_recomputes_them_after_the_refill(core):
    relay = relay_of(core)
    req = submit(core, ecr("r", SYS + OWN, max_tokens=6))
    step(core)
    step(core)
    assert core.reset_prefix_cache(reset_running_requests=True) is True
    assert req.num_computed_tokens == 0 and relay.refills.stale
    steps = scheduled(core)
    assert steps[0] == [fill_request_id(relay.registry.get("sys"))] and first(steps, "r") > 0
    assert req.is_finished() and len(req.output_token_ids) == 6 and relay.counters.refills == 1


def test_weight_update_rpc_resets_and_refills(core):
    relay = relay_of(core)
    req = submit(core, ecr("r", SYS + OWN, max_tokens=6))
    step(core)
    core.collective_rpc("reload_weights", kwargs={"weights_path": "elsewhere"})
    assert core.model_executor.rpcs[-1] == "reload_weights"
    assert req.num_computed_tokens == 0 and relay.refills.stale  # preempted: recomputed after the refill
    run_until_idle(core)
    assert req.is_finished() and relay.counters.refills == 1
    core.collective_rpc("get_model_inspection")  # not a weight update: nothing happens
    assert not relay.refills.stale and relay.pages.num_blocks() == SHARED // 16


def test_refills_wait_while_the_scheduler_is_paused(core):
    from vllm.v1.core.sched.interface import PauseState

    relay, sched = relay_of(core), core.scheduler
    sched.set_pause_state(PauseState.PAUSED_NEW)
    assert core.reset_prefix_cache() is True
    step(core)
    assert not sched.requests  # no fill while paused: a pause must be able to go idle
    sched.set_pause_state(PauseState.UNPAUSED)
    submit(core, ecr("r", SYS + OWN, max_tokens=2))
    run_until_idle(core)
    assert relay.counters.refills == 1 and relay.pages.num_blocks() == SHARED // 16


@pytest.mark.parametrize("core", [16], indirect=True)  # the 40-token fill takes three steps
def test_failing_refill_is_retried_then_the_prompt_dropped_and_its_requests_errored(core):
    from vllm.v1.request import RequestStatus

    relay, sched = relay_of(core), core.scheduler
    prompt = relay.registry.get("sys")
    core.reset_prefix_cache()
    req = submit(core, ecr("r", SYS + OWN, max_tokens=2))
    for attempt in range(MAX_FAILURES):
        step(core)  # adds the refill (again) and runs a chunk of it; "r" waits
        assert fill_request_id(prompt) in sched.requests and "r" in sched.requests
        if attempt == 0:  # an abort (sleep, pause) is not a failure: retried, not counted
            sched.finish_requests([fill_request_id(prompt)], RequestStatus.FINISHED_ABORTED)
            relay.fills.finish()
            step(core)
        sched.finish_requests([fill_request_id(prompt)], RequestStatus.FINISHED_ERROR)
        relay.fills.finish()
    assert req.status == RequestStatus.FINISHED_ERROR and "r" not in sched.requests
    assert relay.registry.get("sys") is None and not relay.refills.stale
    failed = [p for p in core.relay_system_prompts() if p["name"] == "sys"]
    assert failed[0]["state"] == "failed" and "refill failed" in failed[0]["error"], failed
    assert relay.pages.num_blocks() == 0 and used_blocks(core) == 0


@pytest.mark.parametrize("core", [16], indirect=True)
def test_deleting_a_refilling_prompt_aborts_its_refill(core):
    relay, sched = relay_of(core), core.scheduler
    prompt = relay.registry.get("sys")
    core.reset_prefix_cache()
    submit(core, ecr("plain", [1, 2, 3], max_tokens=8))
    step(core)
    assert fill_request_id(prompt) in sched.requests
    core.relay_unregister_system_prompt("sys")
    step(core)
    assert fill_request_id(prompt) not in sched.requests and not relay.refills.stale
    run_until_idle(core)
    assert relay.pages.num_blocks() == 0 and used_blocks(core) == 0 and relay.counters.refills == 0
    stats = core.relay_stats()
    assert stats["pinned_blocks"] == 0 and stats["free_blocks"] == sched.kv_cache_manager.block_pool.num_gpu_blocks - 1
