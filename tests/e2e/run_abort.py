"""Run one engine over requests that share a prefix; abort one of them mid-decode.

Used by tests/e2e/test_auto_levels.py. Usage: python run_abort.py SPEC_JSON OUT_JSON, where
SPEC_JSON holds {"engine": {LLM kwargs}, "prompts": [[token ids]], "max_tokens": m, "abort": i,
"steps_before_abort": k}: every prompt is added, the engine steps k times (tests/e2e/stepping.py),
request i is aborted, and the rest run to completion. Dumps every answer and, for relay, the
workers' planner stats before and after the abort.
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

    def stats() -> dict:
        from vllm_relay.stats import planner_stats

        return planner_stats(llm) if relay else {}

    for i, ids in enumerate(spec["prompts"]):
        answers.add(str(i), ids, spec["max_tokens"])
    for _ in range(spec["steps_before_abort"]):
        answers.step()
    result["stats_at_abort"] = stats()
    result["unfinished_at_abort"] = llm.llm_engine.get_num_unfinished_requests()
    llm.llm_engine.abort_request([str(spec["abort"])])
    result["unfinished_after_abort"] = llm.llm_engine.get_num_unfinished_requests()
    answers.drain()
    result["stats"] = stats()
    json.dump(result, open(out_path, "w"))


if __name__ == "__main__":
    main()
