"""Prefix-cache isolation cannot be forged: no client `cache_salt` shares blocks with relay's requests.

Relay's routed requests hold their own tokens at positions shifted by the system length, and
fills hold the system prompt; either, shared with an ordinary request, is a content and timing
side channel between tenants. A client sets `cache_salt` to any string it likes, including the
strings relay's salts used to be (`vllm-relay:{name}:{generation}`). Each forgery is tried in
both directions on a real scheduler: the forger must get 0 cached tokens from relay's blocks, and
relay's requests 0 from the forger's. Positive controls show the blocks were there to be shared:
a second relay request hits them, and so does a "forger" that knows the engine's secret.
"""

import json

import pytest

from tests.engine.test_core import (  # noqa: F401
    KEPT, OWN, SYS, ecr, make_core, model_path, relay_of, run_until_idle, step, submit)
from vllm_relay.protocol import read_tag
from vllm_relay.system_prompts.fill import fill_salt, relay_salt

SUFFIX = OWN * 8
# A routed request computes SYS's last partial block (KEPT, 8 tokens) and SUFFIX itself: 48 tokens,
# three full blocks, cached under its relay salt. A forger sends exactly those tokens (and one more,
# since vLLM recomputes a prompt's last token) as an ordinary prompt.
OWN_TOKENS = KEPT + SUFFIX
FULL_BLOCKS = 48
FILL_BLOCKS = 32  # the fill's whole blocks: SYS's first 32 tokens


def forgeries(user_salt):
    """What a client can know or guess of relay's salts: the old format, with and without its own
    salt appended, the fill salt, and the current format with a guessed secret."""
    out = ["vllm-relay:sys:1", "vllm-relay-fill:sys:1", "vllm-relay:0:relay:sys:1",
           f"vllm-relay:{'0' * 32}:relay:sys:1"]
    if user_salt:
        out += [f"vllm-relay:sys:1:{user_salt}", f"vllm-relay:{'0' * 32}:relay:sys:1:{user_salt}"]
    return out


@pytest.fixture
def core(model_path):  # noqa: F811
    return make_core(model_path, relay={"system_prompts": {"sys": SYS}})


def cached_after_schedule(core, request):
    """Prefix-cache hits on `request`'s own tokens in its first step (what usage reports as cached
    prompt tokens, less the system prompt that relay counts as cached for routed requests)."""
    req = submit(core, request)
    stats = [o.prefill_stats for eco in step(core).values() for o in eco.outputs if o.request_id == req.request_id]
    tag = read_tag(req.sampling_params)
    return stats[0].num_local_cached_tokens - (tag.system_len if tag else 0)


@pytest.mark.parametrize("user_salt", [None, "tenant-a"])
def test_forged_salt_cannot_read_relay_blocks(core, user_salt):
    relay_req = submit(core, ecr("relay", SYS + SUFFIX, max_tokens=1, salt=user_salt))
    run_until_idle(core)  # its suffix blocks are now cached (freed, still hashed)
    for i, forged in enumerate(forgeries(user_salt)):
        forger = ecr(f"forger{i}", OWN_TOKENS + [1], max_tokens=1, salt=forged)  # relay's own tokens as a prompt
        assert cached_after_schedule(core, forger) == 0, forged
        run_until_idle(core)
    # Controls: relay's blocks were there to be shared, with the same registration and user salt...
    again = ecr("relay2", SYS + SUFFIX + [1], max_tokens=1, salt=user_salt)
    assert cached_after_schedule(core, again) == FULL_BLOCKS
    run_until_idle(core)
    # ...and only the engine's secret, which no client has, keeps the forger out.
    true_salt = relay_salt(relay_of(core).registry.get("sys"), user_salt, relay_of(core).secret)
    assert relay_req.cache_salt == true_salt
    insider = ecr("insider", OWN_TOKENS + [1], max_tokens=1, salt=true_salt)
    assert cached_after_schedule(core, insider) == FULL_BLOCKS


@pytest.mark.parametrize("user_salt", [None, "tenant-a"])
def test_relay_requests_cannot_read_forged_blocks(core, user_salt):
    for i, forged in enumerate(forgeries(user_salt)):
        submit(core, ecr(f"forger{i}", OWN_TOKENS + [1], max_tokens=1, salt=forged))
    run_until_idle(core)  # the forgers' blocks are cached under every forged salt
    assert cached_after_schedule(core, ecr("relay", SYS + SUFFIX + [1], max_tokens=1, salt=user_salt)) == 0
    assert core.relay_stats()["relay_requests"] == 1  # it was routed
    run_until_idle(core)
    # Control: the forgers' blocks were there: the same forged salt and tokens hit them.
    assert cached_after_schedule(core, ecr("again", OWN_TOKENS + [1], max_tokens=1,
                                           salt=forgeries(user_salt)[0])) == FULL_BLOCKS


def test_fill_blocks_cannot_be_read_with_a_forged_salt(core):
    # A request beginning with the system prompt is routed (and salted by relay) unless it is not
    # eligible: a repetition penalty sends it the ordinary way, with the salt it chose.
    prompt = relay_of(core).registry.get("sys")
    for i, forged in enumerate(forgeries("x")):
        forger = ecr(f"forger{i}", SYS + [1], max_tokens=1, salt=forged, repetition_penalty=1.1)
        assert cached_after_schedule(core, forger) == 0, forged
        run_until_idle(core)
    assert core.relay_stats()["relay_requests"] == 0
    # Control: the fill's blocks (the system prompt at positions 0..S-1) are cached.
    insider = ecr("insider", SYS + [1], max_tokens=1, salt=fill_salt(prompt, relay_of(core).secret),
                  repetition_penalty=1.1)
    assert cached_after_schedule(core, insider) == FILL_BLOCKS


def test_secret_is_per_engine_and_never_shown(model_path):  # noqa: F811
    a, b = (make_core(model_path, relay={"system_prompts": {"sys": SYS}}) for _ in range(2))
    secret = relay_of(a).secret
    assert secret != relay_of(b).secret
    submit(a, ecr("r", SYS + OWN, max_tokens=2, salt="u"))
    outputs = run_until_idle(a)
    shown = json.dumps([a.relay_stats(), a.relay_system_prompts(), relay_of(a).summary()])
    shown += repr(outputs)
    assert secret not in shown and "vllm-relay:" not in shown
