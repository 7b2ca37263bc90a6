"""`make demo`'s server path: OpenAI server with relay on the CPU, one chat, clean shutdown."""

import re
import subprocess
import sys
from pathlib import Path

import pytest

DEMO = Path(__file__).resolve().parents[2] / "examples" / "demo.py"
pytestmark = pytest.mark.engine


def test_demo_serves_a_chat_with_relay_and_leaves_no_process():
    proc = subprocess.run([sys.executable, str(DEMO)], capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    out = proc.stdout
    assert "vllm-relay: relay attention backend active, implementation: cpu (vLLM's CPU attention kernel" in out
    registered = re.search(r"\[demo\] -> 201 (\{.*\})", out)
    assert registered, out
    assert '"name": "shipping"' in registered.group(1) and '"state": "ready"' in registered.group(1), out
    assert re.search(r"\[demo\] reply .*\n  '.+'", out), out
    assert '[metrics] vllm_relay_requests_total{engine="0",model_name="tiny-llama-gqa"} 1.0' in out, out
    usage = re.search(r"usage: (\d+) prompt \+ (\d+) completion tokens \((\d+) prompt tokens not", out)
    assert usage and int(usage.group(2)) == 24, out
    served = re.search(r"relay requests 1, relay tokens \d+, system tokens reused (\d+)", out)
    assert served, "the chat request was not served by relay"
    system_len = int(served.group(1))
    # usage counts the full prompt (system + own tokens); the system part was not recomputed
    assert int(usage.group(1)) > system_len > 10 and int(usage.group(3)) >= system_len, out
    port = re.search(r"--port (\d+)", out).group(1)
    ps = subprocess.run(["ps", "-eo", "pid,args"], capture_output=True, text=True).stdout
    leftovers = [line for line in ps.splitlines() if f"--port {port}" in line]
    assert not leftovers, leftovers
