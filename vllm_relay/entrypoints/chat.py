"""Chat system prompts as the OpenAI server renders them: its own chat template (`--chat-template`,
`--default-chat-template-kwargs`, content format), through the same `OnlineRenderer` that renders
chat requests, so a registered prompt is exactly the token prefix of the chats that carry it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from vllm_relay.system_prompts.chat import chat_prompt_ids, probe_conversations


def message_text(content: Any) -> str | None:
    """A chat message's text: a string, or text parts joined as vLLM joins them; None otherwise
    (images, audio, or anything that is not plain text)."""
    if isinstance(content, str):
        return content
    if isinstance(content, list) and content:
        texts = [
            part.get("text") for part in content if isinstance(part, dict) and part.get("type") == "text"
        ]
        if len(texts) == len(content) and all(isinstance(t, str) for t in texts):
            return "\n".join(texts)
    return None


def system_message_text(messages: Sequence[Any]) -> str:
    """The text of `messages` given to register a chat prompt: exactly one system message with
    non-empty text; ValueError saying what is wrong otherwise."""
    roles = [m.get("role") if isinstance(m, dict) else type(m).__name__ for m in messages]
    if len(messages) != 1 or roles != ["system"]:
        raise ValueError(f'messages must hold exactly one message with role "system"; got roles {roles}')
    text = message_text(messages[0].get("content"))
    if not text:
        raise ValueError("the system message's content must be non-empty text (a string or text parts)")
    return text


async def render_tokens(online_renderer, messages: list[dict]) -> list[int]:
    """The prompt token ids of a chat request with `messages`, as the server renders it."""
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
    from vllm.entrypoints.serve.engine.protocol import ErrorResponse

    result = await online_renderer.render_chat(ChatCompletionRequest(messages=messages))
    if isinstance(result, ErrorResponse):
        raise ValueError(f"the server's chat template cannot render it: {result.error.message}")
    _conversation, engine_inputs = result
    return list(engine_inputs[0]["prompt_token_ids"])


async def chat_system_prompt_ids(online_renderer, what: str, system_text: str) -> list[int]:
    """The system prompt's token ids for chats with this system message on this server;
    ValueError with the reason when it would never match one (see system_prompts/chat.py)."""
    renders = {
        key: await render_tokens(online_renderer, messages)
        for key, messages in probe_conversations(system_text).items()
    }
    return chat_prompt_ids(what, renders)
