"""Data parallelism's wave bookkeeping with relay, on vLLM's own DPEngineCoreProc methods.

Under data parallelism vLLM runs dense models as independent engine cores (no waves; each
has its own RelayEngine), and MoE models on `DPEngineCoreProc`, whose ranks step together while
any has work: a request sent to paused engines makes the front end (or, for a request of an
already-completed wave, the engine itself) start a wave on every rank. A run-time fill comes from
no client, so relay adds it as a request of the completed wave, and vLLM's own
`DPEngineCoreProc.add_request` restarts the paused engines; without that, the rank filling would
step alone and wait forever for its peers in the model's collectives. Held requests take part
because they arrive through the same `add_request`, and while any is held its fill is unfinished
work in the scheduler (which the ranks' all-reduce counts).

No processes here: a DPEngineCoreProc object with a real scheduler and the attributes its
`add_request` reads; the wave messages it would send are read from its output queue.
"""

import queue

import pytest

from tests.engine.test_core import OWN, RT, SYS, ecr, make_core, model_path, run_until_idle_or  # noqa: F401


def dp_core(model_path, **state):  # noqa: F811
    from vllm.v1.engine.core import DPEngineCoreProc

    attrs = {"has_coordinator": True, "current_wave": 3, "engines_running": False, "output_queue": queue.Queue(),
             **state}
    return make_core(model_path, relay={"system_prompts": {"sys": SYS}}, core_cls=DPEngineCoreProc, **attrs)


def wave_messages(core):
    sent = []
    while not core.output_queue.empty():
        client, eco = core.output_queue.get_nowait()
        sent.append((client, eco.start_wave))
    return sent


def submit_dp(core, request, wave):
    req, _ = core.preprocess_add_request(request)
    core.add_request(req, wave)  # DPEngineCoreProc.add_request: vLLM's wave logic, then ours
    return req


def test_startup_fills_send_no_wave_message(model_path):  # noqa: F811
    core = dp_core(model_path)
    assert core.relay_system_prompts()[0]["state"] == "ready"
    assert wave_messages(core) == [] and core.engines_running is False and core.current_wave == 3


def test_runtime_fill_restarts_paused_engines(model_path):  # noqa: F811
    core = dp_core(model_path)
    core.relay_register_system_prompt("rt", RT)
    assert wave_messages(core) == [(-1, 3)] and core.engines_running is True  # start_wave to the coordinator
    assert core.scheduler.has_unfinished_requests()


def test_runtime_fill_while_engines_run_sends_nothing(model_path):  # noqa: F811
    core = dp_core(model_path, engines_running=True)
    core.relay_register_system_prompt("rt", RT)
    assert wave_messages(core) == [] and core.current_wave == 3


def test_runtime_fill_while_paused_does_not_wake_the_engines(model_path):  # noqa: F811
    from vllm.v1.core.sched.interface import PauseState

    core = dp_core(model_path)
    core.scheduler.set_pause_state(PauseState.PAUSED_NEW)
    core.relay_register_system_prompt("rt", RT)
    assert wave_messages(core) == [] and core.engines_running is False  # vLLM's rule for paused schedulers


def test_held_requests_count_as_unfinished_work_and_follow_waves(model_path):  # noqa: F811
    core = dp_core(model_path, engines_running=True)
    core.relay_register_system_prompt("rt", RT)
    submit_dp(core, ecr("held", RT + OWN), wave=5)  # a client request of a newer wave
    assert core.current_wave == 5 and core.relay_stats()["held_requests"] == 1
    assert core.scheduler.has_unfinished_requests()  # its fill: what the ranks' all-reduce sees
    run_until_idle_or(core, lambda: "held" in core.scheduler.requests)
    assert core.relay_stats()["relay_requests"] == 1 and core.scheduler.has_unfinished_requests()
