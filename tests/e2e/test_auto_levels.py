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
Two more cases: a request aborted mid-decode while the others over its document read it as a level
(tests/e2e/run_abort.py, stepped in-process), and the same prompt under two LoRA adapters, which
must never share a level.
"""

import json
import random
from pathlib import Path

import pytest

from tests.e2e.engine_runner import assert_same_outputs, run_engine, run_module
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
    "greedy": ("tiny-llama-mha", True, {"max_num_batched_tokens": 64, "num_gpu_blocks_override": 24}, 2),
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


def test_a_request_aborted_while_its_siblings_share_its_prefix(tmp_path):
    """Six requests over one 150-token document (levels: its pages read once for all); one is
    aborted mid-decode. It leaves the engine (no answer), and the others, still reading the document as a
    level in the steps after, answer as vLLM's own backend does."""
    model = get_model("tiny-llama-gqa")
    vocab = json.loads((Path(model) / "config.json").read_text())["vocab_size"]
    rng = random.Random(9)
    doc = [1] + [rng.randrange(8, vocab) for _ in range(149)]
    prompts = [doc + [rng.randrange(8, vocab) for _ in range(n)] for n in (3, 9, 17, 4, 25, 11)]
    base = {"model": model, "dtype": "float32", "enforce_eager": True, "seed": 0, "block_size": 32,
            "max_model_len": 512, "max_num_batched_tokens": 1024}
    spec = {"prompts": prompts, "max_tokens": 14, "abort": 2, "steps_before_abort": 5}
    relay = run_module("tests.e2e.run_abort", {**spec, "engine": {
        **base, "attention_backend": "relay", "additional_config": {"relay": {"shared_path": "always"}}}},
        tmp_path, "relay")
    reference = run_module("tests.e2e.run_abort", {**spec, "engine": base}, tmp_path, "reference")
    kept = [str(i) for i in range(len(prompts)) if i != 2]
    assert sorted(relay["answers"]) == sorted(reference["answers"]) == kept
    assert (relay["unfinished_at_abort"], relay["unfinished_after_abort"]) == (6, 5)
    assert_same_outputs([relay["answers"][i] for i in kept], [reference["answers"][i] for i in kept])
    before, after = relay["stats_at_abort"]["tokens_under_1_levels"], relay["stats"]["tokens_under_1_levels"]
    assert 0 < before < after, (before, after)  # levels before the abort and after it


def tiny_lora(model: str, path: Path, seed: int) -> str:
    """A rank-4 LoRA adapter (PEFT layout) on q_proj and v_proj of the tiny model, random weights."""
    import torch
    from safetensors.torch import save_file

    config = json.loads((Path(model) / "config.json").read_text())
    hidden, layers = config["hidden_size"], config["num_hidden_layers"]
    head = hidden // config["num_attention_heads"]
    outs = {"q_proj": config["num_attention_heads"] * head, "v_proj": config["num_key_value_heads"] * head}
    gen = torch.Generator().manual_seed(seed)
    weights = {}
    for i in range(layers):
        for proj, out in outs.items():
            key = f"base_model.model.model.layers.{i}.self_attn.{proj}"
            weights[f"{key}.lora_A.weight"] = torch.randn(4, hidden, generator=gen) * 0.2
            weights[f"{key}.lora_B.weight"] = torch.randn(out, 4, generator=gen) * 0.2
    path.mkdir(parents=True)
    save_file(weights, str(path / "adapter_model.safetensors"))
    (path / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "r": 4, "lora_alpha": 8, "target_modules": list(outs), "bias": "none",
        "base_model_name_or_path": model, "task_type": "CAUSAL_LM", "lora_dropout": 0.0}))
    return str(path)


def test_requests_under_different_lora_adapters_never_share_a_level(tmp_path):
    """The same prompt four times under adapter A and four times under adapter B: vLLM's prefix
    cache keeps the two apart (the adapter is part of a block's hash), so a level holds 4 rows at
    most, never 8; every answer equals vLLM's own backend's with the same adapter."""
    model = get_model("tiny-llama-gqa")
    vocab = json.loads((Path(model) / "config.json").read_text())["vocab_size"]
    rng = random.Random(12)
    prompt = [1] + [rng.randrange(8, vocab) for _ in range(100)]
    a, b = tiny_lora(model, tmp_path / "a", 1), tiny_lora(model, tmp_path / "b", 2)
    first = [{"ids": prompt, "lora": ["a", 1, a]}] * 4 + [{"ids": prompt, "lora": ["b", 2, b]}] * 4
    engine = {"model": model, "max_num_seqs": 16, "max_model_len": 512, "enable_lora": True, "max_loras": 2,
              "max_lora_rank": 8}
    run = {"prompts": [prompt], "max_tokens": 4, "first": {"prompts": first, "max_tokens": 8}}
    relay, _ = run_engine({"engine": {**engine, "attention_backend": "relay",
                                      "additional_config": {"relay": {"shared_path": "always"}}}, **run},
                          tmp_path, "relay")
    reference, _ = run_engine({"engine": engine, **run}, tmp_path, "reference")

    assert_same_outputs(relay["first"]["outputs"], reference["first"]["outputs"])
    outputs = relay["first"]["outputs"]
    assert outputs[0]["tokens"] != outputs[4]["tokens"]  # the adapters answer differently
    stats = relay["first"]["worker_stats"]
    assert 2 <= stats["max_level_rows"] <= 4, stats  # each adapter's four requests, never all eight
