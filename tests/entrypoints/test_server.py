"""The relay endpoints against a real OpenAI server process (tiny model on the CPU, or the server of
VLLM_RELAY_TEST_SERVER, e.g. on the GPU host: benchmarks/gpu/endpoints.sh).

Registers over HTTP, chats with the openai SDK (sync, streaming) and aiohttp and sees relay fire,
lists, deletes while 32 streams are in flight, checks every error status and the api key, and
reads the relay counters from /metrics with prometheus_client's parser.
"""

import asyncio
import json

import pytest

from tests.entrypoints.server import GREETER, PROMPTS, wait_for

pytestmark = pytest.mark.engine

SUPPORT = ("You are the support assistant of a shipping company. Answer briefly and politely, and say where the "
           "customer can track a parcel when they ask about one.")
# Tokens per stream in the delete test (the engine is paused while the delete comes).
STREAM_TOKENS = 32


@pytest.fixture
def server(relay_server):
    yield relay_server
    relay_server.delete_all_but()  # each test leaves the start-up prompt only


def register(server, name, **form):
    status, body = server.call("POST", PROMPTS, {"name": name, **form})
    assert status == 201, body
    return body


def counted(server, name, want, what):
    """Wait until the /metrics counter `name` reads `want`, then check it stays there (it must
    count each request once, not once per refresh)."""
    wait_for(lambda: server.relay_metric(name) == want, what=f"{name} == {want} ({what})")
    import time

    time.sleep(1.0)  # several metrics refreshes
    assert server.relay_metric(name) == want


def test_api_key_guards_the_relay_routes(server):
    assert server.call("GET", PROMPTS, key=None)[0] == 401
    assert server.call("GET", PROMPTS, key="wrong")[0] == 401
    assert server.call("POST", PROMPTS, {"name": "x", "text": "y"}, key=None)[0] == 401
    assert server.call("DELETE", f"{PROMPTS}/greeter", key=None)[0] == 401
    status, listing = server.call("GET", PROMPTS)
    assert status == 200 and listing["object"] == "list"


def test_startup_prompt_is_listed_with_every_field(server):
    _, listing = server.call("GET", PROMPTS)
    (greeter,) = [p for p in listing["data"] if p["name"] == "greeter"]
    assert greeter["object"] == "relay.system_prompt" and greeter["state"] == "ready"
    assert greeter["source"] == "config" and greeter["slot"] == 0 and greeter["tokens"] > 10
    assert 0 < greeter["shared_tokens"] <= greeter["tokens"]  # its whole KV cache blocks
    for field in ("live_requests", "requests_served", "tokens_reused", "chat_mismatches", "created_at"):
        assert isinstance(greeter[field], int), field
    assert listing["max_prompts"] == 4 and listing["max_prompt_tokens"] == 512


def openai_client(server):
    """The openai SDK's client, or None where the SDK is missing or cannot build one (the GPU host's
    vLLM bundle carries `openai` without its TLS dependency): aiohttp then covers the same requests."""
    try:
        import openai

        return openai.OpenAI(base_url=server.url + "/v1", api_key=server.api_key)
    except ImportError:
        return None


def test_register_then_chat_with_openai_sdk_streaming_and_aiohttp(server):
    created = register(server, "support", messages=[{"role": "system", "content": SUPPORT}])
    assert created["state"] == "ready" and created["source"] == "messages" and created["slot"] > 0
    before = server.steady_metric("vllm_relay_requests_total")
    client = openai_client(server)
    if client is None and server.local:
        pytest.fail("the openai SDK is a test requirement (requirements/test.txt)")
    chats = 1
    aio = asyncio.run(aiohttp_chat(server, SUPPORT, "Where is my parcel?"))
    assert aio["choices"][0]["finish_reason"] in ("length", "stop") and aio["usage"]["completion_tokens"] >= 1
    # Usage counts the full prompt; the system part was not recomputed.
    assert aio["usage"]["prompt_tokens"] > created["tokens"]
    assert aio["usage"]["prompt_tokens_details"]["cached_tokens"] >= created["shared_tokens"]
    if client is not None:
        messages = [{"role": "system", "content": SUPPORT}, {"role": "user", "content": "Where is my parcel?"}]
        reply = client.chat.completions.create(model=server.model, messages=messages, max_tokens=8, temperature=0)
        assert reply.usage.prompt_tokens == aio["usage"]["prompt_tokens"]
        stream = client.chat.completions.create(model=server.model, messages=messages, max_tokens=8, temperature=0,
                                                stream=True, stream_options={"include_usage": True})
        chunks = list(stream)
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        # Greedy: the same reply through the SDK, streamed or not, and through aiohttp.
        assert text == reply.choices[0].message.content == aio["choices"][0]["message"]["content"]
        assert chunks[-1].usage.prompt_tokens == reply.usage.prompt_tokens
        chats = 3
    counted(server, "vllm_relay_requests_total", before + chats, f"{chats} chats")
    assert server.relay_metric("vllm_relay_system_prompt_requests_total", name="support") == chats
    support = server.prompt("support")
    assert support["requests_served"] == chats and support["tokens_reused"] == chats * created["shared_tokens"]


async def aiohttp_chat(server, system, user, max_tokens=8):
    import aiohttp

    body = {
        "model": server.model,
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "messages": [{"role": "system", "content": system}, {"role": "user", "content": user}],
    }
    async with aiohttp.ClientSession(headers=server.headers()) as session:
        async with session.post(server.url + "/v1/chat/completions", json=body) as r:
            assert r.status == 200, await r.text()
            return await r.json()


def test_metrics_count_each_request_once(server):
    before = server.steady_metric("vllm_relay_requests_total")
    greeter_before = server.steady_metric("vllm_relay_system_prompt_requests_total", name="greeter")
    reused_before = server.steady_metric("vllm_relay_prompt_tokens_reused_total")
    for i in range(4):
        server.chat(GREETER, f"Hello, I am customer {i}.")
    server.chat("Not a registered system prompt.", "Hello.")  # the ordinary path: not counted
    counted(server, "vllm_relay_requests_total", before + 4, "4 relay chats")
    assert (
        server.relay_metric("vllm_relay_system_prompt_requests_total", name="greeter") == greeter_before + 4
    )
    tokens = server.prompt("greeter")["shared_tokens"]
    assert server.relay_metric("vllm_relay_prompt_tokens_reused_total") == reused_before + 4 * tokens
    assert server.relay_metric("vllm_relay_system_prompts", state="ready") >= 1
    assert server.relay_metric("vllm_relay_held_requests") == 0
    assert server.relay_metric("vllm_relay_fills_total", result="ok") >= 1
    assert server.relay_metric("vllm_relay_system_prompt_slots") == 4


def completion_texts(server, body: dict, stream: bool) -> list[str]:
    """The n choices' texts of one /v1/completions request, streamed (server-sent events) or not."""
    import requests

    r = requests.post(server.url + "/v1/completions", json={**body, "stream": stream}, headers=server.headers(),
                      stream=stream, timeout=600)
    assert r.status_code == 200, r.text
    if not stream:
        return [c["text"] for c in sorted(r.json()["choices"], key=lambda c: c["index"])]
    texts = [""] * body["n"]
    for line in r.iter_lines(decode_unicode=True):
        if line.startswith("data: ") and line != "data: [DONE]":
            for c in json.loads(line[6:])["choices"]:
                texts[c["index"]] += c["text"]
    return texts


def test_n_samples_over_http_read_their_prompt_once(server):
    """n > 1 through the completions (streamed and not) and chat endpoints, nothing registered for
    the prompt: its samples share its blocks in vLLM's prefix cache, and relay reads them as a level
    (/metrics counts the tokens). The same seed gives the same samples streamed or not. (Exactness
    against vLLM's own backend for n > 1 is tests/e2e/test_auto_levels.py, on the same engine path.)"""
    prompt = " ".join(f"parcel {i} left the depot at dawn and reached the harbour by noon." for i in range(24))
    body = {"model": server.model, "prompt": prompt, "n": 4, "seed": 7, "max_tokens": 6, "temperature": 1.0}
    before = server.steady_metric("vllm_relay_level_tokens_total")
    saved_before = server.steady_metric("vllm_relay_kv_bytes_saved_total")
    plain = completion_texts(server, body, stream=False)
    streamed = completion_texts(server, body, stream=True)
    assert len(plain) == 4 and streamed == plain
    status, chat = server.call("POST", "/v1/chat/completions", {
        "model": server.model, "n": 3, "seed": 5, "max_tokens": 6, "temperature": 1.0,
        "messages": [{"role": "user", "content": prompt}]})
    assert status == 200 and len(chat["choices"]) == 3, chat
    wait_for(lambda: server.relay_metric("vllm_relay_level_tokens_total") > before,
             what="level tokens in /metrics after n > 1 requests")
    assert server.relay_metric("vllm_relay_kv_bytes_saved_total") > saved_before


def test_error_statuses(server):
    def error(status, body=None, raw=None, method="POST", path=PROMPTS):
        got, answer = server.call(method, path, body, raw=raw)
        assert got == status, answer
        assert (
            set(answer["error"]) == {"message", "type", "param", "code"} and answer["error"]["code"] == status
        )
        return answer["error"]

    assert "not valid JSON" in error(400, raw=b"{nope")["message"]
    assert error(400, {"name": "a b", "text": "x"})["param"] == "name"
    assert "unknown field" in error(400, {"name": "a", "text": "x", "extra": 1})["message"]
    assert "exactly one of" in error(400, {"name": "a", "text": "x", "token_ids": [1]})["message"]
    assert "already exists" in error(409, {"name": "greeter", "text": "x"})["message"]
    assert error(409, {"name": "greeter", "text": "x"})["type"] == "ConflictError"
    e = error(413, {"name": "long", "token_ids": [5] * 513})
    assert "513 tokens, more than max_prompt_tokens=512" in e["message"] and e["param"] == "token_ids"
    assert "max_prompt_tokens=512" in error(413, {"name": "long", "text": "word " * 600})["message"]
    assert "max_model_len" in error(413, {"name": "long", "text": "word " * 20000})["message"]
    assert "vocabulary" in error(422, {"name": "vocab", "token_ids": [1, 10**7]})["message"]
    assert (
        "exactly one message"
        in error(422, {"name": "m", "messages": [{"role": "user", "content": "x"}]})["message"]
    )
    assert error(422, {"name": "e", "text": ""})["param"] == "text"
    assert "no system prompt named 'nope'" in error(404, method="DELETE", path=f"{PROMPTS}/nope")["message"]
    assert error(404, method="GET", path=f"{PROMPTS}/nope")["type"] == "NotFoundError"
    for i in range(3):  # slots 1..3 (the start-up prompt holds slot 0)
        register(server, f"fill{i}", token_ids=[7 + i] + list(range(20, 60)))
    e = error(507, {"name": "fill3", "token_ids": list(range(1, 60))})
    assert (
        "no free slot, all max_prompts=4 are taken" in e["message"]
        and e["type"] == "InsufficientStorageError"
    )
    _, listing = server.call("GET", PROMPTS)
    assert sorted(p["name"] for p in listing["data"]) == [
        "fill0",
        "fill1",
        "fill2",
        "greeter",
    ]  # nothing lost


def test_text_prompt_and_chat_mismatch_are_reported(server):
    text = "You are a pirate captain. Answer every question about parcels, ships and the sea like one would."
    created = register(server, "pirate", text=text)
    assert created["source"] == "text"
    before = server.steady_metric("vllm_relay_chat_mismatches_total")
    relay_before = server.steady_metric("vllm_relay_requests_total")
    for _ in range(2):  # a chat with that system message: not the text's tokens (no chat template)
        server.chat(text, "Ahoy?")
    counted(server, "vllm_relay_chat_mismatches_total", before + 2, "2 mismatched chats")
    assert server.relay_metric("vllm_relay_requests_total") == relay_before
    assert server.prompt("pirate")["chat_mismatches"] == 2
    if server.local:
        warnings = [
            line
            for line in server.log().splitlines()
            if "carries the system message of prompt 'pirate'" in line
        ]
        assert len(warnings) == 1 and "registered as completion text" in warnings[0]
    # A completion with the text itself is served by relay.
    status, body = server.call(
        "POST",
        "/v1/completions",
        {"model": server.model, "prompt": text + " Ahoy?", "max_tokens": 4, "temperature": 0.0},
    )
    assert status == 200, body
    counted(server, "vllm_relay_requests_total", relay_before + 1, "the completion")


def test_delete_while_32_streams_are_in_flight(server):
    first = register(server, "drain", messages=[{"role": "system", "content": SUPPORT}])
    outputs, deleted, again = asyncio.run(streams_then_delete(server, 32))
    assert deleted["state"] == "draining" and deleted["deleted"] is True and deleted["live_requests"] == 32
    assert (
        again["state"] == "ready"
        and again["slot"] != first["slot"]
        and again["generation"] > first["generation"]
    )
    assert [o["finish_reason"] for o in outputs] == ["length"] * 32
    # Every stream ran to its end (dummy weights on the GPU host may decode to empty text).
    assert all(o["completion_tokens"] == STREAM_TOKENS for o in outputs)
    assert not server.local or all(o["text"] for o in outputs)

    # Once the streams are done the old registration leaves its slot.
    def drained():
        _, listing = server.call("GET", PROMPTS)
        mine = [p for p in listing["data"] if p["name"] == "drain"]
        return [(p["state"], p["slot"]) for p in mine] == [("ready", again["slot"])]

    wait_for(drained, what="the old registration to free its slot")
    _, listing = server.call("GET", PROMPTS)
    assert first["slot"] not in {p["slot"] for p in listing["data"]}
    # The new registration serves correctly: relay fires on it, and (fp32 CPU) it gives the
    # same greedy reply as the ordinary path (prompt_logprobs makes a request take that path).
    reply = server.chat(SUPPORT, "Is my parcel lost?", max_tokens=12)
    assert server.prompt("drain")["requests_served"] == 1
    if server.local:
        ordinary = server.chat(SUPPORT, "Is my parcel lost?", max_tokens=12, prompt_logprobs=1)
        assert reply["choices"][0]["message"]["content"] == ordinary["choices"][0]["message"]["content"]
        assert server.prompt("drain")["requests_served"] == 1


async def streams_then_delete(server, n):
    """Start `n` streams on "drain", delete it while all of them are in flight, register it again.

    vLLM's engine is paused (mode "keep": requests stay, nothing runs) from before the streams to
    after the new registration took its slot, so the delete finds every stream still running and
    the new registration finds the old one still draining, however fast the engine decodes.
    """
    import aiohttp

    async def stream(session, i):
        body = {
            "model": server.model,
            "max_tokens": STREAM_TOKENS,
            "temperature": 0.0,
            "ignore_eos": True,
            "stream": True,
            "stream_options": {"include_usage": True},
            "messages": [{"role": "system", "content": SUPPORT}, {"role": "user", "content": f"Parcel {i}?"}],
        }
        text, finish, usage = "", None, None
        async with session.post(server.url + "/v1/chat/completions", json=body) as r:
            assert r.status == 200, await r.text()
            async for line in r.content:
                line = line.decode().strip()
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                for choice in chunk.get("choices") or []:
                    text += choice["delta"].get("content") or ""
                    finish = choice.get("finish_reason") or finish
                usage = chunk.get("usage") or usage
        return {"text": text, "finish_reason": finish, "completion_tokens": usage["completion_tokens"]}

    def call(method, path, body=None):
        return asyncio.to_thread(server.call, method, path, body)

    def live():
        return (server.prompt("drain") or {}).get("live_requests") == n

    def beside_draining():
        _, listing = server.call("GET", PROMPTS)
        return sorted(p["state"] for p in listing["data"] if p["name"] == "drain") == ["draining", "filling"]

    paused = await call("POST", "/pause?mode=keep&clear_cache=false")
    assert paused[0] == 200, f"the server must run with VLLM_SERVER_DEV_MODE=1 (vLLM's /pause): {paused}"
    timeout = aiohttp.ClientTimeout(total=600)
    async with aiohttp.ClientSession(headers=server.headers(), timeout=timeout) as session:
        tasks = [asyncio.create_task(stream(session, i)) for i in range(n)]
        try:
            await asyncio.to_thread(wait_for, live, what=f"{n} requests on the prompt")
            deleted = await call("DELETE", f"{PROMPTS}/drain")
            registering = asyncio.create_task(asyncio.to_thread(
                register, server, "drain", messages=[{"role": "system", "content": SUPPORT}]))
            # Its slot is taken at once; its fill runs once the engine resumes.
            await asyncio.to_thread(wait_for, beside_draining, what="the new registration beside the draining one")
        finally:
            resumed = await call("POST", "/resume")  # also on failure: never leave the shared server paused
        again = await registering
        outputs = await asyncio.gather(*tasks)
    assert deleted[0] == 200 and resumed[0] == 200, (deleted, resumed)
    return outputs, deleted[1], again
