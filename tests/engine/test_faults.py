"""Faults around fills, on a real scheduler: the engine keeps serving, nothing is lost or left hanging.

A fill that fails (an exception while finishing it, an error status, an abort) marks its prompt
failed with the reason and sends the requests it held the ordinary way; aborts of every kind
(by id, pause(mode="abort"), shutdown) reach held requests, whose clients get the same abort
output as the scheduler's own requests (vLLM's own EngineCoreProc.pause_scheduler sends them).
"""

import queue

import pytest

from tests.engine.test_core import (  # noqa: F401
    OWN, RT, SYS, ecr, make_core, model_path, relay_of, run_until_idle, step, submit)
from vllm_relay.engine.fills import ABORTED
from vllm_relay.protocol import read_tag
from vllm_relay.system_prompts.fill import fill_request_id


@pytest.fixture
def core(model_path):  # noqa: F811
    return make_core(model_path, relay={"system_prompts": {"sys": SYS}})


def prompt_states(core):
    return {p["name"]: (p["state"], p["error"]) for p in core.relay_system_prompts()}


def assert_serves(core):
    """Relay and ordinary requests are still served to completion."""
    relay_req, plain = submit(core, ecr("after-r", SYS + OWN)), submit(core, ecr("after-p", OWN * 2))
    run_until_idle(core)
    assert read_tag(relay_req.sampling_params) is not None and relay_req.is_finished() and plain.is_finished()


def test_exception_finishing_a_fill_is_contained(core, monkeypatch):
    registry = relay_of(core).registry
    mark_ready = registry.mark_ready

    def broken(name):
        if name == "rt":
            raise RuntimeError("store write failed")
        return mark_ready(name)

    monkeypatch.setattr(registry, "mark_ready", broken)
    core.relay_register_system_prompt("rt", RT)
    for i in range(2):
        submit(core, ecr(f"held{i}", RT + OWN[: i + 1], max_tokens=3))
    assert core.relay_stats()["held_requests"] == 2
    outputs = run_until_idle(core)  # the fill finishes, finishing it raises: contained
    assert prompt_states(core)["rt"] == ("failed", "finishing its fill raised RuntimeError: store write failed")
    stats = core.relay_stats()
    assert stats["fills_failed"] == 1 and stats["held_requests"] == 0 and stats["relay_requests"] == 0
    # The held requests were served the ordinary way: their full prompts computed, all their tokens.
    seen = [o for out in outputs for eco in out.values() for o in eco.outputs]
    for i in range(2):
        mine = [o for o in seen if o.request_id == f"held{i}"]
        assert mine[0].prefill_stats.num_prompt_tokens == len(RT) + i + 1
        assert sum(len(o.new_token_ids) for o in mine) == 3 and mine[-1].finish_reason is not None
    assert {o.request_id for o in seen} == {"held0", "held1"}
    assert_serves(core)
    monkeypatch.setattr(registry, "mark_ready", mark_ready)
    assert core.relay_register_system_prompt("rt", RT)["state"] == "filling"  # a retry
    run_until_idle(core)
    assert prompt_states(core)["rt"] == ("ready", None)


def test_held_requests_of_a_failed_fill_run_unrouted_to_completion(core, monkeypatch):
    monkeypatch.setattr(relay_of(core).registry, "mark_ready", lambda name: (_ for _ in ()).throw(OSError("x")))
    core.relay_register_system_prompt("rt", RT)
    submit(core, ecr("held", RT + OWN, max_tokens=3))
    first, finished, seen = {}, set(), set()
    for _ in range(20):
        for eco in step(core).values():
            for o in eco.outputs:
                seen.add(o.request_id)
                first.setdefault(o.request_id, o)
                if o.finish_reason is not None:
                    finished.add(o.request_id)
        if "held" in finished:
            break
    stats = first["held"].prefill_stats
    assert stats.num_prompt_tokens == len(RT + OWN) and stats.num_cached_tokens == 0  # the full prompt, computed
    assert seen == {"held"}  # fill outputs stay hidden


def test_fill_ending_in_an_error_status_fails_its_prompt(core):
    from vllm.v1.request import RequestStatus

    core.relay_register_system_prompt("rt", RT)
    submit(core, ecr("held", RT + OWN))
    prompt = relay_of(core).registry.get("rt")
    # What a KV load failure does, for example.
    core.scheduler.finish_requests([fill_request_id(prompt)], RequestStatus.FINISHED_ERROR)
    step(core)
    assert prompt_states(core)["rt"] == ("failed", "its fill request ended with status FINISHED_ERROR")
    assert read_tag(core.scheduler.requests["held"].sampling_params) is None
    run_until_idle(core)
    assert_serves(core)


def test_pause_abort_reaches_held_requests_and_fills(core):
    from vllm.v1.engine.core import EngineCore

    running = submit(core, ecr("running", SYS + OWN, max_tokens=50))
    step(core)
    core.relay_register_system_prompt("rt", RT)  # its fill is waiting when the pause comes
    held = submit(core, ecr("held", RT + OWN))
    EngineCore.pause_scheduler(core, mode="abort", clear_cache=False)
    stats = core.relay_stats()
    assert stats["held_requests"] == 0 and not core.scheduler.requests
    assert held.is_finished() and running.is_finished()
    assert prompt_states(core) == {"sys": ("ready", None), "rt": ("failed", ABORTED)}
    assert core.relay_system_prompts()[0]["refcount"] == 0  # the aborted relay request released it
    core.resume_scheduler()
    run_until_idle(core)
    assert "held" not in core.scheduler.requests  # not run after the pause
    assert_serves(core)


def test_pause_abort_sends_held_requests_their_abort(model_path):  # noqa: F811
    """vLLM's EngineCoreProc.pause_scheduler sends an abort output for each request that
    finish_requests returns: held ones included, so their clients do not wait forever."""
    from vllm.v1.engine import FinishReason
    from vllm.v1.engine.core import EngineCoreProc

    core = make_core(model_path, relay={"system_prompts": {"sys": SYS}}, core_cls=EngineCoreProc,
                     output_queue=queue.Queue(), engines_running=False, batch_queue=None, _idle_state_callbacks=[])
    submit(core, ecr("running", SYS + OWN, max_tokens=50))
    step(core)
    core.relay_register_system_prompt("rt", RT)
    for rid in ("held1", "held2"):
        submit(core, ecr(rid, RT + OWN))
    core.pause_scheduler(mode="abort", clear_cache=False)
    sent = []
    while not core.output_queue.empty():
        _client, eco = core.output_queue.get_nowait()
        sent += [(o.request_id, o.finish_reason) for o in eco.outputs]
    assert sorted(sent) == [("held1", FinishReason.ABORT), ("held2", FinishReason.ABORT),
                            ("running", FinishReason.ABORT)]
    assert core.relay_stats()["held_requests"] == 0 and prompt_states(core)["rt"] == ("failed", ABORTED)


def test_abort_by_id_reaches_held_requests(core):
    core.relay_register_system_prompt("rt", RT)
    submit(core, ecr("held", RT + OWN))
    submit(core, ecr("kept", RT + OWN))
    core.abort_requests(["held", "not-a-request"])
    assert core.relay_stats()["held_requests"] == 1
    run_until_idle(core)
    assert prompt_states(core)["rt"] == ("ready", None) and "held" not in core.scheduler.requests


def test_a_held_request_that_cannot_be_added_gets_an_error_output(model_path, monkeypatch):  # noqa: F811
    from vllm.v1.engine import FinishReason
    from vllm.v1.engine.core import EngineCoreProc

    core = make_core(model_path, relay={"system_prompts": {"sys": SYS}}, core_cls=EngineCoreProc,
                     output_queue=queue.Queue(), engines_running=False, batch_queue=None, _idle_state_callbacks=[])
    core.relay_register_system_prompt("rt", RT)
    submit(core, ecr("bad", RT + OWN))
    submit(core, ecr("good", RT + OWN))
    add = core.scheduler.add_request

    def add_or_fail(request):
        if request.request_id == "bad":
            raise RuntimeError("no room")
        add(request)

    monkeypatch.setattr(core.scheduler, "add_request", add_or_fail)
    run_until_idle(core)
    sent = []
    while not core.output_queue.empty():
        _client, eco = core.output_queue.get_nowait()
        sent += [(o.request_id, o.finish_reason) for o in eco.outputs]
    assert sent == [("bad", FinishReason.ERROR)] and prompt_states(core)["rt"] == ("ready", None)
    assert core.relay_stats()["relay_requests"] == 1  # "good" was admitted, routed
