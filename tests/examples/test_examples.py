"""The examples run as documented: offline on the tiny model, and against the session's relay server."""

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
pytestmark = pytest.mark.engine


@pytest.fixture
def server(relay_server):
    yield relay_server
    relay_server.delete_all_but()


def run(*cmd, env=None, timeout=900):
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-4000:]
    return proc.stdout


def test_offline_batch():
    out = run(sys.executable, str(EXAMPLES / "offline_batch.py"))
    assert re.search(r"registered 'returns' at run time: \d+ tokens, slot 2", out), out
    assert len(re.findall(r"^\[.+\?\] -> '.+' \(\d+ prompt tokens\)$", out, re.M)) == 5, out
    assert "relay requests 5 of 5" in out, out


def test_openai_chat(server):
    args = ["--base-url", server.url + "/v1", "--api-key", server.api_key, "--name", "example-support"]
    out = run(sys.executable, str(EXAMPLES / "openai_chat.py"), *args)
    assert re.search(r"registered 'example-support': \d+ tokens in slot \d", out), out
    assert (
        re.search(r"^reply: .+$", out, re.M) and "'example-support': 1 request(s) served by relay" in out
    ), out
    usage = re.search(r"usage: (\d+) prompt tokens \((\d+) not recomputed\), 48 completion", out)
    assert usage and int(usage.group(1)) > int(usage.group(2)) > 10, out
    again = run(sys.executable, str(EXAMPLES / "openai_chat.py"), *args)  # a second run: 409, still served
    assert "already registered: system prompt 'example-support' already exists" in again, again
    assert "'example-support': 2 request(s) served by relay" in again, again


@pytest.mark.skipif(shutil.which("curl") is None, reason="examples/manage_prompts.sh needs curl")
def test_manage_prompts(server):
    import os

    env = {**os.environ, "BASE_URL": server.url, "API_KEY": server.api_key}
    out = run("bash", str(EXAMPLES / "manage_prompts.sh"), env=env)
    statuses = re.findall(r"^< HTTP (\d+)$", out, re.M)
    assert statuses == ["200", "201", "202", "200", "409", "200", "200", "200", "404"], out
    assert '"name":"support","state":"ready"' in out and '"deleted":true' in out, out
