"""The relay server the endpoint and example tests talk to, and small HTTP helpers.

By default a server of the tiny test model is started (once per test session, see the
`relay_server` fixture in tests/conftest.py). With VLLM_RELAY_TEST_SERVER=<base url> (and
VLLM_RELAY_TEST_API_KEY) the tests run against that server instead: it must have been started with
`--attention-backend relay`, VLLM_PLUGINS=relay, VLLM_SERVER_DEV_MODE=1, `--enable-prompt-tokens-details`
and this module's RELAY configuration (`python -m tests.entrypoints.server` prints it; see
benchmarks/gpu/endpoints.sh).
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import requests

API_KEY = "relay-test-key"
SERVED_NAME = "tiny-relay"
GREETER = ("You are the greeter of a small shipping company. Greet the customer in one sentence, by name where "
           "you know it, and never promise a delivery date that the tracking page does not show.")
RELAY = {
    "max_prompts": 4,
    "max_prompt_tokens": 512,
    "log_stats_interval_s": 0,
    "metrics_interval_s": 0.2,
    # Every shared run a level: the tiny workloads of the tests share too little for the measured rule.
    "shared_path": "always",
    "system_prompts": {"greeter": {"chat_system": GREETER}},
}
# Blocks of 16 tokens (vLLM's CPU default is 128): relay shares a prompt's whole blocks only.
ARGS = ["--max-model-len", "1024", "--enable-prompt-tokens-details", "--block-size", "32"]
PROMPTS = "/v1/relay/system_prompts"
# vLLM's /pause and /resume (the delete test holds its streams in flight with them).
ENV = {"VLLM_SERVER_DEV_MODE": "1"}
# How long a test waits for the server to catch up (a counter, a drain) before it fails: generous, as
# a slow or shared machine only makes the wait longer; a waiting test returns as soon as it is there.
WAIT_S = 120


@dataclass
class Server:
    url: str
    api_key: str
    model: str
    log: Callable[[], str] | None  # the server log, when the tests started the server themselves

    @property
    def local(self) -> bool:
        return self.log is not None

    def headers(self, key: str | None = "default") -> dict:
        key = self.api_key if key == "default" else key
        return {"Authorization": f"Bearer {key}"} if key else {}

    def call(self, method: str, path: str, body=None, key: str | None = "default", raw: bytes | None = None):
        """(status, JSON body) of one request."""
        r = requests.request(
            method, self.url + path, json=body, data=raw, headers=self.headers(key), timeout=600
        )
        try:
            return r.status_code, r.json()
        except ValueError:
            return r.status_code, r.text

    def chat(self, system: str, user: str, max_tokens: int = 8, **extra) -> dict:
        status, body = self.call(
            "POST",
            "/v1/chat/completions",
            {
                "model": self.model,
                "max_tokens": max_tokens,
                "temperature": 0.0,
                "messages": [{"role": "system", "content": system}, {"role": "user", "content": user}],
                **extra,
            },
        )
        assert status == 200, body
        return body

    def metrics(self) -> dict[tuple, float]:
        """The /metrics scrape parsed with prometheus_client's parser: {(sample name, labels): value}."""
        from prometheus_client.parser import text_string_to_metric_families

        text = requests.get(self.url + "/metrics", timeout=60).text
        return {
            (s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text)
            for s in family.samples
        }

    def relay_metric(self, sample: str, **labels) -> float:
        """The sum of `sample`'s values on this server's model whose labels include `labels`."""
        want = {"model_name": self.model, **labels}
        return sum(
            v for (n, ls), v in self.metrics().items() if n == sample and want.items() <= dict(ls).items()
        )

    def steady_metric(self, sample: str, **labels) -> float:
        """`relay_metric` once /metrics has caught up with the engine. Call it when every request
        the test sent has been answered: the engine's counters are then final, and /metrics reads
        them every `metrics_interval_s` (0.2 s here), so a value unchanged for 1 s is theirs. Read
        a baseline this way: read at once, it may miss the requests of the test before."""
        value, since = self.relay_metric(sample, **labels), time.monotonic()
        deadline = since + WAIT_S
        while time.monotonic() - since < 1.0:
            if time.monotonic() > deadline:
                raise AssertionError(f"{sample} did not settle within {WAIT_S} s")
            time.sleep(0.1)
            if (now := self.relay_metric(sample, **labels)) != value:
                value, since = now, time.monotonic()
        return value

    def prompt(self, name: str) -> dict | None:
        status, body = self.call("GET", f"{PROMPTS}/{name}")
        return body if status == 200 else None

    def delete_all_but(self, keep=("greeter",)) -> None:
        _, listing = self.call("GET", PROMPTS)
        for p in listing["data"]:
            if p["name"] not in keep and p["state"] in ("ready", "filling", "failed"):
                self.call("DELETE", f"{PROMPTS}/{p['name']}")


def wait_for(check: Callable[[], object], timeout_s: float = WAIT_S, what: str = "condition"):
    """Poll `check` until it returns something truthy; fail with `what` after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while True:
        if result := check():
            return result
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")
        time.sleep(0.1)


def _env(name: str) -> str | None:
    """A test-harness variable (read here, not through vllm_relay.envs); empty reads as unset."""
    return os.environ.get(name) or None


@contextmanager
def relay_server() -> Iterator[Server]:
    if (url := _env("VLLM_RELAY_TEST_SERVER")) is not None:
        key = _env("VLLM_RELAY_TEST_API_KEY") or ""
        models = requests.get(
            url.rstrip("/") + "/v1/models", headers={"Authorization": f"Bearer {key}"}, timeout=60
        )
        models.raise_for_status()
        yield Server(url.rstrip("/"), key, models.json()["data"][0]["id"], None)
        return
    from vllm_relay.testing.models import get_model
    from vllm_relay.testing.server import RelayServer

    with RelayServer(get_model("tiny-llama-gqa"), SERVED_NAME, relay=RELAY, args=ARGS, api_key=API_KEY,
                     env=ENV) as s:
        yield Server(s.url, API_KEY, SERVED_NAME, s.log_text)


if __name__ == "__main__":
    print(json.dumps({"relay": RELAY}))
