"""New weights at run time: relay fills its system prompts again and answers as vLLM's own backend.

One relay engine and one engine on vLLM's own CPU backend (tests/e2e/run_weights.py) each serve
requests under a first checkpoint, reset the prefix cache while idle (with relay it used to fail:
the prompts' pages were pinned), load a second checkpoint into the running workers with requests
in flight (`collective_rpc("reload_weights")`, then `reset_prefix_cache(reset_running_requests=
True)`, as RL loops do), and serve more requests under it. Every answer must be equal (greedy
tokens, top-5 logprobs within 1e-4, fp32), through the update too; the second checkpoint must
really answer differently, and relay must still route its requests (the prompt filled again).
"""

import json
import random
import shutil
from pathlib import Path

import pytest

from tests.e2e.engine_runner import assert_same_outputs, run_module
from vllm_relay.testing.models import get_model

pytestmark = pytest.mark.engine


def second_checkpoint(model: str, path: Path) -> Path:
    """The same model with other random weights (each tensor redrawn with its own mean and std)."""
    import torch
    from safetensors.torch import load_file, save_file

    shutil.copytree(model, path)
    weights = load_file(str(path / "model.safetensors"))
    gen = torch.Generator().manual_seed(1234)
    redrawn = {k: (torch.randn(t.shape, generator=gen) * t.float().std() + t.float().mean()).to(t.dtype)
               if t.numel() > 1 and t.float().std() > 0 else t for k, t in weights.items()}
    save_file(redrawn, str(path / "model.safetensors"), metadata={"format": "pt"})
    return path


def test_weight_update_and_prefix_resets_refill_the_system_prompt(tmp_path):
    model = get_model("tiny-llama-mha")
    vocab = json.loads((Path(model) / "config.json").read_text())["vocab_size"]
    rng = random.Random(17)

    def ids(n):
        return [rng.randrange(8, vocab) for _ in range(n)]

    system = [1] + ids(99)  # 3 whole blocks of 32 in its pages; relay requests compute the rest
    own = [ids(n) for n in (5, 23, 41)]

    def batch(tag, max_tokens):
        relay = [{"id": f"{tag}-relay{i}", "ids": system + o, "max_tokens": max_tokens} for i, o in enumerate(own)]
        return relay + [{"id": f"{tag}-plain", "ids": [1] + ids(60), "max_tokens": max_tokens}]

    spec = {"new_weights": str(second_checkpoint(model, tmp_path / "second")), "steps_before_update": 4,
            "before": batch("before", 12), "reset": batch("reset", 8), "inflight": batch("inflight", 16),
            "after": batch("after", 12)}
    engine = {"model": model, "dtype": "float32", "enforce_eager": True, "seed": 0, "block_size": 32,
              "max_model_len": 512, "max_num_batched_tokens": 1024}  # every prompt of a batch in one step
    relay = run_module("tests.e2e.run_weights", {**spec, "engine": {**engine, "attention_backend": "relay",
                                     "additional_config": {"relay": {"system_prompts": {"s": system}}}}},
                tmp_path, "relay")
    reference = run_module("tests.e2e.run_weights", {**spec, "engine": engine}, tmp_path, "reference")

    order = [r["id"] for phase in ("before", "reset", "inflight", "after") for r in spec[phase]]
    assert sorted(relay["answers"]) == sorted(order) == sorted(reference["answers"])
    assert_same_outputs([relay["answers"][i] for i in order], [reference["answers"][i] for i in order])

    # The reset works with relay on, as without; the update came while every request was running.
    assert relay["idle_reset"] is True and reference["idle_reset"] is True
    assert relay["unfinished_at_update"] == reference["unfinished_at_update"] == 4
    # The second checkpoint answers differently: the comparison above crossed a real update.
    answers = reference["answers"]
    changed = sum(answers[f"before-relay{i}"]["tokens"] != answers[f"after-relay{i}"]["tokens"]
                  for i in range(3))
    assert changed == 3
    # Relay kept routing: every relay request read the prompt's pages, filled again twice (the
    # idle reset; the update, whose reset the loop's own reset right after did not repeat).
    assert relay["stats_before"]["relay_requests"] == 3 and relay["stats"]["relay_requests"] == 12
    assert relay["stats"]["refills"] == 2 and relay["stats"]["fills_failed"] == 0, relay["stats"]
