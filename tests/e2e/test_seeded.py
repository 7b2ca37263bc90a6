"""Seeded samples under relay are vLLM's, however the requests reach the engine core.

A loaded machine delivers requests to a busy engine core a few at a time, between its steps. The
engine is stepped in-process (tests/e2e/run_seeded.py), requests added in waves between steps, so
each arrival pattern is reproduced exactly: all at once, and one request per step. Seeded samples
(n = 8 and n = 2 at temperature 0.8, over a registered system prompt) and greedy requests beside
them must be the same tokens with the same logprobs as vLLM's own backend with the plugin not
loaded (`VLLM_PLUGINS=""`), under relay's default rule and with `shared_path: always`; and so must an
engine with the plugin loaded and vLLM's backend selected. (vLLM's CPU platform turns async
scheduling off, so these engines step synchronously.)

Prompts stay within one step's token budget: vLLM's CPU runner cannot rewind a seeded request's
generator after a partial prefill ("CPU Generator does not use offset"), with any backend.
"""

import json
import random
from pathlib import Path

import pytest

from tests.e2e.engine_runner import assert_same_outputs, run_module
from vllm_relay.testing.models import get_model

pytestmark = pytest.mark.engine


def requests(vocab: int) -> tuple[list[int], list[dict]]:
    rng = random.Random(3)

    def ids(n):
        return [rng.randrange(8, vocab) for _ in range(n)]

    system = [1] + ids(99)
    out = []
    for i in range(4):
        out.append({"id": f"s{i}", "ids": system + ids(7 + 5 * i), "n": 8 if i % 2 == 0 else 2, "seed": 100 + i,
                    "temperature": 0.8, "max_tokens": 10})
        out.append({"id": f"g{i}", "ids": system + ids(11 + 3 * i), "temperature": 0.0, "max_tokens": 10})
    return system, out


def test_seeded_samples_equal_vllms_whatever_the_arrivals(tmp_path):
    model = get_model("tiny-llama-mha")
    system, reqs = requests(json.loads((Path(model) / "config.json").read_text())["vocab_size"])
    base = {"model": model, "dtype": "float32", "enforce_eager": True, "seed": 0, "block_size": 32,
            "max_model_len": 512}
    at_once, one_per_step = [{"steps": 0, "requests": reqs}], [{"steps": 1, "requests": [r]} for r in reqs]
    reference = run_module("tests.e2e.run_seeded", {"engine": base, "waves": at_once}, tmp_path, "reference")
    assert sorted(reference) == sorted(r["id"] for r in reqs)
    assert [len(reference[r["id"]]) for r in reqs] == [r.get("n", 1) for r in reqs]
    # The samples are random draws: the 8 of one request are not all the same.
    assert len({tuple(s["tokens"]) for s in reference["s0"]}) > 1
    # The plugin loaded but not selected: vLLM's engine, untouched.
    cases = [(None, one_per_step), ("auto", at_once), ("auto", one_per_step), ("always", one_per_step)]
    for i, (rule, waves) in enumerate(cases):
        engine = dict(base)
        if rule is not None:
            engine |= {"attention_backend": "relay",
                       "additional_config": {"relay": {"system_prompts": {"sys": system}, "shared_path": rule}}}
        got = run_module("tests.e2e.run_seeded", {"engine": engine, "waves": waves, "plugin": True}, tmp_path, f"e{i}")
        for r in reqs:
            assert_same_outputs(got[r["id"]], reference[r["id"]])


def cached_prompt_requests(vocab: int) -> tuple[list[int], list[dict]]:
    """Prompts of 64 and 96 tokens (blocks of 32), one with a registered system prompt before its own
    64 tokens, and one of 70 tokens (its last block partly filled), each sampled once, then again as 3
    samples and a greedy request, which find the first one's tokens computed in an earlier step; last, 3
    samples of new prompts of 64 and of 70 tokens, two of which find them computed by the same step
    (and wait for it)."""
    rng = random.Random(11)

    def ids(n):
        return [rng.randrange(8, vocab) for _ in range(n)]

    system = [1] + ids(95)  # whole blocks: a request routed to it carries only its own 64 tokens
    prompts = {"a": ids(64), "b": ids(96), "c": ids(70), "s": system + ids(64)}
    first = [{"id": f"{k}0", "ids": p, "seed": 7, "temperature": 0.8, "max_tokens": 6}
             for k, p in prompts.items()]
    again = [{"id": f"{k}1", "ids": p, "n": 3, "seed": 8, "temperature": 0.8, "max_tokens": 6}
             for k, p in prompts.items()]
    again += [{"id": f"{k}2", "ids": p, "temperature": 0.0, "max_tokens": 6} for k, p in prompts.items()]
    fresh = [{"id": "d", "ids": ids(64), "n": 3, "seed": 9, "temperature": 0.8, "max_tokens": 6},
             {"id": "e", "ids": ids(70), "n": 3, "seed": 10, "temperature": 0.8, "max_tokens": 6}]
    return system, [{"steps": 2, "requests": first}, {"steps": 1, "requests": again},
                    {"steps": 0, "requests": fresh}]


# a, b, c and s (its own 64 tokens): 3 samples and a greedy request each; two of d's and of e's samples,
# which wait a step while their first sibling computes the prompt
WHOLE_PROMPT_HITS = 4 * 4 + 2 * 2


def test_samples_of_a_cached_prompt_equal_vllms(tmp_path):
    """The samples of a prompt already computed compute its last token only, into a copy of its last
    block, cached or a sibling's (`engine/cache_hits.py`), where vLLM computes that block's tokens again:
    the same samples and logprobs as vLLM without the plugin (`cached_prompt_requests`). Copying a block
    before the forward that writes it would change them."""
    model = get_model("tiny-llama-mha")
    vocab = json.loads((Path(model) / "config.json").read_text())["vocab_size"]
    system, waves = cached_prompt_requests(vocab)
    base = {"model": model, "dtype": "float32", "enforce_eager": True, "seed": 0, "block_size": 32,
            "max_model_len": 512}
    reference = run_module("tests.e2e.run_seeded", {"engine": base, "waves": waves}, tmp_path, "reference")
    relay = {**base, "attention_backend": "relay",
             "additional_config": {"relay": {"system_prompts": {"sys": system}}}}
    got = run_module("tests.e2e.run_seeded", {"engine": relay, "waves": waves, "plugin": True, "stats": True},
                     tmp_path, "relay")
    for r in (r for wave in waves for r in wave["requests"]):
        assert_same_outputs(got[r["id"]], reference[r["id"]])
    assert got["relay_stats"]["whole_prompt_hits"] == WHOLE_PROMPT_HITS, got["relay_stats"]


@pytest.mark.gpu
def test_samples_of_a_cached_prompt_on_cuda_follow_vllms(tmp_path):
    """`cached_prompt_requests` on a GPU (Model Runner V2, graphs), against FLASH_ATTN: the block copies
    run there too, and the samples follow vLLM's as in `test_seeded_samples_on_cuda_follow_vllms`."""
    model = get_model("tiny-llama-mha")
    vocab = json.loads((Path(model) / "config.json").read_text())["vocab_size"]
    system, waves = cached_prompt_requests(vocab)
    base = {"model": model, "dtype": "bfloat16", "enforce_eager": False, "seed": 0, "block_size": 32,
            "max_model_len": 512}
    reference = run_module("tests.e2e.run_seeded", {"engine": {**base, "attention_backend": "FLASH_ATTN"},
                                                    "waves": waves}, tmp_path, "reference")
    relay = {**base, "attention_backend": "relay",
             "additional_config": {"relay": {"system_prompts": {"sys": system}}}}
    got = run_module("tests.e2e.run_seeded", {"engine": relay, "waves": waves, "plugin": True, "stats": True},
                     tmp_path, "relay")
    same = total = 0
    for r in (r for wave in waves for r in wave["requests"]):
        for g, w in zip(got[r["id"]], reference[r["id"]], strict=True):
            total += 1
            same += g["tokens"] == w["tokens"]
    print(f"whole-prompt hits on CUDA: {same} of {total} samples identical to vLLM's")
    assert same >= 0.75 * total, (same, total)
    assert got["relay_stats"]["whole_prompt_hits"] == WHOLE_PROMPT_HITS, got["relay_stats"]


@pytest.mark.gpu
def test_seeded_samples_on_cuda_follow_vllms(tmp_path):
    """On a GPU, Model Runner V2 keys each seeded draw by the token's position: a relay request, which
    carries only its own tokens, must draw as vLLM does for the full prompt (relay shifts its positions
    before the sampler reads them; unshifted, no sample would follow vLLM's). bf16 attention differs
    across implementations by rounding, so a sample may part from vLLM's where two draws nearly tie:
    most samples must be vLLM's throughout (unshifted, none would be)."""
    model = get_model("tiny-llama-mha")
    system, reqs = requests(json.loads((Path(model) / "config.json").read_text())["vocab_size"])
    base = {"model": model, "dtype": "bfloat16", "enforce_eager": False, "seed": 0, "max_model_len": 512}
    at_once, one_per_step = [{"steps": 0, "requests": reqs}], [{"steps": 1, "requests": [r]} for r in reqs]
    reference = run_module("tests.e2e.run_seeded", {"engine": {**base, "attention_backend": "FLASH_ATTN"},
                                                    "waves": at_once}, tmp_path, "reference")
    relay = {**base, "attention_backend": "relay", "additional_config": {"relay": {"system_prompts": {"sys": system}}}}
    for i, waves in enumerate((at_once, one_per_step)):
        got = run_module("tests.e2e.run_seeded", {"engine": relay, "waves": waves, "plugin": True}, tmp_path, f"r{i}")
        same = total = 0
        for r in reqs:
            for g, w in zip(got[r["id"]], reference[r["id"]], strict=True):
                total += 1
                same += g["tokens"] == w["tokens"]
        print(f"seeded on CUDA, arrivals {i}: {same} of {total} samples identical to vLLM's")
        assert same >= 0.75 * total, (same, total)
