"""The relay backend inside a real vLLM engine on the CPU, against vLLM's own CPU backend.

Without system prompts relay computes plain causal attention: greedy tokens must be identical and
top-5 logprobs (fp32) must agree, on a batch of prompts of varied lengths.
"""

import json
import random
from pathlib import Path

import pytest

from tests.e2e.engine_runner import assert_same_outputs, run_engine
from vllm_relay.testing.models import get_model

pytestmark = pytest.mark.engine


@pytest.mark.parametrize("name", ["tiny-llama-mha", "tiny-llama-gqa"])
def test_relay_matches_vllm_cpu_backend(name, tmp_path):
    model = get_model(name)
    rng = random.Random(1234)
    vocab = json.loads((Path(model) / "config.json").read_text())["vocab_size"]
    lengths = [1, 5, 16, 17, 33, 100, 257, 600]  # block boundaries (16) and multi-block prompts
    prompts = [[rng.randrange(8, vocab) for _ in range(n)] for n in lengths]

    relay, relay_log = run_engine({"engine": {"model": model, "attention_backend": "relay"},
                                   "prompts": prompts}, tmp_path, "relay")
    default, default_log = run_engine({"engine": {"model": model}, "prompts": prompts}, tmp_path, "default")

    assert "vllm-relay: relay attention backend active, implementation: cpu (vLLM's CPU attention kernel" in relay_log
    assert "relay attention backend active" not in default_log  # only when asked for
    assert_same_outputs(relay["outputs"], default["outputs"])
