"""Run-time fills under traffic, forged salts and faults, in real engines, checked against a reference.

One relay engine (tests/e2e/run_traffic.py, mode "traffic") serves, in order:
1. forged salts: a client request with the salt relay's requests used to carry, reading and then
   writing blocks, around relay requests with the same tokens; its cached tokens stay 0 across the
   boundary (positive controls hit the same blocks from their own side);
2. relay traffic on start-up prompt "a", and while it runs prompt "b" is registered and its
   requests sent at once (held until the fill is done, then routed);
3. pause(mode="abort") while prompt "c" fills: the held and the running requests end with "abort",
   "c" is failed with the reason; after resuming, "c" is registered again and serves.
A second relay engine (mode "fault", in-process) breaks the engine core's code that finishes the
fill of "b": "b" is failed with the reason, and its held requests are answered the ordinary way.
Every answered request must equal vLLM's own CPU backend on the full prompt (greedy tokens, top-5
logprobs within 1e-4, fp32), and every request must be answered exactly once.
"""

import json
import random
import subprocess
import sys
from pathlib import Path

import pytest

from tests.e2e.engine_runner import assert_same_outputs, run_engine
from vllm_relay.testing.models import get_model

pytestmark = pytest.mark.engine

RUNNER = Path(__file__).with_name("run_traffic.py")
OLD_RELAY_SALT = "vllm-relay:a:1"  # what relay's salt for prompt "a" used to be: anyone could send it
BLOCK = 32
SHARED_A = 96  # "a" has 100 tokens; relay requests read its 6 whole blocks from its pages


def scenario(vocab: int, seed: int = 5):
    rng = random.Random(seed)

    def ids(n):
        return [rng.randrange(8, vocab) for _ in range(n)]

    systems = {"a": [1] + ids(99), "b": [1] + ids(149), "c": [1] + ids(199)}  # b, c: fills of 3-4 steps
    a, b, c = systems["a"], systems["b"], systems["c"]
    own1, own2 = ids(40), ids(40)
    kept = a[SHARED_A:]  # relay strips a's whole blocks; a request computes the rest of "a" itself

    def req(name, tokens, max_tokens=16, salt=None):
        return {"id": name, "ids": tokens, "max_tokens": max_tokens, **({"salt": salt} if salt else {})}

    spec = {
        "systems": {"b": b, "c": c},
        "forge": [
            req("relay1", a + own1),  # its own tokens: kept + own1, two full blocks and a part
            req("forger-reads", kept + own1 + [5], salt=OLD_RELAY_SALT),  # relay1's own tokens
            req("forger-writes", kept + own2 + [5], salt=OLD_RELAY_SALT),
            req("relay2", a + own2 + [5]),  # the forger's tokens, behind a's whole blocks
            req("relay1-again", a + own1 + [6]),  # control: relay1's blocks are there
            req("forger-again", kept + own2 + [5], salt=OLD_RELAY_SALT),  # control: the forger's blocks are there
        ],
        "traffic": [req(f"a{i}", a + ids(n), max_tokens=48) for i, n in enumerate([3, 17, 30, 45, 8, 60, 22, 11])]
        + [req(f"plain{i}", [1] + ids(50), max_tokens=48) for i in range(2)],
        "held": [req(f"b{i}", b + ids(n)) for i, n in enumerate([2, 19, 33, 50])],
        "aborted": [req(f"c-held{i}", c + ids(5)) for i in range(2)]
        + [req(f"a-running{i}", a + ids(10), max_tokens=200) for i in range(2)],
        "after": [req(f"c{i}", c + ids(n)) for i, n in enumerate([4, 21])]
        + [req("b-after", b + ids(7)), req("a-after", a + ids(9))],
    }
    return systems, spec


def engine(model: str, startup: dict) -> dict:
    return {"model": model, "dtype": "float32", "enforce_eager": True, "seed": 0, "block_size": 32,
            "disable_log_stats": False,
            "attention_backend": "relay", "max_model_len": 512, "max_num_batched_tokens": 64, "max_num_seqs": 16,
            "num_gpu_blocks_override": 24,  # 768 tokens of paged KV: the traffic preempts
            "additional_config": {"relay": {"system_prompts": startup, "max_prompts": 3,
                                            "max_prompt_tokens": 256}}}


def run_relay(mode: str, spec: dict, tmp_path: Path) -> dict:
    spec_file, out_file = tmp_path / f"{mode}.spec.json", tmp_path / f"{mode}.out.json"
    spec_file.write_text(json.dumps(spec))
    proc = subprocess.run([sys.executable, str(RUNNER), mode, str(spec_file), str(out_file)],
                          capture_output=True, text=True, timeout=1200)
    assert proc.returncode == 0, proc.stderr[-6000:]
    return json.loads(out_file.read_text())


def test_runtime_fill_under_traffic_forged_salts_and_faults(tmp_path):
    model = get_model("tiny-llama-gqa")
    vocab = json.loads((Path(model) / "config.json").read_text())["vocab_size"]
    systems, spec = scenario(vocab)
    S = SHARED_A
    assert len(systems["a"]) // BLOCK * BLOCK == S

    traffic = run_relay("traffic", {**spec, "engine": engine(model, {"a": systems["a"]})}, tmp_path)
    fault_spec = {"systems": spec["systems"], "held": spec["held"] + spec["traffic"][:1] + spec["traffic"][-1:],
                  "after": spec["after"][2:]}
    fault = run_relay("fault", {**fault_spec, "engine": engine(model, {"a": systems["a"]})}, tmp_path)

    answered = [r for phase in ("forge", "traffic", "held", "after") for r in spec[phase]]
    fault_answered = fault_spec["held"] + fault_spec["after"]
    reference, _ = run_engine({"engine": {"model": model, "max_model_len": 512},
                               "prompts": [r["ids"] for r in answered + fault_answered],
                               "max_tokens": [r["max_tokens"] for r in answered + fault_answered]},
                              tmp_path, "reference")
    ref = reference["outputs"]

    # Every request answered exactly once (the runner refuses a second answer), none lost.
    answers = traffic["answers"]
    assert sorted(answers) == sorted(r["id"] for r in answered + spec["aborted"])
    assert sorted(fault["answers"]) == sorted(r["id"] for r in fault_answered)
    # Exact against the reference, through the fill under traffic, the pause and the retry.
    assert_same_outputs([answers[r["id"]] for r in answered], ref[: len(answered)])
    assert_same_outputs([fault["answers"][r["id"]] for r in fault_answered], ref[len(answered):])

    # 1) Forged salts share nothing, in either direction; the controls show the blocks were there.
    cached = {r["id"]: answers[r["id"]]["cached"] for r in spec["forge"]}
    assert cached["forger-reads"] == 0 and cached["relay2"] == S, cached
    assert cached["relay1-again"] == S + 32 and cached["forger-again"] == 32, cached

    # 2) The fill of "b" ran while the relay traffic on "a" did; its requests were served by relay.
    assert traffic["traffic_unfinished_at_register"] > 0 and traffic["registered_b"]["state"] == "filling"
    assert traffic["stats_traffic"]["relay_requests"] == 3 + 8 + 4, traffic["stats_traffic"]
    assert traffic["preemptions"] > 0, "the small KV cache was meant to preempt"

    # 3) pause(mode="abort") mid-fill: every held and running request got its abort; "c" failed.
    for r in spec["aborted"]:
        assert answers[r["id"]]["finish_reason"] == "abort", (r["id"], answers[r["id"]])
    assert traffic["held_before_pause"] == 2
    c = next(p for p in traffic["prompts_after_pause"] if p["name"] == "c")
    assert c["state"] == "failed" and c["error"].startswith("its fill request was aborted"), c
    assert traffic["registered_c"]["state"] == "ready"
    stats = traffic["stats"]
    assert stats["fills_completed"] == 3 and stats["fills_failed"] == 1, stats  # a, b, c retried; c aborted
    assert stats["relay_requests"] == 15 + 2 + 4 and stats["held_requests"] == 0, stats

    # Fault: finishing the fill of "b" raised; "b" failed, its held requests took the ordinary path.
    b = next(p for p in fault["prompts_after_fault"] if p["name"] == "b")
    assert b == {**b, "state": "failed", "slot": None,
                 "error": "finishing its fill raised RuntimeError: injected: the store could not be written"}
    # Relay served only the requests on "a" ("a0" with the held ones, "a-after"); "b-after" went the
    # ordinary way too.
    assert fault["stats"]["fills_failed"] == 1 and fault["stats"]["relay_requests"] == 2, fault["stats"]
