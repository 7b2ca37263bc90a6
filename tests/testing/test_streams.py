"""The concurrent-stream checker against a real CPU server with relay: every request answered once.

A CPU OpenAI server with a registered chat system prompt serves 48 concurrent streams (3/4 of them
chats behind that system prompt, served by relay; 6 disconnect after their first chunk); the
checker (vllm_relay.testing.streams, the same one the GPU hosts run with 1024 streams) must find
every other stream answered exactly once, none lost or duplicated, and relay's counters (from the
server's log) grown by exactly the relay requests sent. A broken server must fail the checker.
"""

import json
import os
import socket
import subprocess
import sys
import time
import urllib.request

import pytest

from vllm_relay.testing import streams
from vllm_relay.testing.models import get_model
from vllm_relay.testing.tokenizer import SYSTEM_MESSAGE

pytestmark = pytest.mark.engine


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    log = tmp_path_factory.mktemp("server") / "server.log"
    port = free_port()
    relay = {"relay": {"system_prompts": {"support": {"chat_system": SYSTEM_MESSAGE}}, "max_prompt_tokens": 256,
                       "log_stats_interval_s": 1}}
    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", get_model("tiny-llama-gqa"),
           "--served-model-name", "tiny", "--attention-backend", "relay", "--dtype", "float32", "--enforce-eager",
           "--max-model-len", "512", "--block-size", "32", "--port", str(port),
           "--additional-config", json.dumps(relay)]
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT,
                                env={**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1"})
    try:
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline:
            assert proc.poll() is None, log.read_text()[-4000:]
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2)
                break
            except OSError:
                time.sleep(1)
        else:
            raise AssertionError("server did not become healthy")
        yield f"http://127.0.0.1:{port}", log
    finally:
        proc.send_signal(2)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def test_every_stream_answered_once_and_relay_counted(server, tmp_path, capsys):
    url, log = server
    out = tmp_path / "summary.json"
    # A generous wait for relay's counters in the log (the checker's default: 15 s); it ends once they match.
    code = streams.main(["--url", url, "--model", "tiny", "--system", SYSTEM_MESSAGE, "--streams", "48",
                         "--max-tokens", "8", "--drop", "6", "--server-log", str(log), "--log-wait-s", "120",
                         "--out", str(out)])
    summary = json.loads(out.read_text())
    assert code == 0, summary
    assert summary["answered"] == 42 and summary["lost"] == [] and summary["duplicated"] == []
    assert summary["relay_sent"] == 36 and summary["relay_counted"] == 36, summary


def test_the_checker_fails_when_answers_are_wrong(server, tmp_path):
    url, log = server
    # It must fail when relay counts fewer requests than it expects (a system message relay does not
    # know: answered fine, nothing counted), and when requests are refused (a model not served). The
    # count stays 0 however slow the machine: the short log wait only ends the checker's wait for it.
    code = streams.main(["--url", url, "--model", "tiny", "--system", "You are someone else.", "--streams", "8",
                         "--max-tokens", "4", "--server-log", str(log), "--log-wait-s", "3", "--out",
                         str(tmp_path / "s.json")])
    summary = json.loads((tmp_path / "s.json").read_text())
    assert code == 1 and summary["relay_counted"] == 0 and summary["num_problems"] == 0, summary
    code = streams.main(["--url", url, "--model", "not-served", "--system", SYSTEM_MESSAGE, "--streams", "4",
                         "--out", str(tmp_path / "t.json")])
    summary = json.loads((tmp_path / "t.json").read_text())
    assert code == 1 and summary["num_problems"] == 4 and summary["answered"] == 0, summary
