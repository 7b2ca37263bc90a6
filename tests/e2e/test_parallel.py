"""Relay under tensor and data parallelism on the CPU (gloo), exact against vLLM's own backend.

Tensor parallelism: every rank holds its own KV heads of the system-prompt store (the tiny GQA model
has 2 KV heads: one per rank at TP=2, each replicated on two ranks at TP=4) and captures them during
fills; the engine core routes and tags once for all ranks. Data parallelism: vLLM runs a dense
model's DP ranks as independent engine cores, each with its own RelayEngine, start-up fills and
counters; an AsyncLLM balances requests over them. The same mixed workload as the exactness test
(two system prompts, ordinary requests, chunked prefill) must give identical greedy tokens and top-5
logprobs within 1e-4 of vLLM's CPU backend at the same tensor parallelism, and relay must have
served every relay request (under DP: summed over the engines, each of which served some).
"""

import json
from pathlib import Path

import pytest

from tests.e2e.engine_runner import assert_same_outputs, run_engine
from tests.e2e.test_relay_exactness import workload
from vllm_relay.testing.models import get_model

pytestmark = pytest.mark.engine


@pytest.mark.parametrize("parallel", [{"tensor_parallel_size": 2}, {"tensor_parallel_size": 4},
                                      {"data_parallel_size": 2}], ids=["tp2", "tp4", "dp2"])
def test_relay_is_exact_under_parallelism_on_cpu(parallel, tmp_path, monkeypatch):
    # Several CPU workers on one NUMA node: vLLM needs their OpenMP threads bound by hand (two
    # cores in CI: TP=4 shares them).
    workers = max(parallel.values())
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "|".join(str(i % 2) for i in range(workers)))
    model = get_model("tiny-llama-gqa")
    vocab = json.loads((Path(model) / "config.json").read_text())["vocab_size"]
    systems, prompts, num_relay = workload(vocab, seed=11)
    base = {"model": model, "max_model_len": 512, "max_num_batched_tokens": 64, "distributed_executor_backend": "mp"}
    relay_config = {"relay": {"system_prompts": systems, "max_prompts": 2, "max_prompt_tokens": 256}}
    relay, log = run_engine({"prompts": prompts, "max_tokens": 12, "engine": {
        **base, **parallel, "attention_backend": "relay", "additional_config": relay_config}}, tmp_path, "relay")
    reference_parallel = {k: v for k, v in parallel.items() if k == "tensor_parallel_size"}  # DP: math per engine
    reference, _ = run_engine({"prompts": prompts, "max_tokens": 12, "engine": {**base, **reference_parallel}},
                              tmp_path, "reference")

    assert_same_outputs(relay["outputs"], reference["outputs"])
    stats = relay["relay_stats"]
    assert stats["relay_requests"] == num_relay and stats["fills_completed"] == 2 * parallel.get(
        "data_parallel_size", 1), stats
    if "data_parallel_size" in parallel:
        served = [e["relay_requests"] > 0 and e["fills_completed"] == 2 for e in stats["engines"]]
        assert served == [True, True], stats
        # The planners' stats add up both engines' workers, not the first engine's alone.
        summed, first = relay["worker_stats"], relay["first_worker_stats"]
        assert summed["planned_steps"] > first["planned_steps"] > 0, (summed, first)
