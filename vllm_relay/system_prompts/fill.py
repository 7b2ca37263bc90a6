"""From a configured system prompt to the requests that compute and use it.

A system prompt is given as token ids, as text (tokenized as a completion prompt would be: with
the tokenizer's special tokens, e.g. BOS), or as {"chat_system": text}: the system message as the
model's chat template renders it. The chat form is found by rendering the template for a few probe
conversations with that system message and keeping their common token prefix: the tokens every
chat with this system message starts with (often including the user turn's header); see chat.py.

Pure Python: the tokenizer and the template renderer come in as callables, so this is testable
without vLLM; `vllm_relay.hooks.engine` passes vLLM's own.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

from vllm_relay.config import CHAT_SYSTEM_KEY, check_token_ids
from vllm_relay.system_prompts.chat import CHAT_PROBES, chat_prompt_ids, common_prefix, probe_conversations
from vllm_relay.system_prompts.registry import SystemPrompt

__all__ = ["CHAT_PROBES", "common_prefix", "fill_request_id", "fill_salt", "prompt_token_ids", "relay_salt"]

# text, add_special_tokens -> token ids
Encode = Callable[[str, bool], list[int]]
# chat messages [{"role", "content"}] -> rendered prompt text
RenderChat = Callable[[list[dict[str, str]]], str]


def prompt_token_ids(
    what: str,
    prompt: str | Sequence[int] | Mapping[str, str],
    max_tokens: int,
    encode: Encode | None,
    render_chat: RenderChat | None = None,
) -> list[int]:
    """The token ids of a system prompt in any of its three forms, checked (1..max_tokens)."""
    if isinstance(prompt, (str, Mapping)) and encode is None:
        raise ValueError(
            f"{what}: given as text, but the engine has no tokenizer (skip_tokenizer_init); "
            f"give token ids instead"
        )
    if isinstance(prompt, str):
        ids = encode(prompt, True)  # type: ignore[misc]
    elif isinstance(prompt, Mapping):
        if render_chat is None:
            raise ValueError(f"{what}: given as {CHAT_SYSTEM_KEY!r}, but no chat template renderer")
        # Rendered text is tokenized without special tokens, as vLLM tokenizes chat prompts.
        renders = {key: encode(render_chat(messages), False)  # type: ignore[misc]
                   for key, messages in probe_conversations(prompt[CHAT_SYSTEM_KEY]).items()}
        ids = chat_prompt_ids(what, renders)
    else:
        ids = list(prompt)
    return check_token_ids(what, ids, max_tokens)


def fill_request_id(prompt: SystemPrompt) -> str:
    """The engine-internal id of the request computing `prompt` (one per registration)."""
    return f"vllm-relay-fill:{prompt.name}:{prompt.generation}"


def fill_salt(prompt: SystemPrompt) -> str:
    """Prefix-cache salt of a fill request: its blocks are never shared with anything."""
    return f"vllm-relay-fill:{prompt.name}:{prompt.generation}"


def relay_salt(prompt: SystemPrompt, user_salt: str | None) -> str:
    """Prefix-cache salt of a request routed to `prompt`.

    A routed request's cached blocks hold its own tokens at positions shifted by S, computed
    with this registration's system KV: they may be shared only with requests routed to the
    same registration, and with the same user salt (whose isolation the user asked for). Names
    hold no ':', so the user's salt, appended after one, cannot make two salts collide.
    """
    salt = f"vllm-relay:{prompt.name}:{prompt.generation}"
    return salt if user_salt is None else f"{salt}:{user_salt}"
