"""Run one engine through a weight update and prefix-cache resets; dump every answer as JSON.

Used by tests/e2e/test_weight_update.py, once with relay and once with vLLM's own CPU backend,
each in a fresh process. Usage: python run_weights.py SPEC_JSON OUT_JSON, where SPEC_JSON holds
  {"engine": {LLM kwargs}, "new_weights": folder of the second checkpoint,
   "before": [req], "reset": [req], "inflight": [req], "after": [req], "steps_before_update": k}
and a req is {"id": str, "ids": [token ids], "max_tokens": int}. In order:
1. "before" runs to completion under the first weights, then reset_prefix_cache() while idle,
   then "reset" (with relay, its first step refills the prompt while its requests wait);
2. "inflight" is added and stepped k times (decoding: every prompt fits one step), then the
   workers load the second checkpoint (collective_rpc("reload_weights")) and the prefix cache is
   reset with the running requests (what RL loops do: they are recomputed under the new weights);
   they run to completion;
3. "after" runs under the new weights.
The engine is stepped one engine-core step at a time (tests/e2e/stepping.py).
"""

import json
import sys

from tests.e2e.stepping import Answers, stepped_llm


def main() -> None:
    spec_path, out_path = sys.argv[1:3]
    spec = json.load(open(spec_path))
    llm = stepped_llm(spec["engine"])
    relay = spec["engine"].get("attention_backend") == "relay"
    answers = Answers(llm)
    result: dict = {"answers": answers}

    def run(reqs: list[dict]) -> None:
        for req in reqs:
            answers.add(req["id"], req["ids"], req["max_tokens"])
        answers.drain()

    def stats() -> dict:
        from vllm_relay.stats import relay_stats

        return relay_stats(llm) if relay else {}

    run(spec["before"])
    result["stats_before"] = stats()
    result["idle_reset"] = llm.reset_prefix_cache()
    run(spec["reset"])
    for req in spec["inflight"]:
        answers.add(req["id"], req["ids"], req["max_tokens"])
    for _ in range(spec["steps_before_update"]):
        answers.step()
    result["unfinished_at_update"] = llm.llm_engine.get_num_unfinished_requests()
    llm.collective_rpc("reload_weights", kwargs={"weights_path": spec["new_weights"]})
    result["running_reset"] = llm.reset_prefix_cache(reset_running_requests=True)
    answers.drain()
    run(spec["after"])
    result["stats"] = stats()
    json.dump(result, open(out_path, "w"))


if __name__ == "__main__":
    main()
