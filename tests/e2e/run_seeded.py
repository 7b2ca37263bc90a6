"""Run one engine over seeded samples whose requests arrive between engine steps; dump every sample.

Used by tests/e2e/test_seeded.py. Usage: python -m tests.e2e.run_seeded SPEC_JSON OUT_JSON, where
SPEC_JSON holds {"engine": {LLM kwargs}, "waves": [{"steps": k, "requests": [{"id": s, "ids": [...],
"n": n, "seed": s or null, "temperature": t, "max_tokens": m}, ...]}, ...]}: each wave's requests
are added, then the engine steps k times (tests/e2e/stepping.py), as a loaded machine delivers
requests to a busy engine core; the last wave's steps are followed by a drain. Dumps, per request
id, each sample's tokens and logprobs (n samples of a request in order); with "stats": true in
SPEC_JSON, also the relay engine's `relay_stats` at the end, under "relay_stats".
"""

import json
import sys

from tests.e2e.stepping import stepped_llm


def main() -> None:
    spec_path, out_path = sys.argv[1:3]
    spec = json.load(open(spec_path))
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt
    from vllm.sampling_params import RequestOutputKind

    llm = stepped_llm(spec["engine"])
    engine = llm.llm_engine
    answers: dict = {}

    def step() -> None:
        for out in engine.step():
            if out.finished:
                assert out.request_id not in answers, f"{out.request_id} answered twice"
                answers[out.request_id] = [
                    {"tokens": list(c.token_ids),
                     "logprobs": [{str(t): lp.logprob for t, lp in s.items()} for s in (c.logprobs or [])]}
                    for c in sorted(out.outputs, key=lambda c: c.index)]

    for wave in spec["waves"]:
        for r in wave["requests"]:
            params = SamplingParams(n=r.get("n", 1), seed=r.get("seed"), temperature=r["temperature"],
                                    max_tokens=r["max_tokens"], logprobs=1, ignore_eos=True,
                                    output_kind=RequestOutputKind.FINAL_ONLY)  # every sample at the end
            engine.add_request(r["id"], TokensPrompt(prompt_token_ids=r["ids"]), params)
        for _ in range(wave["steps"]):
            step()
    while engine.has_unfinished_requests():
        step()
    if spec.get("stats"):
        from vllm_relay.stats import relay_stats

        answers["relay_stats"] = relay_stats(llm)
    json.dump(answers, open(out_path, "w"))


if __name__ == "__main__":
    main()
