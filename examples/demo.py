"""`make demo`: serve a tiny locally built model with relay attention on the CPU and chat with it.

Builds (once, then cached) a tiny random Llama and its tokenizer, starts vLLM's OpenAI server with
`--attention-backend relay` and the relay endpoint plugin (`VLLM_PLUGINS=relay`) on a free loopback
port, registers a chat system prompt over HTTP (`POST /v1/relay/system_prompts`), sends one chat
request with that system message through the official `openai` client, prints the reply and the
`/metrics` line that counts it, and stops the server and every process it started. Any failure
prints the server log's tail and exits 1. The model's weights are random: the reply is fluent
nonsense, and that is expected.
"""

import json
import shlex
import signal
import sys
import time
import urllib.request

MODEL = "tiny-llama-gqa"
SYSTEM = ("You are a terse assistant for a shipping company. Answer in one sentence, and say where the customer "
          "can track a parcel when they ask about one.")
RELAY_CONFIG = {"max_prompts": 1, "max_prompt_tokens": 512, "log_stats_interval_s": 0.5,
                "metrics_interval_s": 0.2}
METRIC = "vllm_relay_requests_total"


def post(url: str, body: dict) -> tuple[int, dict]:
    request = urllib.request.Request(url, data=json.dumps(body).encode(), method="POST",
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=600) as r:
        return r.status, json.loads(r.read())


def metric_line(url: str, name: str, want: float, timeout_s: float = 30.0) -> str:
    """The /metrics line of `name` once it reads `want` (the server refreshes it every 0.2 s)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        with urllib.request.urlopen(url + "/metrics", timeout=30) as r:
            lines = [line for line in r.read().decode().splitlines() if line.startswith(name + "{")]
        if lines and float(lines[0].rsplit(" ", 1)[1]) == want:
            return lines[0]
        time.sleep(0.2)
    raise RuntimeError(f"/metrics never showed {name} = {want}")


def engine_summary(server, timeout_s: float = 30.0) -> str:
    """The engine core's relay summary line once it counts our request (logged when it changes)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        lines = [line.rstrip() for line in server.log_text().splitlines() if "relay requests 1," in line]
        if lines:
            return lines[-1]
        time.sleep(0.5)
    raise RuntimeError("the engine never reported the chat request as served by relay")


def main() -> int:
    from vllm_relay.testing.models import get_model
    from vllm_relay.testing.server import RelayServer

    t0 = time.monotonic()
    server = RelayServer(get_model(MODEL), MODEL, relay=RELAY_CONFIG,
                         # Blocks of 32 (vLLM's CPU kernel needs a multiple of 32; its default is 128).
                         args=["--max-model-len", "2048", "--enable-prompt-tokens-details",
                               "--block-size", "32"])
    print(f"[demo] starting: VLLM_PLUGINS=relay {shlex.join(['python', *server.cmd[1:]])}\n"
          f"[demo] server log: {server.log_path}", flush=True)
    previous = signal.signal(signal.SIGTERM, lambda *_: (server.stop(), sys.exit(143)))
    try:
        server.start()
        print(f"[demo] server healthy after {time.monotonic() - t0:.0f} s", flush=True)
        log = server.log_text()
        if "relay attention backend active" not in log:
            raise RuntimeError("the server log does not show the relay attention backend active")
        for line in log.splitlines():
            if "relay attention backend active" in line or "Loaded endpoint plugin relay" in line:
                print(f"[server] {line.rstrip()}")

        body = {"name": "shipping", "messages": [{"role": "system", "content": SYSTEM}]}
        print(f"[demo] POST /v1/relay/system_prompts {json.dumps(body)}")
        status, prompt = post(server.url + "/v1/relay/system_prompts", body)
        print(f"[demo] -> {status} {json.dumps(prompt)}")

        from openai import OpenAI

        client = OpenAI(base_url=f"{server.url}/v1", api_key="unused")
        reply = client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "system", "content": SYSTEM},
                      {"role": "user", "content": "Where is my parcel?"}],
            max_tokens=24, temperature=0.0,
        )
        print("[demo] reply (random weights, so nonsense is expected):")
        print(f"  {reply.choices[0].message.content!r}")
        details = reply.usage.prompt_tokens_details
        print(f"[demo] usage: {reply.usage.prompt_tokens} prompt + {reply.usage.completion_tokens} "
              f"completion tokens ({details.cached_tokens if details else 0} prompt tokens not recomputed)")
        print(f"[metrics] {metric_line(server.url, METRIC, 1.0)}")
        print(f"[server] {engine_summary(server)}")
        return 0
    except Exception as e:  # noqa: BLE001 - report anything, with the server's side of the story
        print(f"[demo] FAILED: {e}\n--- server log tail ---\n{server.log_text()[-4000:]}", file=sys.stderr)
        return 1
    finally:
        server.stop()
        signal.signal(signal.SIGTERM, previous)
        print("[demo] server stopped", flush=True)


if __name__ == "__main__":
    sys.exit(main())
