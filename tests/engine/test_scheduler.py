"""Relay's scheduler class (engine/scheduler.py): named through vLLM's `scheduler_cls` for relay
engines only; a user's own class refused; no relay engine runs without it."""

import pickle
from types import SimpleNamespace

import pytest

from tests.engine.test_core import SYS, make_core, model_path  # noqa: F401  (fixture)
from vllm_relay.engine import scheduler as relay_scheduler
from vllm_relay.engine.scheduler import RelayAsyncScheduler, RelayScheduler, check, select


def config(scheduler_cls=None, async_scheduling=False):
    from vllm.config import SchedulerConfig

    sched = SchedulerConfig(max_model_len=512, is_encoder_decoder=False, scheduler_cls=scheduler_cls,
                            async_scheduling=async_scheduling)
    return SimpleNamespace(scheduler_config=sched)


class MyScheduler:
    pass


@pytest.mark.parametrize("async_scheduling, cls", [(False, RelayScheduler), (True, RelayAsyncScheduler)])
def test_select_names_relay_class_matching_async_scheduling(async_scheduling, cls):
    from vllm.v1.core.sched.async_scheduler import AsyncScheduler
    from vllm.v1.core.sched.scheduler import Scheduler

    cfg = config(async_scheduling=async_scheduling)
    select(cfg)
    select(cfg)  # idempotent: the front end, then the engine core
    chosen = cfg.scheduler_config.scheduler_cls
    assert isinstance(chosen, str)  # pickles into a spawned engine core by name
    assert pickle.loads(pickle.dumps(cfg.scheduler_config)).get_scheduler_cls() is cls
    assert issubclass(cls, AsyncScheduler if async_scheduling else Scheduler)


@pytest.mark.parametrize("named, cls", [
    ("vllm.v1.core.sched.scheduler.Scheduler", RelayScheduler),
    ("vllm.v1.core.sched.async_scheduler.AsyncScheduler", RelayAsyncScheduler),
    (RelayScheduler, RelayScheduler),
    ("vllm_relay.engine.scheduler.RelayAsyncScheduler", RelayAsyncScheduler),
])
def test_select_keeps_vllm_or_relay_classes_a_user_named(named, cls):
    cfg = config(scheduler_cls=named)
    select(cfg)
    assert cfg.scheduler_config.get_scheduler_cls() is cls


@pytest.mark.parametrize("named, shown", [("my_pkg.sched.MyScheduler", "my_pkg.sched.MyScheduler"),
                                          (MyScheduler, f"{__name__}.MyScheduler")])
def test_select_refuses_a_users_own_scheduler(named, shown):
    cfg = config(scheduler_cls=named)
    with pytest.raises(ValueError, match=f"scheduler_cls='{shown}': the relay attention backend runs its "
                                         "own scheduler .* and cannot run with another"):
        select(cfg)
    assert cfg.scheduler_config.scheduler_cls is named  # unchanged


def test_relay_core_runs_relay_scheduler_and_other_cores_vllms(model_path):  # noqa: F811
    from vllm.v1.core.sched.scheduler import Scheduler

    assert type(make_core(model_path, relay={"system_prompts": {"sys": SYS}}).scheduler) is RelayScheduler
    assert type(make_core(model_path, backend=None).scheduler) is Scheduler  # inert without relay


def test_attach_refuses_a_relay_engine_without_relay_scheduler(model_path, monkeypatch):  # noqa: F811
    monkeypatch.setattr(relay_scheduler, "select", lambda vllm_config: None)  # as if nothing named it
    with pytest.raises(ValueError, match="the relay attention backend needs its scheduler, but the engine "
                                         "core runs vllm.v1.core.sched.scheduler.Scheduler"):
        make_core(model_path)
    check(object.__new__(RelayScheduler))  # relay's passes


@pytest.mark.parametrize("length", [3 * 16 + 9, 4 * 16])  # a partly filled last block; whole blocks
def test_samples_of_one_prompt_wait_one_step_then_are_admitted_together(model_path, length):  # noqa: F811
    """Six requests of one prompt arriving together: the first computes it, the others wait that step
    (`CacheHitMemo.waits_for_sibling`) and are all admitted in the next one, each computing its last
    token only (a whole-prompt hit). A sibling that took such a hit makes no later one wait."""
    from tests.engine.test_core import ecr, step, submit

    core = make_core(model_path, relay={"system_prompts": {}}, batched_tokens=512)
    prompt = [300 + (7 * i) % 997 for i in range(length)]
    for i in range(6):
        submit(core, ecr(f"s{i}", prompt, max_tokens=3))
    scheduled = []
    for _ in range(2):
        step(core, scheduled)
    assert scheduled[0] == {"s0": length}
    assert scheduled[1] == {"s0": 1, **{f"s{i}": 1 for i in range(1, 6)}}
    assert core.scheduler.kv_cache_manager.coordinator.find_longest_cache_hit.__self__.whole_prompt_hits == 5
