"""Sharing nobody registered, end to end on the CPU: exact against vLLM's own backend.

vLLM's prefix cache stores a shared prefix once (the same blocks in many block tables); relay finds
those runs each step and reads each once for all the requests under it, at any depth. Each case is
run by a relay engine and by a reference engine (vLLM's CPU backend, the same full prompts):

* "greedy" (MHA model, the preamble registered as a system prompt, so the root level is its slot's
  pages): requests over two documents behind the preamble, with questions; the same prompt sent
  several times at once; plain requests sharing nothing; chunked prefill (a 64-token budget) and
  a KV cache small enough to preempt requests; first, one prompt under two cache salts, which must
  never share a level.
* "samples" (GQA model, nothing registered): seeded samples (n > 1) of questions over the
  documents: preamble -> document -> question -> the samples, which diverge inside a block at their
  first sampled token. (Without chunked prefill: vLLM's CPU build cannot rewind a seeded request's
  generator after a partial prefill, "CPU Generator does not use offset", with any backend.)

Greedy tokens must be identical and top-5 logprobs within 1e-4 (fp32); seeded samples must be the
same samples with the same logprobs; and tokens must have read levels of every depth the workload has.
"""

import json
import random
from pathlib import Path

import pytest

from tests.e2e.engine_runner import assert_same_outputs, run_engine
from vllm_relay.testing.models import get_model

pytestmark = pytest.mark.engine


def workload(vocab: int, seed: int) -> dict:
    rng = random.Random(seed)

    def ids(n):
        return [rng.randrange(8, vocab) for _ in range(n)]

    preamble = [1] + ids(99)
    doc1, doc2 = ids(150), ids(70)
    questions = [ids(n) for n in (5, 17, 33, 40, 8, 23)]
    prompts = [preamble + doc1 + q for q in questions]  # one document, six questions
    prompts += [preamble + doc2 + q for q in questions[:4]]  # another document
    prompts += [preamble + doc1 + questions[0]] * 3  # the same prompt, three times at once
    prompts += [preamble + q for q in questions[4:]]  # the preamble alone: one level
    prompts += [[1] + ids(n) for n in (5, 120, 260)]  # sharing nothing (beyond one token)
    samples = [{"prompt": preamble + doc1 + ids(40), "n": 4, "seed": 5, "max_tokens": 10},
               {"prompt": preamble + doc1 + ids(37), "n": 3, "seed": 6, "max_tokens": 10},
               {"prompt": preamble + doc2 + ids(21), "n": 3, "seed": 7, "max_tokens": 10}]
    once = [1] + ids(100)
    salted = [{"ids": once, "cache_salt": salt} for salt in ("a", "b") for _ in range(4)]
    return {"preamble": preamble, "prompts": prompts, "samples": samples,
            "first": {"prompts": salted, "max_tokens": 6}}


CASES = {
    "greedy": ("tiny-llama-mha", True, {"max_num_batched_tokens": 64, "num_gpu_blocks_override": 48}, 2),
    "samples": ("tiny-llama-gqa", False, {"max_num_batched_tokens": 512, "enable_chunked_prefill": False}, 3),
}


@pytest.mark.parametrize("case", CASES)
def test_shared_prefixes_are_read_once_and_exact(case, tmp_path):
    name, register, engine, depth = CASES[case]
    model = get_model(name)
    vocab = json.loads((Path(model) / "config.json").read_text())["vocab_size"]
    spec = workload(vocab, seed=3)
    relay_cfg = {"shared_path": "always", "max_prompt_tokens": 256}
    if register:
        relay_cfg["system_prompts"] = {"preamble": spec["preamble"]}
    engine = {"model": model, "max_num_seqs": 32, "max_model_len": 512, **engine}
    run = {"prompts": spec["prompts"], "max_tokens": 12}
    if case == "greedy":
        run["first"] = spec["first"]
    else:
        run["samples"] = spec["samples"]
    relay, _ = run_engine({"engine": {**engine, "attention_backend": "relay",
                                      "additional_config": {"relay": relay_cfg}}, **run}, tmp_path, "relay")
    reference, _ = run_engine({"engine": engine, **run}, tmp_path, "reference")

    assert_same_outputs(relay["outputs"], reference["outputs"])
    stats = relay["worker_stats"]
    for k in range(1, depth + 1):
        assert stats[f"tokens_under_{k}_levels"] > 0, stats
    assert stats["saved_kv_tokens"] > 0 and stats["saved_kv_bytes"] > stats["saved_kv_tokens"], stats
    levels = relay["relay_stats"]  # what relay_stats and /metrics report from the workers
    assert levels["level_tokens"] == sum(stats[f"tokens_under_{k}_levels"] for k in range(1, 5)) > 0
    assert levels["kv_bytes_saved"] == stats["saved_kv_bytes"], levels
    if case == "greedy":
        assert_same_outputs(relay["first"]["outputs"], reference["first"]["outputs"])
        first = relay["first"]["worker_stats"]  # two salts over one prompt: 4 requests a level, never 8
        assert 2 <= first["max_level_rows"] <= 4, first
        assert relay["preemptions"] and relay["preemptions"] > 0, "the KV cache was meant to force preemption"
        assert relay["relay_stats"]["relay_requests"] >= 15, relay["relay_stats"]
    else:
        for got, want in zip(relay["samples"], reference["samples"], strict=True):
            assert_same_outputs(got, want)  # the same samples, logprobs within 1e-4
