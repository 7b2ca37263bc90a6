"""The relay backend inside a real vLLM engine on the CPU, against vLLM's own CPU backend.

Until system prompts are routed to it, relay computes plain causal attention: greedy tokens must be
identical and top-5 logprobs (fp32) must agree, on a batch of prompts of varied lengths.
"""

import json
import random
import subprocess
import sys
from pathlib import Path

import pytest

from vllm_relay.testing.models import get_model

RUNNER = Path(__file__).with_name("run_offline.py")
pytestmark = pytest.mark.engine


def run_engine(model: str, backend: str, prompts, tmp_path: Path):
    prompts_file, out_file = tmp_path / "prompts.json", tmp_path / f"{backend}.json"
    prompts_file.write_text(json.dumps(prompts))
    proc = subprocess.run([sys.executable, str(RUNNER), model, backend, str(prompts_file), str(out_file)],
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(out_file.read_text()), proc.stderr + proc.stdout


@pytest.mark.parametrize("name", ["tiny-llama-mha", "tiny-llama-gqa"])
def test_relay_matches_vllm_cpu_backend(name, tmp_path):
    model = get_model(name)
    rng = random.Random(1234)
    vocab = json.loads((Path(model) / "config.json").read_text())["vocab_size"]
    lengths = [1, 5, 16, 17, 33, 100, 257, 600]  # block boundaries (16) and multi-block prompts
    prompts = [[rng.randrange(3, vocab) for _ in range(n)] for n in lengths]

    relay, relay_log = run_engine(model, "relay", prompts, tmp_path)
    default, default_log = run_engine(model, "default", prompts, tmp_path)

    assert "vllm-relay: relay attention backend active, implementation: cpu-torch" in relay_log
    assert "relay attention backend active" not in default_log  # only when asked for
    worst = 0.0
    for r, d in zip(relay, default, strict=True):
        assert r["tokens"] == d["tokens"]
        for rs, ds in zip(r["logprobs"], d["logprobs"], strict=True):
            assert rs.keys() == ds.keys()
            worst = max(worst, max(abs(rs[k] - ds[k]) for k in rs))
    assert worst < 1e-4, worst
