"""fill.py: the three forms of a system prompt, and the ids and salts of its requests."""

import pytest

from vllm_relay.system_prompts import SystemPromptRegistry
from vllm_relay.system_prompts.fill import (
    CHAT_PROBES,
    common_prefix,
    fill_request_id,
    fill_salt,
    prompt_token_ids,
    relay_salt,
    salt_secret,
)


def encode(text, add_special_tokens):  # one token per character, BOS = 1
    return ([1] if add_special_tokens else []) + [ord(c) for c in text]


def render(messages):
    return "".join(f"<{m['role']}>{m['content']}|" for m in messages)


def test_common_prefix():
    assert common_prefix([1, 2, 3], [1, 2, 4, 5]) == [1, 2]
    assert common_prefix([1, 2], [1, 2, 3]) == [1, 2]
    assert common_prefix([9], [1]) == []


def test_three_forms():
    assert prompt_token_ids("p", [5, 6], 8, None) == [5, 6]
    assert prompt_token_ids("p", "ab", 8, encode) == [1, 97, 98]  # a completion prompt: with BOS
    chat = prompt_token_ids("p", {"chat_system": "S"}, 64, encode, render)
    assert chat == encode("<system>S|<user>", False)  # up to where the user's text begins
    for probe in CHAT_PROBES:
        full = encode(render([{"role": "system", "content": "S"}, {"role": "user", "content": probe}]), False)
        assert full[: len(chat)] == chat


def test_errors():
    with pytest.raises(ValueError, match="p: given as text, but the engine has no tokenizer"):
        prompt_token_ids("p", "ab", 8, None)
    with pytest.raises(ValueError, match="p: given as 'chat_system', but no chat template renderer"):
        prompt_token_ids("p", {"chat_system": "S"}, 8, encode)
    with pytest.raises(ValueError, match="renders nothing common before the user message"):
        prompt_token_ids("p", {"chat_system": "S"}, 64, encode, lambda m: m[-1]["content"])
    with pytest.raises(ValueError, match="p: 4 tokens, more than max_prompt_tokens=3"):
        prompt_token_ids("p", "abc", 3, encode)
    with pytest.raises(ValueError, match="empty token ids"):
        prompt_token_ids("p", "", 3, lambda t, s: [])


def test_ids_and_salts_change_with_each_registration():
    reg = SystemPromptRegistry(2, 8)
    first = reg.register("sys", [1, 2])
    secret = salt_secret()
    assert fill_request_id(first) == "vllm-relay-fill:sys:1"
    assert fill_salt(first, secret) == f"vllm-relay:{secret}:fill:sys:1"
    assert relay_salt(first, None, secret) == f"vllm-relay:{secret}:relay:sys:1"
    assert relay_salt(first, "u:v", secret) == f"vllm-relay:{secret}:relay:sys:1:u:v"
    assert relay_salt(first, "", secret) == relay_salt(first, None, secret)  # "" is no salt to vLLM too
    reg.mark_ready("sys")
    second = reg.register("sys", [1, 3])
    assert relay_salt(second, None, secret) == f"vllm-relay:{secret}:relay:sys:2" != relay_salt(first, None, secret)


def test_salt_secrets_are_fresh_and_unambiguous():
    secrets = {salt_secret() for _ in range(100)}
    assert len(secrets) == 100 and all(len(s) == 32 and ":" not in s for s in secrets)
    # A relay salt with a user salt never equals a fill salt, whatever the names and user salt.
    reg = SystemPromptRegistry(2, 8)
    fill = reg.register("3", [1])
    relay = reg.register("fill", [2])
    s = salt_secret()
    assert fill_salt(fill, s) != relay_salt(relay, "3:1", s) and not relay_salt(relay, "x", s).startswith(
        fill_salt(fill, s))
