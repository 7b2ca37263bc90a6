"""Two API server processes (`vllm serve --api-server-count 2`: multiprocess Prometheus mode).

Requests spread over both processes (SO_REUSEPORT); the relay series in /metrics are exported by
the first process only, so each request is counted once, not once per process. Both processes
tag chat requests for the mismatch check (the second learns a registration made through the
first at its next refresh).
"""

import pytest

from tests.entrypoints.server import API_KEY, PROMPTS, SERVED_NAME, Server, wait_for

pytestmark = pytest.mark.engine

SYSTEM = ("You are a helpful assistant for a bakery. You know the opening hours, the breads baked each morning "
          "and which cakes can be ordered a day ahead.")
PIRATE = "You are a pirate captain. Answer every question about parcels, ships and the sea like one would."


@pytest.fixture(scope="module")
def server():
    from vllm_relay.testing.models import get_model
    from vllm_relay.testing.server import RelayServer

    relay = {
        "max_prompts": 2,
        "max_prompt_tokens": 512,
        "log_stats_interval_s": 0,
        "metrics_interval_s": 0.2,
    }
    with RelayServer(
        get_model("tiny-llama-gqa"),
        SERVED_NAME,
        relay=relay,
        args=["--max-model-len", "1024", "--block-size", "32"],
        api_key=API_KEY,
        api_server_count=2,
    ) as s:
        yield Server(s.url, API_KEY, SERVED_NAME, s.log_text)


def test_two_api_servers_count_each_request_once(server):
    assert server.log().count("Loaded endpoint plugin relay") == 2
    names = {name for name, _ in server.metrics()}
    # Multiprocess mode is on: its collector reads the processes' files, which keep no _created.
    assert "vllm_relay_requests_total" in names and "vllm_relay_requests_created" not in names
    status, body = server.call(
        "POST", PROMPTS, {"name": "bakery", "messages": [{"role": "system", "content": SYSTEM}]}
    )
    assert status == 201, body
    status, body = server.call("POST", PROMPTS, {"name": "pirate", "text": PIRATE})
    assert status == 201, body
    for i in range(8):  # a new connection each: both processes get some
        server.chat(SYSTEM, f"Do you sell bread number {i}?", max_tokens=4)
    wait_for(
        lambda: server.relay_metric("vllm_relay_requests_total") == 8, what="8 relay requests in /metrics"
    )
    assert server.relay_metric("vllm_relay_system_prompt_requests_total", name="bakery") == 8
    assert server.prompt("bakery")["requests_served"] == 8
    import time

    time.sleep(1.0)  # both processes have read the registrations (metrics_interval_s = 0.2)
    for _ in range(6):
        server.chat(PIRATE, "Ahoy?", max_tokens=2)
    wait_for(
        lambda: server.prompt("pirate")["chat_mismatches"] == 6, what="6 mismatches, tagged by either process"
    )
    wait_for(lambda: server.relay_metric("vllm_relay_chat_mismatches_total") == 6, what="the metric")
    time.sleep(1.0)
    assert server.relay_metric("vllm_relay_requests_total") == 8  # still: one exporter
