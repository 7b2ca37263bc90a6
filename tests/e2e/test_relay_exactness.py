"""RelayAttention end to end on the CPU: exact against vLLM's own backend on the full prompts.

One relay engine serves, in the same batches: requests behind two different registered system
prompts, ordinary requests, and a request whose prompt contains a system prompt's tokens but not
at its start; its user parts are long enough to be split by chunked prefill (small
max_num_batched_tokens) and its KV cache is small enough to force preemption by recompute.
A reference engine runs the same full prompts on vLLM's CPU backend. Greedy tokens must be
identical and the top-5 logprobs must agree within 1e-4 (fp32); seeded sampling with n > 1 and a
stop string must give the same completions, texts and finish reasons. Both relay paths are run:
"always" sends every decode token of a relay request through the shared (grouped) system level,
"never" reads each request's system pages in front of its own (the prefix path). With an FP8 KV
cache (`kv_cache_dtype="fp8"`, where vLLM's CPU backend has it: x86 with AVX-512 or AMX) the reference
engine runs with the same FP8 cache. More models carry attention features relay computes: Gemma 2's
logit soft-capping, Gemma 2 with a sliding window in every other layer, Granite's attention sinks, and
Granite with both (gpt-oss's attention). Its logprobs cannot agree to 1e-4: relay's split sums in
another order, so a key or value computed a last bit away from vLLM's can round to the next FP8 grid
point (an e4m3 step is 6-12%), and such a flip moves later logprobs. The bound there is 5% of what
FP8 itself moves them: the median over requests of the first token's largest top-5 logprob
difference between vLLM with the FP8 cache and vLLM with the model's dtype, both without the plugin
(measured on the tiny GQA model: FP8 itself 0.39, relay against vLLM 0.010, the bound 0.02);
greedy tokens and top-5 sets must still be identical.
"""

import json
import random
import statistics
from pathlib import Path

import pytest
import torch

from tests.e2e.engine_runner import assert_same_outputs, run_engine
from vllm_relay.testing.models import VL_ENGINE, VL_MODELS, get_model

pytestmark = pytest.mark.engine


def workload(vocab: int, seed: int):
    rng = random.Random(seed)

    def ids(n):
        return [rng.randrange(8, vocab) for _ in range(n)]

    sys_a, sys_b = [1] + ids(99), [1] + ids(36)  # 100 and 37 tokens (odd, not block-aligned)
    user_lens = [1, 3, 16, 40, 150, 230]
    prompts = [sys_a + ids(n) for n in user_lens]  # relay on prompt "a"
    prompts += [sys_b + ids(n) for n in user_lens[::-1]]  # relay on prompt "b"
    prompts += [[1] + ids(n) for n in (5, 120, 260)]  # ordinary
    prompts += [[1] + ids(4) + sys_a[1:] + ids(20)]  # contains a's tokens, not at the start
    prompts += [sys_a[:60] + ids(30)]  # shares only part of "a": ordinary
    return {"a": sys_a, "b": sys_b}, prompts, 2 * len(user_lens)


_references: dict = {}


def model_engine(name: str) -> tuple[str, dict, dict]:
    """A test model's folder, the engine arguments it needs, and the spec keys of its runs."""
    vl = name in VL_MODELS  # text-only engines; vLLM imports the model without torchvision (engine_runner)
    return get_model(name), (VL_ENGINE if vl else {}), ({"vl": True} if vl else {})


def reference_run(model, prompts, sampled, tmp_path, kv_cache_dtype="auto", name=None):
    """vLLM's own CPU backend on the full prompts; one run per model and cache dtype for all relay variants."""
    if (model, kv_cache_dtype) not in _references:
        _, extra, spec = model_engine(name) if name else (model, {}, {})
        engine = {"model": model, "max_model_len": 512, "kv_cache_dtype": kv_cache_dtype, **extra}
        _references[model, kv_cache_dtype], _ = run_engine(
            {"engine": engine, "prompts": prompts, "max_tokens": 16, "sampled_prompts": sampled, **spec},
            tmp_path, "reference")
    return _references[model, kv_cache_dtype]


def has_fp8_kv() -> bool:
    """vLLM's CPU backend stores an FP8 KV cache on x86 with AVX-512 or AMX only."""
    return torch.cpu._is_avx512_supported() or torch.cpu._is_amx_tile_supported()


@pytest.mark.parametrize("name, shared_path, kv_cache_dtype", [
    ("tiny-llama-mha", "always", "auto"), ("tiny-llama-gqa", "always", "auto"), ("tiny-llama-gqa", "never", "auto"),
    ("tiny-gemma2-softcap", "always", "auto"), ("tiny-granite-sinks", "always", "auto"),
    ("tiny-gemma2-window", "always", "auto"), ("tiny-gemma2-window", "never", "auto"),
    ("tiny-granite-window-sinks", "always", "auto"),
    ("tiny-qwen2.5-vl", "always", "auto"), ("tiny-qwen2.5-vl", "never", "auto"),
    pytest.param("tiny-llama-gqa", "always", "fp8", marks=pytest.mark.skipif(
        not has_fp8_kv(), reason="vLLM's CPU FP8 KV cache needs x86 with AVX-512 or AMX")),
])
def test_relay_is_exact_on_mixed_batches_with_chunking_and_preemption(name, shared_path, kv_cache_dtype,
                                                                      tmp_path):
    model, extra, vl = model_engine(name)
    systems, prompts, num_relay = workload(3072, seed=7)  # the tokenizer's words, not Qwen-VL's vision ids
    relay_engine = {
        "model": model, "attention_backend": "relay",
        "additional_config": {"relay": {"system_prompts": systems, "max_prompts": 2,
                                        "max_prompt_tokens": 256, "shared_path": shared_path}},
        "max_num_batched_tokens": 64, "max_num_seqs": 16, "max_model_len": 512,
        "num_gpu_blocks_override": 24,  # 768 tokens of paged KV for ~1700 tokens of requests
        "kv_cache_dtype": kv_cache_dtype, **extra,
    }
    # A relay request (n=2, seeded, stop string) and an ordinary one, both within one chunk: vLLM's CPU
    # runner cannot rewind a seeded request's generator after a partial prefill (any backend), and the
    # small KV cache evicts what the prefix cache held of the greedy batch's longer prompts.
    sampled = [prompts[1], prompts[12]]
    relay, _ = run_engine({"engine": relay_engine, "prompts": prompts, "max_tokens": 16,
                           "sampled_prompts": sampled, **vl}, tmp_path, "relay")
    reference = reference_run(model, prompts, sampled, tmp_path, kv_cache_dtype, name)

    tol = 1e-4
    if kv_cache_dtype != "auto":  # 5% of what FP8 itself moves the first token's logprobs (docstring)
        full = reference_run(model, prompts, sampled, tmp_path)["outputs"]
        tol = 0.05 * statistics.median(max(abs(a[k] - b[k]) for k in a.keys() & b.keys())
                                       for a, b in ((f["logprobs"][0], q["logprobs"][0])
                                                    for f, q in zip(full, reference["outputs"])))
    assert_same_outputs(relay["outputs"], reference["outputs"], tol=tol)
    assert [o["prompt_len"] for o in relay["outputs"]] == [len(p) for p in prompts]  # usage: full prompt
    stats = relay["relay_stats"]
    assert stats["relay_requests"] == num_relay + 2, stats  # + the n=2 samples of sampled[0]
    worker = relay["worker_stats"]  # the path asked for is the path taken
    if shared_path == "always":
        # Every relay row reads its system prompt as a level, its prompt chunks too: no prefix path, in a
        # model's sliding-window layers too (each row from its window on).
        assert worker["shared_tokens"] > 0 and worker["prefix_requests"] == 0, worker
    else:
        assert worker["shared_tokens"] == 0 and worker["prefix_requests"] > 0, worker
    # Whole blocks of 32 are shared (96 of a's 100 tokens, 32 of b's 37), at least once per request.
    assert stats["system_tokens_reused"] >= 6 * 96 + 6 * 32, stats
    assert relay["preemptions"] and relay["preemptions"] > 0, "the KV cache was meant to force preemption"
    # n > 1, seeded sampling and stop strings: the same completions, texts and finish reasons.
    assert relay["sampled"] == reference["sampled"]
    reasons = [c["finish_reason"] for out in reference["sampled"] for c in out]
    assert len(reasons) == 4 and "stop" in reasons, reasons  # the stop string did fire


def test_relay_serves_ngram_speculative_decoding_exactly(tmp_path):
    """n-gram speculative decoding (drafts from each request's token ids, no drafter model): its
    verification steps, several query tokens per request, read the levels as a prompt chunk does,
    and the draft tokens' KV that verification accepts stays. Greedy outputs and logprobs equal
    vLLM's with the same drafter, on the model whose continuations loop (drafts get accepted). A
    request on a registered prompt has its drafts looked up in [system prompt ; own tokens], as
    vLLM's in the whole prompt. The counts of drafts and accepted ones are not compared: the relay
    engine runs short of batch tokens and KV blocks (it preempts), so its steps, and the drafts
    each step makes, are not the reference's."""
    model = get_model("tiny-llama-loops")
    vocab = json.loads((Path(model) / "config.json").read_text())["vocab_size"]
    systems, prompts, num_relay = workload(vocab, seed=7)
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3, "prompt_lookup_min": 1}
    relay_engine = {
        "model": model, "attention_backend": "relay", "speculative_config": spec,
        "additional_config": {"relay": {"system_prompts": systems, "max_prompts": 2,
                                        "max_prompt_tokens": 256, "shared_path": "always"}},
        "max_num_batched_tokens": 64, "max_num_seqs": 16, "max_model_len": 512, "num_gpu_blocks_override": 24,
    }
    relay, _ = run_engine({"engine": relay_engine, "prompts": prompts, "max_tokens": 48}, tmp_path, "relay")
    reference, _ = run_engine({"engine": {"model": model, "max_model_len": 512, "speculative_config": spec},
                               "prompts": prompts, "max_tokens": 48}, tmp_path, "reference")
    assert_same_outputs(relay["outputs"], reference["outputs"])
    assert relay["relay_stats"]["relay_requests"] == num_relay, relay["relay_stats"]
    assert relay["worker_stats"]["shared_tokens"] > 0, relay["worker_stats"]
    # Drafts were made and most were accepted, under relay as without it.
    assert relay["draft_tokens"] > 200 and relay["accepted_tokens"] > relay["draft_tokens"] // 3, relay


def drafter_setup(method: str, tokens: int) -> tuple[str, dict, tuple]:
    """A drafter model's target, its `speculative_config` (`tokens` draft tokens a step) and `workload`'s
    registered prompts and requests over the target's vocabulary: an EAGLE-3 head over the tiny GQA
    Llama, or the MTP layer in the tiny MiMo's own checkpoint."""
    model = get_model("tiny-llama-gqa" if method == "eagle3" else "tiny-mimo-mtp")
    vocab = json.loads((Path(model) / "config.json").read_text())["vocab_size"]
    spec = {"method": method, "num_speculative_tokens": tokens}
    if method == "eagle3":
        spec["model"] = get_model("tiny-llama-gqa-eagle3")
    return model, spec, workload(vocab, seed=5)


@pytest.mark.parametrize("method,tokens", [("eagle3", 1), ("mtp", 1), ("eagle3", 3), ("mtp", 2)])
def test_relay_serves_drafter_models_exactly(tmp_path, method, tokens):
    """A drafter model: an EAGLE-3 head of one or three draft tokens a step, or MiMo's MTP layer (in the
    target's checkpoint) of one or two. Its layer runs on relay and reads the registered prompts' pages;
    the prompts' shared blocks end one token early, so the drafter's KV of their last token came from
    the prompt's next token, as in a request's own prefill; its passes after the first place their KV
    by each request's own positions and read the prompts' pages too. Every draft token proposed for
    every request, step by step, equals vLLM's with the same drafter, and so do the greedy outputs.
    (The drafter's weights are random, so its drafts are mostly rejected: the drafts themselves are
    what the test compares, as the outputs of speculative decoding are the target's whatever the
    drafts.)"""
    model, spec, (systems, prompts, num_relay) = drafter_setup(method, tokens)
    # No prompt chunked (vLLM's own drafts differ between a chunked and a whole prefill), the same for both.
    knobs = {"max_num_batched_tokens": 2048, "max_num_seqs": 16, "max_model_len": 512}
    relay_engine = {
        "model": model, "attention_backend": "relay", "speculative_config": spec,
        "additional_config": {"relay": {"system_prompts": systems, "max_prompts": 2,
                                        "max_prompt_tokens": 256, "shared_path": "always"}},
        **knobs,
    }
    relay, _ = run_engine({"engine": relay_engine, "prompts": prompts, "max_tokens": 24, "drafts": True},
                          tmp_path, "relay")
    reference, _ = run_engine({"engine": {"model": model, "speculative_config": spec, **knobs},
                               "prompts": prompts, "max_tokens": 24, "drafts": True}, tmp_path, "reference")
    assert_same_outputs(relay["outputs"], reference["outputs"])
    assert relay["relay_stats"]["relay_requests"] == num_relay, relay["relay_stats"]
    assert relay["worker_stats"]["shared_tokens"] > 0, relay["worker_stats"]
    assert all(len(d) >= 12 for d in reference["drafts"]), [len(d) for d in reference["drafts"]]
    differ = {i: [step for step, (x, y) in enumerate(zip(got, want)) if x != y]
              for i, (got, want) in enumerate(zip(relay["drafts"], reference["drafts"])) if got != want}
    assert not differ, f"prompt -> the steps whose draft differs from vLLM's: {differ}"
