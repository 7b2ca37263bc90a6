"""middleware.py: chat requests carrying a registered prompt's text get its name in vllm_xargs."""

import asyncio
import json

from vllm_relay.engine.admin import CHAT_EXPECT_KEY
from vllm_relay.entrypoints.chat import message_text, system_message_text
from vllm_relay.entrypoints.middleware import ChatExpectationMiddleware, tag_body

BY_TEXT = {"You are terse.": "terse"}


def chat(system, **extra):
    return json.dumps(
        {
            "model": "m",
            "messages": [{"role": "system", "content": system}, {"role": "user", "content": "Hi"}],
            **extra,
        }
    ).encode()


def test_tags_the_registered_text_and_keeps_other_xargs():
    body = json.loads(tag_body(chat("You are terse.", vllm_xargs={"mine": 1}), BY_TEXT))
    assert (
        body["vllm_xargs"] == {"mine": 1, CHAT_EXPECT_KEY: "terse"} and body["messages"][1]["content"] == "Hi"
    )
    parts = [{"type": "text", "text": "You are"}, {"type": "text", "text": "terse."}]
    assert tag_body(chat(parts), {"You are\nterse.": "t2"}) is not None  # text parts join with "\n"


def test_leaves_other_requests_alone_and_drops_a_forged_tag():
    assert tag_body(chat("Something else."), BY_TEXT) is None
    assert tag_body(b"{broken", BY_TEXT) is None
    assert tag_body(chat("You are terse.", vllm_xargs="not a dict"), BY_TEXT) is None
    forged = json.loads(tag_body(chat("Other.", vllm_xargs={CHAT_EXPECT_KEY: "terse"}), BY_TEXT))
    assert forged["vllm_xargs"] is None
    user_first = json.dumps({"messages": [{"role": "user", "content": "You are terse."}]}).encode()
    assert tag_body(user_first, BY_TEXT) is None


def test_message_text_helpers():
    assert message_text("x") == "x" and message_text([{"type": "image_url", "image_url": {}}]) is None
    assert system_message_text([{"role": "system", "content": "S"}]) == "S"
    for bad, why in (
        ([{"role": "user", "content": "S"}], "exactly one message"),
        ([{"role": "system", "content": ""}], "non-empty text"),
        ([], "got roles []"),
    ):
        try:
            system_message_text(bad)
        except ValueError as e:
            assert why in str(e)
        else:
            raise AssertionError(bad)


def run_asgi(middleware, body: bytes, path="/v1/chat/completions"):
    seen = {}

    async def app(scope, receive, send):
        seen["headers"] = dict(scope["headers"])
        seen["body"] = (await receive())["body"]
        seen["after"] = await receive()  # the client's own stream again: its disconnect

    async def receive_from_client():
        if not seen.get("sent"):
            seen["sent"] = True
            return {"type": "http.request", "body": body[:10], "more_body": True}
        if not seen.get("sent2"):
            seen["sent2"] = True
            return {"type": "http.request", "body": body[10:], "more_body": False}
        return {"type": "http.disconnect"}

    scope = {
        "type": "http",
        "method": "POST",
        "path": path,
        "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())],
    }
    asyncio.run(ChatExpectationMiddleware(app, middleware)(scope, receive_from_client, None))
    return seen


def test_asgi_rewrites_body_and_length_then_hands_back_the_client_stream():
    seen = run_asgi(lambda: BY_TEXT, chat("You are terse."))
    assert json.loads(seen["body"])["vllm_xargs"] == {CHAT_EXPECT_KEY: "terse"}
    assert int(seen["headers"][b"content-length"]) == len(seen["body"])
    assert seen["after"] == {"type": "http.disconnect"}
    untouched = chat("Other.")
    assert run_asgi(lambda: BY_TEXT, untouched)["body"] == untouched
    assert run_asgi(lambda: {}, untouched)["body"] == untouched[:10]  # nothing registered: not even read
