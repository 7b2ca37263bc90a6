"""An engine stepped one engine-core step at a time, its answers recorded: for the e2e runners that
act between steps (run_weights.py, run_abort.py), each in its own process.

In-process and without async scheduling, one `engine.step()` is one engine-core step, so an action
comes after exactly k steps in a relay engine and in its reference (a spawned engine core would
step on its own)."""

import os


def stepped_llm(engine: dict):
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    from vllm import LLM

    return LLM(**{"async_scheduling": False, **engine})


class Answers(dict):
    """Request id -> {"tokens", "finish_reason", "logprobs"} of each finished request; a request
    answered twice fails."""

    def __init__(self, llm) -> None:
        super().__init__()
        self.engine = llm.llm_engine

    def add(self, rid: str, ids: list[int], max_tokens: int) -> None:
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, logprobs=5, ignore_eos=True)
        self.engine.add_request(rid, TokensPrompt(prompt_token_ids=ids), params)

    def step(self) -> None:
        for out in self.engine.step():
            if out.finished:
                assert out.request_id not in self, f"{out.request_id} answered twice"
                c = out.outputs[0]
                self[out.request_id] = {
                    "tokens": list(c.token_ids), "finish_reason": c.finish_reason,
                    "logprobs": [{str(t): lp.logprob for t, lp in s.items()} for s in (c.logprobs or [])]}

    def drain(self) -> None:
        while self.engine.has_unfinished_requests():
            self.step()
