"""`make demo`: serve a tiny locally built model with relay attention on the CPU and chat with it.

Builds (once, then cached) a tiny random Llama and its tokenizer, starts vLLM's OpenAI server with
`--attention-backend relay` on a free loopback port, waits for it to be healthy, sends one chat
request with a system message through the official `openai` client, prints the reply, and stops
the server and every process it started. Any failure prints the server log's tail and exits 1.
The model's weights are random: the reply is fluent nonsense, and that is expected.
"""

import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request

STARTUP_TIMEOUT_S = 600
MODEL = "tiny-llama-gqa"
SYSTEM = "You are a terse assistant for a shipping company. Answer in one sentence."
# The system message is registered at start-up as the chat template renders it, so the chat
# request below, which starts with it, is served by relay attention.
RELAY_CONFIG = {"relay": {"system_prompts": {"shipping": {"chat_system": SYSTEM}},
                          "max_prompts": 1, "max_prompt_tokens": 512,
                          "log_stats_interval_s": 0.5}}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_healthy(proc: subprocess.Popen, url: str, deadline: float) -> None:
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited with code {proc.returncode} before it was healthy")
        try:
            with urllib.request.urlopen(url, timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(1)
    raise RuntimeError(f"the server was not healthy within {STARTUP_TIMEOUT_S} s")


def stop(proc: subprocess.Popen) -> None:
    """Stop the server's whole process group (API server, engine core, workers)."""
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    try:  # children that outlived the leader
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def wait_for_relay_summary(log, timeout_s: float = 30.0) -> str:
    """The engine core's relay summary line once it counts our request (logged when it changes)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        log.seek(0)
        lines = [line.rstrip() for line in log if "relay requests 1," in line]
        if lines:
            return lines[-1]
        time.sleep(0.5)
    raise RuntimeError("the engine never reported the chat request as served by relay")


def main() -> int:
    from vllm_relay.testing.models import get_model

    t0 = time.monotonic()
    model = get_model(MODEL)
    port = free_port()
    log = tempfile.NamedTemporaryFile("w+", prefix="vllm-relay-demo-", suffix=".log", delete=False)
    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model,
           "--served-model-name", MODEL, "--attention-backend", "relay",
           "--host", "127.0.0.1", "--port", str(port), "--dtype", "float32",
           "--max-model-len", "2048", "--enforce-eager", "--enable-prompt-tokens-details",
           "--additional-config", json.dumps(RELAY_CONFIG)]
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1")}
    print(f"[demo] starting: {' '.join(cmd[2:])}\n[demo] server log: {log.name}", flush=True)
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    previous = signal.signal(signal.SIGTERM, lambda *_: (stop(proc), sys.exit(143)))
    try:
        wait_healthy(proc, f"http://127.0.0.1:{port}/health", time.monotonic() + STARTUP_TIMEOUT_S)
        print(f"[demo] server healthy after {time.monotonic() - t0:.0f} s", flush=True)
        log.seek(0)
        relay_lines = [line.rstrip() for line in log
                       if "relay attention backend active" in line or "system prompts ready" in line]
        if not any("relay attention backend active" in line for line in relay_lines):
            raise RuntimeError("the server log does not show the relay attention backend active")
        for line in relay_lines:
            print(f"[server] {line}")

        from openai import OpenAI

        client = OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused")
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
        print(f"[server] {wait_for_relay_summary(log)}")
        return 0
    except Exception as e:  # noqa: BLE001 - report anything, with the server's side of the story
        log.seek(0)
        tail = log.read()[-4000:]
        print(f"[demo] FAILED: {e}\n--- server log tail ---\n{tail}", file=sys.stderr)
        return 1
    finally:
        stop(proc)
        signal.signal(signal.SIGTERM, previous)
        print("[demo] server stopped", flush=True)


if __name__ == "__main__":
    sys.exit(main())
