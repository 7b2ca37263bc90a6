"""PrefixMatcher and route(): longest proper prefix, ready prompts only, cache per registry version."""

import random
import threading

import pytest

from vllm_relay.system_prompts import PrefixMatcher, Routed, SystemPrompt, SystemPromptRegistry, route
from vllm_relay.system_prompts import routing
from vllm_relay.system_prompts.routing import matcher_for

A = [101, 7, 7, 9, 42]
B = A + [5, 6, 8, 1000, 3, 3]  # A is a prefix of B
C = [500, 7, 7, 9]


def ready(reg, name, ids):
    reg.register(name, ids)
    return reg.mark_ready(name)


@pytest.fixture
def reg():
    r = SystemPromptRegistry(max_prompts=4, max_prompt_tokens=64)
    ready(r, "a", A)
    ready(r, "b", B)
    ready(r, "c", C)
    return r


def test_longest_prefix_with_nested_prompts(reg):
    assert route(B + [1], reg).prompt.name == "b"
    assert route(A + [5, 6], reg).prompt.name == "a"  # starts like B, diverges before B ends
    assert route(A + [5, 6, 8, 1000, 3, 4], reg).prompt.name == "a"  # differs in B's last token
    assert route(C + [0], reg).prompt.name == "c"


def test_routed_fields(reg):
    r = route(B + [11, 12, 13], reg)
    assert r == Routed(prompt=reg.get("b"), suffix_token_ids=[11, 12, 13], system_len=len(B))
    assert isinstance(r.suffix_token_ids, list)
    assert route(tuple(A + [4]), reg).suffix_token_ids == [4]


def test_exact_equal_does_not_match(reg):
    # The request must keep at least one token; B itself falls back to A (a proper prefix of it).
    assert route(C, reg) is None
    assert route(A, reg) is None
    assert route(B, reg).prompt.name == "a"


def test_not_at_start_does_not_match(reg):
    assert route([1] + A + [2], reg) is None
    assert route([7, 7, 9, 42] + C + [1], reg) is None


def test_no_match_cases(reg):
    assert route([], reg) is None
    assert route([101], reg) is None  # shorter than every prompt
    assert route(A[:-1] + [43, 1], reg) is None  # differs in the last system token


def test_only_ready_prompts_match(reg):
    reg.register("d", [9, 9, 9])
    assert route([9, 9, 9, 1], reg) is None
    reg.mark_ready("d")
    assert route([9, 9, 9, 1], reg).prompt.name == "d"


def test_short_prompts_shrink_the_key():
    reg = SystemPromptRegistry(max_prompts=3, max_prompt_tokens=64)
    ready(reg, "one", [4])
    ready(reg, "long", [4] + list(range(20)))
    m = matcher_for(reg)
    assert m.key_len == 1 and len(m) == 2
    assert route([4, 0, 1], reg).prompt.name == "one"
    assert route([4, *range(20), 99], reg).prompt.name == "long"
    assert route([4], reg) is None


def test_identical_tokens_tie_goes_to_lower_slot():
    reg = SystemPromptRegistry(max_prompts=3, max_prompt_tokens=64)
    ready(reg, "x", [1, 2])
    ready(reg, "y", [1, 2])
    assert route([1, 2, 3], reg).prompt.name == "x"


def test_empty_matcher():
    m = PrefixMatcher([])
    assert m.match([1, 2, 3]) is None and len(m) == 0
    assert route([1, 2], SystemPromptRegistry(2, 8)) is None


def test_matcher_matches_brute_force():
    """Random nested/overlapping prompts against a direct longest-proper-prefix search."""
    rnd = random.Random(0)
    vocab = [1, 2, 3]  # a tiny vocabulary makes shared prefixes and near misses common
    prompts = []
    for slot in range(12):
        ids = tuple(rnd.choice(vocab) for _ in range(rnd.randint(1, 12)))
        prompts.append(SystemPrompt(name=f"p{slot}", slot=slot, token_ids=ids, state="ready"))
    m = PrefixMatcher(prompts)
    for _ in range(2000):
        req = [rnd.choice(vocab) for _ in range(rnd.randint(0, 16))]
        fits = [p for p in prompts if p.num_tokens < len(req) and tuple(req[: p.num_tokens]) == p.token_ids]
        want = min(fits, key=lambda p: (-len(p.token_ids), p.slot)) if fits else None
        assert m.match(req) is want, req


def test_matcher_rebuilt_on_version_change(reg):
    m1 = matcher_for(reg)
    assert matcher_for(reg) is m1  # cached
    reg.acquire("a")
    reg.release("a")
    assert matcher_for(reg) is m1  # refcounts do not invalidate it
    reg.acquire("c")
    reg.release("c")
    reg.unregister("c")
    m2 = matcher_for(reg)
    assert m2 is not m1 and m2.version == reg.version
    assert route(C + [0], reg) is None
    ready(reg, "c2", C)
    assert route(C + [0], reg).prompt.name == "c2"


def test_matcher_built_once_per_version(reg, monkeypatch):
    builds = []
    real = PrefixMatcher.from_registry.__func__

    def counting(cls, registry):
        builds.append(registry.version)
        return real(cls, registry)

    monkeypatch.setattr(PrefixMatcher, "from_registry", classmethod(counting))
    for _ in range(50):
        route(A + [1], reg)
    ready(reg, "d", [8, 8])
    for _ in range(50):
        route(A + [1], reg)
    assert len(builds) == 2


def test_route_acquire(reg):
    r = route(B + [1], reg, acquire=True)
    assert r.prompt.refcount == 1 and reg.get("b").refcount == 1
    with pytest.raises(ValueError, match=r"held by 1 request"):
        reg.unregister("b")
    reg.release("b")
    assert route(B + [1], reg).prompt.refcount == 0  # acquire=False leaves counts alone


def test_route_acquire_retries_after_concurrent_change(reg, monkeypatch):
    """The registry changes between match and acquire: route must not return a stale split."""
    real_try = SystemPromptRegistry.try_acquire
    calls = []

    def racing_try_acquire(self, prompt):
        if not calls:  # first attempt: "another thread" replaces b with other tokens
            self.unregister("b")
            ready(self, "b", [77, 78])
        calls.append(prompt.name)
        return real_try(self, prompt)

    monkeypatch.setattr(SystemPromptRegistry, "try_acquire", racing_try_acquire)
    r = route(B + [1], reg, acquire=True)
    assert calls == ["b", "a"]
    assert r.prompt.name == "a" and r.system_len == len(A) and r.suffix_token_ids == B[len(A):] + [1]
    assert reg.get("a").refcount == 1 and reg.get("b").refcount == 0


def test_route_gives_up_after_max_attempts(reg, monkeypatch):
    monkeypatch.setattr(SystemPromptRegistry, "try_acquire", lambda self, prompt: False)
    assert route(B + [1], reg, acquire=True) is None


def test_matcher_cache_is_weak():
    reg = SystemPromptRegistry(2, 8)
    matcher_for(reg)
    n = len(routing._matchers)
    del reg
    assert len(routing._matchers) == n - 1


def test_threads_route_while_registry_changes():
    """Smoke: routing with acquire=True while prompts come and go never returns a wrong split."""
    reg = SystemPromptRegistry(max_prompts=2, max_prompt_tokens=64)
    ready(reg, "base", [1, 2, 3])
    stop = threading.Event()
    errors: list[BaseException] = []

    def churn() -> None:
        ids = [1, 2, 3, 4, 5]
        while not stop.is_set():
            try:
                ready(reg, "ext", ids)
                reg.unregister("ext")
            except ValueError:
                pass  # held by a router right now
            except BaseException as e:  # noqa: BLE001
                errors.append(e)

    routed = []

    def router() -> None:
        req = [1, 2, 3, 4, 5, 6, 7]
        try:
            for _ in range(2000):
                r = route(req, reg, acquire=True)
                if r is None:
                    continue  # gave up after repeated races: the unrouted path is still correct
                routed.append(1)
                assert list(r.prompt.token_ids) + r.suffix_token_ids == req
                assert r.system_len == len(r.prompt.token_ids)
                reg.release(r.prompt.name)
        except BaseException as e:  # noqa: BLE001
            errors.append(e)

    threads = [threading.Thread(target=churn)] + [threading.Thread(target=router) for _ in range(4)]
    for th in threads:
        th.start()
    for th in threads[1:]:
        th.join()
    stop.set()
    threads[0].join()
    assert not errors
    assert routed, "no request was ever routed: the race test tested nothing"
    assert all(p.refcount == 0 for p in reg.prompts())


def test_match_filling_longest_and_longer_than(reg):
    from vllm_relay.system_prompts import match_filling

    reg.register("d", B + [9])  # filling, longer than b
    assert match_filling(B + [9, 1], reg).name == "d"
    assert match_filling(B + [9, 1], reg, longer_than=len(B) + 1) is None
    assert match_filling(B + [9], reg) is None  # must leave one own token
    assert match_filling(A + [1], reg) is None  # ready prompts are not matched here
    assert route(B + [9, 1], reg).prompt.name == "b"  # ... and route ignores filling ones
    reg.mark_ready("d")
    assert match_filling(B + [9, 1], reg) is None and route(B + [9, 1], reg).prompt.name == "d"
