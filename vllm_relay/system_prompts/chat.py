"""A chat system message as a system prompt: the tokens every chat with it starts with.

The template is rendered (by whoever owns it: the engine core with the model's default template,
the OpenAI server with its own, `--chat-template`) for a few probe conversations that start with
the system message. The prompt is the common token prefix of two single-turn probes; it is
refused, with the reason, when it would never match chat requests that carry that system message:

- it is empty (the template renders nothing common before the user's text);
- another single-turn or a multi-turn conversation does not start with it (the system message's
  last tokens depend on what follows: a tokenizer boundary);
- the conversation without the system message starts with it too (the template drops the system
  message, or does not render it first: the prompt would not contain it).

Pure: the renders come in as token lists, so this runs without vLLM and the front end may render
asynchronously.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

# Two user messages that share no leading character, class or length, so the common prefix of
# the two renders stops exactly where the user's text begins.
CHAT_PROBES = ("Hello.", "42?")

Message = dict[str, str]


def common_prefix(a: Sequence[int], b: Sequence[int]) -> list[int]:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return list(a[:n])


def probe_conversations(system_text: str) -> dict[str, list[Message]]:
    """The conversations to render (each with the generation prompt, as a chat request is)."""
    system = {"role": "system", "content": system_text}
    return {
        "probe_a": [system, {"role": "user", "content": CHAT_PROBES[0]}],
        "probe_b": [system, {"role": "user", "content": CHAT_PROBES[1]}],
        "question": [system, {"role": "user", "content": "What is the capital of France?"}],
        "multi_turn": [
            system,
            {"role": "user", "content": "Hi."},
            {"role": "assistant", "content": "Hello! How can I help?"},
            {"role": "user", "content": "Tell me more."},
        ],
        "no_system": [{"role": "user", "content": CHAT_PROBES[0]}],
    }


def first_difference(a: Sequence[int], b: Sequence[int]) -> int:
    """The first index where `a` and `b` differ (the shorter length if one is a prefix)."""
    return len(common_prefix(a, b))


def chat_prompt_ids(what: str, renders: Mapping[str, Sequence[int]]) -> list[int]:
    """The system prompt's token ids from the renders of `probe_conversations` (same keys);
    ValueError naming `what` and the reason when it would never match a chat request."""
    ids = common_prefix(renders["probe_a"], renders["probe_b"])
    if not ids:
        raise ValueError(
            f"{what}: the chat template renders nothing common before the user message "
            f"(first tokens {list(renders['probe_a'][:8])} vs {list(renders['probe_b'][:8])})"
        )
    for key, described in (("question", "another user message"), ("multi_turn", "a multi-turn chat")):
        render = renders[key]
        if list(render[: len(ids)]) != ids:
            at = first_difference(render, ids)
            raise ValueError(
                f"{what}: would never match chat requests: with {described} the rendered tokens "
                f"differ from the system part at token {at} of {len(ids)} (a tokenizer boundary: "
                f"the system message's last tokens depend on the text that follows it)"
            )
    if list(renders["no_system"][: len(ids)]) == ids:
        raise ValueError(
            f"{what}: would never match chat requests with that system message only: the chat "
            f"template renders the same {len(ids)} leading tokens without it (it drops the system "
            f"message or does not render it first)"
        )
    return ids
