"""From a configured system prompt to the requests that compute and use it.

A system prompt is given as token ids, as text (tokenized as a completion prompt would be: with
the tokenizer's special tokens, e.g. BOS), or as {"chat_system": text}: the system message as the
model's chat template renders it. The chat form is found by rendering the template for a few probe
conversations with that system message and keeping their common token prefix: the tokens every
chat with this system message starts with (often including the user turn's header); see chat.py.

Pure Python: the tokenizer and the template renderer come in as callables, so this is testable
without vLLM; `vllm_relay.validate.PromptTools` makes them from the model's tokenizer.
"""

from __future__ import annotations

import secrets
from collections.abc import Callable, Mapping, Sequence

from vllm_relay.config import CHAT_SYSTEM_KEY, check_token_ids
from vllm_relay.system_prompts.chat import CHAT_PROBES, chat_prompt_ids, common_prefix, probe_conversations
from vllm_relay.system_prompts.registry import SystemPrompt

__all__ = ["CHAT_PROBES", "common_prefix", "fill_request_id", "fill_salt", "prompt_token_ids", "relay_salt",
           "salt_secret"]

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
        try:
            probes = probe_conversations(prompt[CHAT_SYSTEM_KEY])
            texts = {key: render_chat(messages) for key, messages in probes.items()}
        except Exception as e:  # the template is the model's code: any error is the prompt's error
            raise ValueError(f"{what}: the model's chat template cannot render it: {e}") from e
        # Rendered text is tokenized without special tokens, as vLLM tokenizes chat prompts.
        renders = {key: encode(text, False) for key, text in texts.items()}  # type: ignore[misc]
        ids = chat_prompt_ids(what, renders)
    else:
        ids = list(prompt)
    return check_token_ids(what, ids, max_tokens)


def fill_request_id(prompt: SystemPrompt) -> str:
    """The engine-internal id of the request computing `prompt` (one per registration)."""
    return f"vllm-relay-fill:{prompt.name}:{prompt.generation}"


def salt_secret() -> str:
    """A fresh secret for one engine's relay salts: 128 random bits as hex (no ':').

    vLLM keys the prefix cache by the request's `cache_salt`, which any client may set to any
    string. Relay's salts start with this secret, which never leaves the engine core (not in
    outputs, stats, logs or errors), so no client-supplied salt can equal one, and so no client
    request can read blocks computed by relay's requests or fills, or write blocks they read.
    A new secret per engine also keeps a persistent KV store (a KV connector) from serving blocks
    computed under an earlier engine's registrations, whose generations restart at 1.
    """
    return secrets.token_hex(16)


def fill_salt(prompt: SystemPrompt, secret: str) -> str:
    """Prefix-cache salt of a fill request: its blocks are never shared with anything."""
    return f"vllm-relay:{secret}:fill:{prompt.name}:{prompt.generation}"


def relay_salt(prompt: SystemPrompt, user_salt: str | None, secret: str) -> str:
    """Prefix-cache salt of a request routed to `prompt`.

    A routed request's cached blocks hold its own tokens at positions shifted by S, computed
    with this registration's system KV: they may be shared only with requests routed to the
    same registration, and with the same user salt (whose isolation the user asked for). The
    secret and names hold no ':' and the third field tells relay from fill salts, so the user's
    salt, appended after one more ':', cannot make two salts collide. An empty user salt means
    none, as it does to vLLM.
    """
    salt = f"vllm-relay:{secret}:relay:{prompt.name}:{prompt.generation}"
    return f"{salt}:{user_salt}" if user_salt else salt
