"""Run one engine, in-process, over requests that share a prefix; abort one of them mid-decode.

Used by tests/e2e/test_auto_levels.py. Usage: python run_abort.py SPEC_JSON OUT_JSON, where
SPEC_JSON holds {"engine": {LLM kwargs}, "prompts": [[token ids]], "max_tokens": m, "abort": i,
"steps_before_abort": k}: every prompt is added, the engine steps k times (one engine.step() is one
engine-core step: in-process, no async scheduling), request i is aborted, and the rest run to
completion. Dumps every answer (tokens, top-5 logprobs, finish reason) and, for relay, the workers'
planner stats before and after the abort.
"""

import json
import os
import sys


def main() -> None:
    spec_path, out_path = sys.argv[1:3]
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    spec = json.load(open(spec_path))
    llm = LLM(**spec["engine"], async_scheduling=False)
    engine = llm.llm_engine
    relay = spec["engine"].get("attention_backend") == "relay"
    answers: dict[str, dict] = {}
    result: dict = {"answers": answers}
    params = SamplingParams(temperature=0.0, max_tokens=spec["max_tokens"], logprobs=5, ignore_eos=True)

    def stats() -> dict:
        from vllm_relay.stats import planner_stats

        return planner_stats(llm) if relay else {}

    def step() -> None:
        for out in engine.step():
            if out.finished:
                assert out.request_id not in answers, f"{out.request_id} answered twice"
                c = out.outputs[0]
                answers[out.request_id] = {
                    "tokens": list(c.token_ids), "finish_reason": c.finish_reason,
                    "logprobs": [{str(t): lp.logprob for t, lp in s.items()} for s in (c.logprobs or [])]}

    for i, ids in enumerate(spec["prompts"]):
        engine.add_request(str(i), TokensPrompt(prompt_token_ids=ids), params)
    for _ in range(spec["steps_before_abort"]):
        step()
    result["stats_at_abort"] = stats()
    result["unfinished_at_abort"] = engine.get_num_unfinished_requests()
    engine.abort_request([str(spec["abort"])])
    result["unfinished_after_abort"] = engine.get_num_unfinished_requests()
    while engine.has_unfinished_requests():
        step()
    result["stats"] = stats()
    json.dump(result, open(out_path, "w"))


if __name__ == "__main__":
    main()
