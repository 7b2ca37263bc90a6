"""Tells the engine core which registered prompt a chat request's system message is.

A chat request whose first message is a system message with the text of a registered prompt
should start with that prompt's tokens. When it does not (the request brings its own chat template
or kwargs, or the user's text changes the tokenization at the boundary), relay silently does not
fire. This ASGI middleware, on `POST /v1/chat/completions`, looks the system message's text up among
the registered prompts' texts and adds the prompt's name to the request's `vllm_xargs`
(`vllm_relay_chat`); the engine core strips it, compares the tokens, and counts and explains a
mismatch (engine/admin.py `check_chat`). A `vllm_relay_chat` sent by the client is dropped.

Cost: requests are untouched while no registered prompt has a text; otherwise each chat request's
JSON body is parsed once more (and re-encoded when it carries a registered prompt's text).
"""

from __future__ import annotations

import json
from collections.abc import Callable

from vllm_relay.engine.admin import CHAT_EXPECT_KEY
from vllm_relay.entrypoints.chat import message_text

CHAT_PATH = "/v1/chat/completions"


def tag_body(body: bytes, prompt_by_text: dict[str, str]) -> bytes | None:
    """The body with the expected prompt's name in `vllm_xargs`, or None to leave it unchanged."""
    try:
        request = json.loads(body)
    except ValueError:
        return None  # vLLM answers malformed bodies itself
    if not isinstance(request, dict) or not isinstance(xargs := request.get("vllm_xargs") or {}, dict):
        return None
    messages = request.get("messages")
    first = messages[0] if isinstance(messages, list) and messages else None
    text = (
        message_text(first.get("content"))
        if isinstance(first, dict) and first.get("role") == "system"
        else None
    )
    name = prompt_by_text.get(text) if text else None
    if name is None:
        if CHAT_EXPECT_KEY not in xargs:
            return None
        xargs = {k: v for k, v in xargs.items() if k != CHAT_EXPECT_KEY}
    else:
        xargs = {**xargs, CHAT_EXPECT_KEY: name}
    request["vllm_xargs"] = xargs or None
    return json.dumps(request).encode()


class ChatExpectationMiddleware:
    """Pure ASGI middleware; `prompts_by_text()` gives the current {text: prompt name}."""

    def __init__(self, app, prompts_by_text: Callable[[], dict[str, str]]) -> None:
        self.app = app
        self.prompts_by_text = prompts_by_text

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope.get("method") != "POST":
            return await self.app(scope, receive, send)
        path = scope["path"].removeprefix(scope.get("root_path", ""))
        by_text = self.prompts_by_text()
        headers = dict(scope.get("headers") or [])
        if path != CHAT_PATH or not by_text or b"content-encoding" in headers:
            return await self.app(scope, receive, send)
        chunks, more = [], True
        while more:
            message = await receive()
            if message["type"] != "http.request":  # the client went away
                return await self.app(scope, _replay([message], receive), send)
            chunks.append(message.get("body", b""))
            more = message.get("more_body", False)
        body = b"".join(chunks)
        tagged = tag_body(body, by_text)
        if tagged is not None:
            body = tagged
            scope = {
                **scope,
                "headers": [(k, v) for k, v in scope["headers"] if k != b"content-length"]
                + [(b"content-length", str(len(body)).encode())],
            }
        replay = _replay([{"type": "http.request", "body": body, "more_body": False}], receive)
        return await self.app(scope, replay, send)


def _replay(messages: list[dict], receive):
    """`receive` that first gives `messages`, then the client's own (e.g. its disconnect)."""
    pending = list(messages)

    async def replay():
        if pending:
            return pending.pop(0)
        return await receive()

    return replay
