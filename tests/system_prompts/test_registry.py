"""SystemPromptRegistry: slots, states, refcounts, errors, versioning and a threading smoke test."""

import threading

import pytest

from vllm_relay.config import RelayConfig
from vllm_relay.system_prompts import SystemPromptRegistry


def ready(reg, name, ids):
    reg.register(name, ids)
    return reg.mark_ready(name)


@pytest.fixture
def reg():
    return SystemPromptRegistry(max_prompts=2, max_prompt_tokens=8)


def test_register_assigns_slots_in_order(reg):
    a = reg.register("a", [1, 2])
    b = reg.register("b", (3,))
    assert (a.slot, b.slot) == (0, 1)
    assert a.token_ids == (1, 2) and a.state == "filling" and a.refcount == 0 and a.num_tokens == 2
    assert reg.free_slots() == [] and len(reg) == 2 and "a" in reg and "z" not in reg
    assert [p.name for p in reg.prompts()] == ["a", "b"]


def test_from_config():
    reg = SystemPromptRegistry.from_config(RelayConfig(max_prompts=3, max_prompt_tokens=512))
    assert (reg.max_prompts, reg.max_prompt_tokens) == (3, 512)


def test_constructor_limits():
    with pytest.raises(ValueError, match=r"max_prompts=0 and max_prompt_tokens=8"):
        SystemPromptRegistry(0, 8)


def test_register_empty(reg):
    with pytest.raises(ValueError, match=r"empty token ids"):
        reg.register("a", [])


def test_register_too_long(reg):
    with pytest.raises(ValueError, match=r"9 tokens, more than max_prompt_tokens=8"):
        reg.register("a", list(range(9)))
    reg.register("a", list(range(8)))  # exactly at the limit is fine


def test_register_bad_name_and_ids(reg):
    with pytest.raises(ValueError, match=r"allowed characters"):
        reg.register("a/b", [1])
    with pytest.raises(ValueError, match=r"token id -1 is not a non-negative int"):
        reg.register("a", [1, -1])


def test_no_free_slot_names_the_limit_and_holders(reg):
    reg.register("a", [1])
    reg.register("b", [2])
    with pytest.raises(ValueError, match=r"no free slot, all max_prompts=2 are taken by \['a', 'b'\]"):
        reg.register("c", [3])


def test_freed_slot_is_reused(reg):
    ready(reg, "a", [1])
    ready(reg, "b", [2])
    reg.unregister("a")
    assert reg.free_slots() == [0]
    assert reg.register("c", [3]).slot == 0
    assert reg.get("a") is None


def test_reregister_identical_is_noop(reg):
    a = ready(reg, "a", [1, 2])
    reg.acquire("a")
    v = reg.version
    assert reg.register("a", (1, 2)) is a
    assert a.state == "ready" and a.refcount == 1 and reg.version == v


def test_reregister_different_tokens(reg):
    a = ready(reg, "a", [1, 2])
    reg.acquire("a")
    with pytest.raises(ValueError, match=r"cannot re-register .* 'a' is held by 1 request"):
        reg.register("a", [9])
    reg.release("a")
    a2 = reg.register("a", [9])
    assert a2 is not a and a2.slot == a.slot and a2.state == "filling" and a2.token_ids == (9,)
    with pytest.raises(ValueError, match=r"cannot re-register .* 'a' is filling"):
        reg.register("a", [7])


def test_acquire_only_when_ready(reg):
    reg.register("a", [1])
    with pytest.raises(ValueError, match=r"cannot acquire system prompt 'a': it is filling, not ready"):
        reg.acquire("a")
    reg.mark_ready("a")
    assert reg.acquire("a").refcount == 1
    assert reg.acquire("a").refcount == 2
    assert reg.release("a").refcount == 1
    assert reg.release("a").refcount == 0


def test_release_below_zero(reg):
    ready(reg, "a", [1])
    with pytest.raises(ValueError, match=r"refcount is 0, more releases than acquires"):
        reg.release("a")


def test_unknown_name(reg):
    reg.register("a", [1])
    for op in (reg.mark_ready, reg.acquire, reg.release, reg.unregister, reg.abort_fill):
        with pytest.raises(ValueError, match=r"no system prompt named 'x'; registered: \['a'\]"):
            op("x")


def test_unregister_refused_while_held_or_filling(reg):
    reg.register("a", [1])
    with pytest.raises(ValueError, match=r"cannot unregister it: .* 'a' is filling .* slot 0"):
        reg.unregister("a")
    reg.mark_ready("a")
    reg.acquire("a")
    reg.acquire("a")
    with pytest.raises(ValueError, match=r"cannot unregister it: .* 'a' is held by 2 request"):
        reg.unregister("a")
    reg.release("a")
    reg.release("a")
    reg.unregister("a")
    assert len(reg) == 0


def test_abort_fill(reg):
    ready(reg, "a", [1])
    reg.register("b", [2])
    with pytest.raises(ValueError, match=r"cannot abort filling system prompt 'a': it is ready"):
        reg.abort_fill("a")
    reg.abort_fill("b")
    assert reg.free_slots() == [1]


def test_mark_ready_idempotent(reg):
    reg.register("a", [1])
    v = reg.version
    reg.mark_ready("a")
    assert reg.version == v + 1
    reg.mark_ready("a")
    assert reg.version == v + 1


def test_ready_prompts_and_snapshot(reg):
    reg.register("a", [1])
    ready(reg, "b", [2])
    assert [p.name for p in reg.ready_prompts()] == ["b"]
    version, prompts = reg.ready_snapshot()
    assert version == reg.version and [p.name for p in prompts] == ["b"]


def test_version_counts_changes_not_refcounts(reg):
    versions = [reg.version]
    reg.register("a", [1])
    versions.append(reg.version)
    reg.mark_ready("a")
    versions.append(reg.version)
    reg.acquire("a")
    reg.release("a")
    versions.append(reg.version)  # unchanged: refcounts do not change what matches
    reg.register("a", [2])
    versions.append(reg.version)
    reg.abort_fill("a")
    versions.append(reg.version)
    reg.register("b", [1])
    reg.mark_ready("b")
    reg.unregister("b")
    versions.append(reg.version)
    assert versions == [0, 1, 2, 2, 3, 4, 7]


def test_try_acquire_checks_identity(reg):
    a = ready(reg, "a", [1])
    assert reg.try_acquire(a) and a.refcount == 1
    reg.release("a")
    reg.register("a", [2])  # a new record under the same name
    assert not reg.try_acquire(a)
    a2 = reg.mark_ready("a")
    assert not reg.try_acquire(a) and reg.try_acquire(a2)
    reg.release("a")
    reg.unregister("a")
    assert not reg.try_acquire(a2)


def test_threads_register_acquire_release():
    """Smoke: many threads churning the same registry leave it consistent."""
    n_threads, rounds, max_prompts = 8, 200, 3
    reg = SystemPromptRegistry(max_prompts=max_prompts, max_prompt_tokens=64)
    errors: list[BaseException] = []
    acquired: list[int] = []
    barrier = threading.Barrier(n_threads)

    def worker(t: int) -> None:
        try:
            barrier.wait()
            name = f"p{t % (max_prompts + 1)}"  # more names than slots: slots are contended
            ids = [t % (max_prompts + 1), 1, 2]
            for _ in range(rounds):
                try:
                    reg.register(name, ids)
                    reg.mark_ready(name)
                except ValueError:
                    continue  # no free slot right now: expected under contention
                try:
                    reg.acquire(name)
                except ValueError:
                    continue  # unregistered by another thread in between
                reg.release(name)
                acquired.append(1)
                try:
                    reg.unregister(name)
                except ValueError:
                    pass  # held by another thread, or already gone
        except BaseException as e:  # noqa: BLE001 - surfaced below
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(t,)) for t in range(n_threads)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert not errors
    assert acquired, "no thread ever registered and acquired a prompt: the test tested nothing"
    prompts = reg.prompts()
    assert all(p.refcount == 0 for p in prompts)
    slots = [p.slot for p in prompts]
    assert len(slots) == len(set(slots)) and all(0 <= s < max_prompts for s in slots)
    assert sorted(slots + reg.free_slots()) == list(range(max_prompts))


def test_generation_is_unique_per_registration(reg):
    a = reg.register("a", [1])
    assert reg.register("a", [1]) is a and a.generation == 1  # same tokens: same registration
    reg.mark_ready("a")
    b = reg.register("b", [2])
    a2 = reg.register("a", [3])
    assert (b.generation, a2.generation) == (2, 3)
    reg.mark_ready("a")
    reg.unregister("a")
    assert reg.register("a", [3]).generation == 4


def test_snapshot_by_state(reg):
    reg.register("a", [1])
    ready(reg, "b", [2])
    version, filling = reg.snapshot("filling")
    assert version == reg.version and [p.name for p in filling] == ["a"]
    assert [p.name for p in reg.snapshot("ready")[1]] == ["b"] == [p.name for p in reg.ready_prompts()]


# ---- drain: delete while requests still run ------------------------------------------------------


def test_drain_idle_prompt_frees_its_slot_at_once(reg):
    ready(reg, "a", [1, 2])
    v = reg.version
    drained = reg.drain("a")
    assert drained.state == "draining" and drained.refcount == 0
    assert reg.get("a") is None and reg.prompts() == [] and reg.free_slots() == [0, 1]
    assert reg.version > v


def test_drain_held_prompt_keeps_its_slot_until_the_last_release(reg):
    a = ready(reg, "a", [1, 2])
    reg.acquire("a")
    reg.acquire("a")
    drained = reg.drain("a")
    assert drained is a and a.state == "draining" and reg.get("a") is None
    assert not reg.try_acquire(a)  # no new request may use it
    assert reg.owns_slot(a)  # its KV pages stay: requests still read them
    assert [(p.name, p.state, p.slot) for p in reg.prompts()] == [("a", "draining", 0)]
    # The name is free at once; the new registration gets another slot: no shared KV.
    new = reg.register("a", [1, 2])
    assert new is not a and new.slot == 1 and new.generation > a.generation
    with pytest.raises(ValueError, match=r"all max_prompts=2 are taken by \['a \(draining\)', 'a'\]"):
        reg.register("b", [3])
    reg.release(a)
    assert a.refcount == 1 and reg.free_slots() == []
    v = reg.version
    reg.release(a)
    assert reg.free_slots() == [0] and reg.version > v and not reg.owns_slot(a)
    assert [(p.name, p.state, p.slot) for p in reg.prompts()] == [("a", "filling", 1)]


def test_release_by_name_releases_the_current_registration(reg):
    a = ready(reg, "a", [1])
    reg.acquire("a")
    reg.drain("a")
    b = ready(reg, "a", [1])
    reg.acquire("a")
    assert reg.release("a") is b and b.refcount == 0 and a.refcount == 1
    with pytest.raises(ValueError, match=r"refcount is 0, more releases than acquires"):
        reg.release(b)


def test_drain_refuses_filling_and_unknown(reg):
    reg.register("a", [1])
    with pytest.raises(ValueError, match=r"cannot drain system prompt 'a': it is filling .* abort its fill"):
        reg.drain("a")
    with pytest.raises(ValueError, match=r"no system prompt named 'z'"):
        reg.drain("z")
