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
"""

import json
import os
import sys


def main() -> None:
    spec_path, out_path = sys.argv[1:3]
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    # In-process and without async scheduling, one engine.step() is one engine-core step, so the
    # update comes after exactly k steps in both engines (a spawned engine core steps on its own).
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    spec = json.load(open(spec_path))
    llm = LLM(**spec["engine"], async_scheduling=False)
    engine = llm.llm_engine
    relay = spec["engine"].get("attention_backend") == "relay"
    answers: dict[str, dict] = {}
    result: dict = {"answers": answers}

    def add(req: dict) -> None:
        params = SamplingParams(temperature=0.0, max_tokens=req["max_tokens"], logprobs=5, ignore_eos=True)
        engine.add_request(req["id"], TokensPrompt(prompt_token_ids=req["ids"]), params)

    def step() -> None:
        for out in engine.step():
            if out.finished:
                assert out.request_id not in answers, f"{out.request_id} answered twice"
                c = out.outputs[0]
                answers[out.request_id] = {
                    "tokens": list(c.token_ids), "finish_reason": c.finish_reason,
                    "logprobs": [{str(t): lp.logprob for t, lp in s.items()} for s in (c.logprobs or [])]}

    def run(reqs: list[dict]) -> None:
        for req in reqs:
            add(req)
        while engine.has_unfinished_requests():
            step()

    def stats() -> dict:
        from vllm_relay.stats import relay_stats

        return relay_stats(llm) if relay else {}

    run(spec["before"])
    result["stats_before"] = stats()
    result["idle_reset"] = llm.reset_prefix_cache()
    run(spec["reset"])
    for req in spec["inflight"]:
        add(req)
    for _ in range(spec["steps_before_update"]):
        step()
    result["unfinished_at_update"] = engine.get_num_unfinished_requests()
    llm.collective_rpc("reload_weights", kwargs={"weights_path": spec["new_weights"]})
    result["running_reset"] = llm.reset_prefix_cache(reset_running_requests=True)
    while engine.has_unfinished_requests():
        step()
    run(spec["after"])
    result["stats"] = stats()
    json.dump(result, open(out_path, "w"))


if __name__ == "__main__":
    main()
