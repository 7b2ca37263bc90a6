"""RelayAdmin: the utility calls behind the relay endpoints, on a real scheduler without a model.

Uses test_core's hand-built EngineCore: error statuses, delete by draining (in-flight requests keep
the slot, new ones take the ordinary path, the name is free at once for a registration in another
slot), delete while filling, failed fills in the listing, per-prompt counters, chat mismatches.
"""

import pytest

from tests.engine.test_core import (
    OWN,
    RT,
    SHARED,
    SYS,
    ecr,
    make_core,
    relay_of,
    run_until_idle,
    run_until_idle_or,
    step,
    submit,
)
from vllm_relay.engine.admin import CHAT_EXPECT_KEY
from vllm_relay.engine.requests import INFO_ATTR
from vllm_relay.protocol import read_tag
from vllm_relay.system_prompts.fill import fill_request_id
from vllm_relay.testing.models import get_model


@pytest.fixture(scope="module")
def model_path():
    return str(get_model("tiny-llama-gqa"))


@pytest.fixture
def core(model_path):
    return make_core(model_path, relay={"system_prompts": {"sys": SYS}})


def by_name(core):
    return {p["name"]: p for p in core.relay_prompt_list()}


def add_ready(core, name, ids, source="token_ids", text=None):
    out = core.relay_prompt_add(name, ids, source, text)
    assert out["prompt"]["state"] == "filling", out
    run_until_idle_or(core, lambda: relay_of(core).registry.get(name).state == "ready")
    return by_name(core)[name]


def test_listing_fields_and_startup_source(core):
    (entry,) = core.relay_prompt_list()
    assert entry == {
        "name": "sys",
        "state": "ready",
        "tokens": 40,
        "shared_tokens": SHARED,  # its whole blocks of 16
        "slot": 0,
        "live_requests": 0,
        "requests_served": 0,
        "tokens_reused": 0,
        "chat_mismatches": 0,
        "created_at": entry["created_at"],
        "source": "config",
        "generation": 1,
    }
    assert isinstance(entry["created_at"], int) and entry["created_at"] > 1_700_000_000


def test_add_errors_carry_status_and_limit(core, model_path):
    assert core.relay_prompt_add("sys", RT, "token_ids")["error"] == {
        "status": 409,
        "message": "system prompt 'sys' already exists (ready, slot 0); delete it first",
    }
    cases = [
        ("a/b", RT, 400, "allowed characters are"),
        ("e", [], 422, "empty token ids"),
        ("big", list(range(65)), 413, "65 tokens, more than max_prompt_tokens=64"),
        ("vocab", [1, 10**6], 422, "out of the model's vocabulary"),
    ]
    for name, ids, status, message in cases:
        err = core.relay_prompt_add(name, ids, "token_ids")["error"]
        assert err["status"] == status and message in err["message"], err
    assert core.relay_prompt_add("rt", RT, "token_ids")["prompt"]["slot"] == 1
    err = core.relay_prompt_add("third", [1, 2], "token_ids")["error"]
    assert err["status"] == 507 and "all max_prompts=2 are taken by ['sys', 'rt']" in err["message"]
    roomy = make_core(model_path, relay={"max_prompt_tokens": 1024})
    err = roomy.relay_prompt_add("long", [1] * 512, "token_ids")["error"]
    assert err["status"] == 413 and "within max_model_len=512" in err["message"]
    assert [p["name"] for p in core.relay_prompt_list()] == ["sys", "rt"]  # nothing else changed


def test_delete_drains_then_frees_and_the_name_is_reused_in_another_slot(core):
    pages, old = relay_of(core).pages, relay_of(core).registry.get("sys")
    old_blocks = pages._kept[old]
    a = submit(core, ecr("a", SYS + OWN, max_tokens=50))
    step(core)
    out = core.relay_prompt_delete("sys")["prompt"]
    assert out["state"] == "draining" and out["live_requests"] == 1 and out["slot"] == 0
    step(core)
    assert pages._kept[old] is old_blocks  # "a" still reads its pages
    late = submit(core, ecr("late", SYS + OWN, max_tokens=2))
    assert read_tag(late.sampling_params) is None and late.prompt_token_ids == SYS + OWN  # ordinary
    # The same name again, same tokens: a new registration in another slot, its own salt.
    new = add_ready(core, "sys", SYS)
    assert new["slot"] == 1 and new["generation"] > 1
    listing = core.relay_prompt_list()
    assert [(p["name"], p["state"], p["slot"]) for p in listing] == [
        ("sys", "draining", 0),
        ("sys", "ready", 1),
    ]
    b = submit(core, ecr("b", SYS + OWN, max_tokens=2))
    assert read_tag(b.sampling_params).slot == 1 and read_tag(a.sampling_params).slot == 0
    assert a.cache_salt != b.cache_salt
    core.abort_requests(["a"])
    run_until_idle(core)
    assert [(p["name"], p["slot"]) for p in core.relay_prompt_list()] == [("sys", 1)]
    assert relay_of(core).registry.free_slots() == [0]
    assert old not in pages._kept and all(b.ref_cnt == 0 for b in old_blocks)  # given back
    assert by_name(core)["sys"]["requests_served"] == 1


def test_delete_idle_is_removed_and_unknown_is_404(core):
    assert core.relay_prompt_delete("sys")["prompt"]["state"] == "removed"
    assert core.relay_prompt_list() == [] and relay_of(core).registry.free_slots() == [0, 1]
    assert not relay_of(core).pages._kept  # its pages went back to the pool at once
    assert core.relay_prompt_delete("sys")["error"] == {
        "status": 404,
        "message": "no system prompt named 'sys'",
    }


def test_delete_while_filling_cancels_the_fill_and_releases_held_requests(core):
    core.relay_prompt_add("rt", RT, "token_ids")
    submit(core, ecr("held", RT + OWN))
    assert core.relay_stats()["held_requests"] == 1 and "held" not in core.scheduler.requests
    assert core.relay_prompt_delete("rt")["prompt"]["state"] == "removed"
    req = core.scheduler.requests["held"]  # admitted now, the ordinary way
    assert req.prompt_token_ids == RT + OWN and read_tag(req.sampling_params) is None
    stats = core.relay_serving_stats()
    assert stats["fills_cancelled"] == 1 and stats["fills_failed"] == 0 and stats["held_requests"] == 0
    assert [p["name"] for p in stats["prompts"]] == ["sys"]


def test_failed_fill_is_listed_until_deleted_or_registered_again(core):
    core.relay_prompt_add("rt", RT, "token_ids")
    core.abort_requests([fill_request_id(relay_of(core).registry.get("rt"))])  # the fill fails
    failed = by_name(core)["rt"]
    assert failed["state"] == "failed" and failed["slot"] is None and core.relay_stats()["fills_failed"] == 1
    assert core.relay_prompt_delete("rt")["prompt"]["state"] == "removed"
    assert "rt" not in by_name(core)
    core.relay_prompt_add("rt", RT, "token_ids")
    core.abort_requests([fill_request_id(relay_of(core).registry.get("rt"))])
    assert by_name(core)["rt"]["state"] == "failed"
    assert add_ready(core, "rt", RT)["state"] == "ready"


def test_per_prompt_counters(core):
    add_ready(core, "rt", RT)
    for i in range(3):
        submit(core, ecr(f"s{i}", SYS + OWN, max_tokens=1))
    submit(core, ecr("r", RT + OWN, max_tokens=1))
    run_until_idle(core)
    p = by_name(core)
    assert (p["sys"]["requests_served"], p["sys"]["tokens_reused"]) == (3, 3 * SHARED)
    assert (p["rt"]["requests_served"], p["rt"]["tokens_reused"]) == (1, 16)  # RT's one whole block
    stats = core.relay_serving_stats()
    assert stats["relay_requests"] == 4 and stats["system_tokens_reused"] == 3 * SHARED + 16


def test_texts_and_sources(core):
    add_ready(core, "chat", RT, "messages", "You are terse.")
    assert core.relay_prompt_texts() == {"chat": {"generation": 2, "text": "You are terse.", "chat": True}}
    assert by_name(core)["chat"]["source"] == "messages"


def test_replace_keeps_identical_tokens_and_replaces_others(core):
    assert core.relay_prompt_add("sys", SYS, "config", None, True)["prompt"]["generation"] == 1
    submit(core, ecr("r", SYS + OWN, max_tokens=50))
    err = core.relay_prompt_add("sys", SYS[:-1], "config", None, True)["error"]
    assert err == {
        "status": 409,
        "message": "cannot replace system prompt 'sys': it is ready with 1 request(s) running on it",
    }
    core.abort_requests(["r"])
    out = core.relay_prompt_add("sys", SYS[:-1], "config", None, True)["prompt"]
    assert out["generation"] == 2 and out["state"] == "filling" and out["tokens"] == len(SYS) - 1


def test_chat_mismatch_is_counted_and_warned_once(core, monkeypatch):
    from vllm_relay.engine import admin

    warnings = []

    class Logger:
        def warning(self, fmt, *args):
            warnings.append(fmt % args)

    monkeypatch.setattr(admin, "_logger", Logger)
    add_ready(core, "chat", RT, "messages", "You are terse.")
    ok = submit(core, ecr("ok", RT + OWN, extra_args={CHAT_EXPECT_KEY: "chat", "mine": 1}))
    assert (
        ok.sampling_params.extra_args.get("mine") == 1
        and CHAT_EXPECT_KEY not in ok.sampling_params.extra_args
    )
    assert getattr(ok, INFO_ATTR).prompt.name == "chat"
    boundary = RT[:-1] + [999] + OWN
    for i in range(2):
        bad = submit(core, ecr(f"bad{i}", boundary, extra_args={CHAT_EXPECT_KEY: "chat"}))
        assert bad.sampling_params.extra_args is None and getattr(bad, INFO_ATTR, None) is None
    other = submit(core, ecr("other", [5] + RT + OWN, extra_args={CHAT_EXPECT_KEY: "chat"}))
    assert getattr(other, INFO_ATTR, None) is None
    assert (
        by_name(core)["chat"]["chat_mismatches"] == 3 and core.relay_serving_stats()["chat_mismatches"] == 3
    )
    assert len(warnings) == 1
    assert "carries the system message of prompt 'chat' but does not start with its 20 tokens" in warnings[0]
    assert "first difference at token 19" in warnings[0] and "tokenizer boundary" in warnings[0]
    # An unknown name (deleted meanwhile, or forged by a client) counts nothing.
    submit(core, ecr("gone", OWN, extra_args={CHAT_EXPECT_KEY: "nope"}))
    assert core.relay_serving_stats()["chat_mismatches"] == 3
