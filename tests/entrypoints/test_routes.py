"""routes.py + plugin.py without an engine: a scripted engine core behind the real routes."""

from types import SimpleNamespace

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient

from vllm_relay.config import RelayConfig
from vllm_relay.entrypoints import plugin as plugin_module
from vllm_relay.entrypoints.plugin import RelayServing

PATH = "/v1/relay/system_prompts"


def entry(state, generation=1):
    return {
        "name": "p",
        "state": state,
        "tokens": 3,
        "slot": 0,
        "live_requests": 0,
        "requests_served": 0,
        "tokens_reused": 0,
        "chat_mismatches": 0,
        "created_at": 1,
        "source": "token_ids",
        "generation": generation,
    }


class ScriptedEngineCore:
    """Answers utility calls from `script`: method -> list of results, consumed in order (the
    last one repeats)."""

    engine_ranks_managed = [0]

    def __init__(self, script):
        self.script, self.calls = script, []

    async def call_utility_async(self, method, *args):
        self.calls.append((method, args))
        answers = self.script[method]
        return answers.pop(0) if len(answers) > 1 else answers[0]


def client_for(script=None, relay=None):
    serving = RelayServing()
    app = FastAPI()
    app.state.args = SimpleNamespace(additional_config={"relay": relay or {}})
    serving.attach_router(app)
    if script is not None:
        serving.engine_client = SimpleNamespace(engine_core=ScriptedEngineCore(script))
        serving.config = RelayConfig(**(relay or {}))
    return TestClient(app), serving


@pytest.fixture(autouse=True)
def fast_polls(monkeypatch):
    monkeypatch.setattr(plugin_module, "FILL_POLL_INTERVAL_S", 0.001)


def test_register_waits_until_ready():
    client, serving = client_for(
        {
            "relay_prompt_add": [{"prompt": entry("filling")}],
            "relay_prompt_list": [[entry("filling")], [entry("filling")], [entry("ready")]],
        }
    )
    r = client.post(PATH, json={"name": "p", "token_ids": [1, 2, 3]})
    assert r.status_code == 201 and r.json() == {"object": "relay.system_prompt", **entry("ready")}
    calls = serving.engine_client.engine_core.calls
    assert calls[0] == ("relay_prompt_add", ("p", [1, 2, 3], "token_ids", None))
    assert [c[0] for c in calls[1:]] == ["relay_prompt_list"] * 3


def test_register_without_waiting_is_accepted():
    client, _ = client_for({"relay_prompt_add": [{"prompt": entry("filling")}]})
    r = client.post(PATH, json={"name": "p", "token_ids": [1], "wait": False})
    assert r.status_code == 202 and r.json()["state"] == "filling"


@pytest.mark.parametrize(
    "listing, status, message",
    [
        ([entry("failed")], 500, "the fill of system prompt 'p' failed"),
        ([], 409, "was deleted while it was filling"),
    ],
)
def test_register_reports_a_failed_or_deleted_fill(listing, status, message):
    client, _ = client_for(
        {"relay_prompt_add": [{"prompt": entry("filling")}], "relay_prompt_list": [listing]}
    )
    r = client.post(PATH, json={"name": "p", "token_ids": [1]})
    assert r.status_code == status and message in r.json()["error"]["message"]


def test_engine_errors_keep_their_status_and_name_the_field():
    client, _ = client_for(
        {
            "relay_prompt_add": [{"error": {"status": 413, "message": "too long"}}],
            "relay_prompt_delete": [{"error": {"status": 404, "message": "no system prompt"}}],
        }
    )
    r = client.post(PATH, json={"name": "p", "token_ids": [1]})
    assert r.status_code == 413 and r.json() == {
        "error": {"message": "too long", "type": "RequestTooLargeError", "param": "token_ids", "code": 413}
    }
    r = client.delete(PATH + "/p")
    assert r.status_code == 404 and r.json()["error"]["type"] == "NotFoundError"


def test_list_get_and_delete():
    client, serving = client_for(
        {
            "relay_prompt_list": [[entry("draining"), entry("ready", generation=2)]],
            "relay_prompt_delete": [{"prompt": entry("draining")}],
        },
        relay={"max_prompts": 3},
    )
    r = client.get(PATH)
    assert r.status_code == 200 and [e["state"] for e in r.json()["data"]] == ["draining", "ready"]
    assert r.json()["max_prompts"] == 3 and r.json()["max_prompt_tokens"] == 8192
    assert client.get(PATH + "/p").json()["generation"] == 2  # the current one over the draining one
    assert client.get(PATH + "/q").status_code == 404
    serving.remember_text("p", "You help.", chat=True)
    r = client.delete(PATH + "/p")
    assert r.status_code == 200 and r.json()["deleted"] is True and r.json()["state"] == "draining"
    assert serving._by_text == {}


def test_admin_routes_can_be_turned_off():
    client, _ = client_for({"relay_prompt_list": [[]]}, relay={"admin_routes": False})
    assert client.get(PATH).status_code == 200
    assert client.post(PATH, json={"name": "p", "text": "x"}).status_code == 405
    assert client.delete(PATH + "/p").status_code == 405


def test_routes_say_when_relay_is_off():
    client, _ = client_for()
    r = client.get(PATH)
    assert r.status_code == 404 and "relay attention is not enabled" in r.json()["error"]["message"]
