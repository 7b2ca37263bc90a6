"""Drive one relay engine (vllm.LLM) through forged salts, a run-time fill under traffic, faults and a
pause, and dump every answered request (greedy tokens, top-5 logprobs, cached tokens) as JSON.

Run by tests/e2e/test_runtime_fill.py in its own process (vLLM's CPU build spawns its engine core).
Usage: python run_traffic.py MODE SPEC_JSON OUT_JSON, with MODE
  traffic  multiprocess engine: forged salts, a fill while relay traffic on another prompt runs,
           pause(mode="abort") while a fill runs (held and running requests get their abort);
  fault    in-process engine (so this process can break the engine core's code): finishing a fill
           raises; the engine serves on and the requests it held take the ordinary path.
SPEC holds the engine's LLM kwargs, the system prompts and the requests of each phase (the test
builds them, and runs the same full prompts through a reference engine).
"""

import json
import os
import sys


def main() -> None:
    mode, spec_path, out_path = sys.argv[1:4]
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    if mode == "fault":
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    from vllm_relay.stats import register_system_prompt, relay_stats, system_prompts

    spec = json.load(open(spec_path))
    llm = LLM(**spec["engine"])
    engine = llm.llm_engine
    answers: dict[str, dict] = {}
    result: dict = {"answers": answers}

    def add(req: dict) -> None:
        params = SamplingParams(temperature=0.0, max_tokens=req["max_tokens"], logprobs=5, ignore_eos=True)
        prompt = TokensPrompt(prompt_token_ids=req["ids"])
        if req.get("salt"):
            prompt["cache_salt"] = req["salt"]
        engine.add_request(req["id"], prompt, params)

    def record(out) -> None:
        assert out.request_id not in answers, f"{out.request_id} answered twice"
        c = out.outputs[0]
        answers[out.request_id] = {
            "tokens": list(c.token_ids), "finish_reason": c.finish_reason, "cached": out.num_cached_tokens,
            "logprobs": [{str(t): lp.logprob for t, lp in step.items()} for step in (c.logprobs or [])]}

    def drain(until=lambda: False) -> None:
        while engine.has_unfinished_requests() and not until():
            for out in engine.step():
                if out.finished:
                    record(out)

    def run(reqs: list[dict]) -> None:
        for req in reqs:
            add(req)
        drain()

    if mode == "traffic":
        # 1) Forged salts, one request at a time so each finds the previous one's blocks cached.
        for req in spec["forge"]:
            run([req])
        result["stats_forge"] = relay_stats(llm)
        # 2) A run-time fill while relay traffic on another prompt runs.
        for req in spec["traffic"]:
            add(req)
        seen = 0
        while seen < 3:  # the traffic is running: its first outputs are out
            seen += sum(1 for _ in engine.step())
        result["traffic_unfinished_at_register"] = engine.get_num_unfinished_requests()
        result["registered_b"] = register_system_prompt(llm, "b", spec["systems"]["b"], wait=False)
        for req in spec["held"]:
            add(req)
        result["held_after_add"] = relay_stats(llm)["held_requests"]
        drain()
        result["stats_traffic"] = relay_stats(llm)
        # 3) pause(mode="abort") while a fill runs: held and running requests end with "abort".
        register_system_prompt(llm, "c", spec["systems"]["c"], wait=False)
        for req in spec["aborted"]:
            add(req)
        result["held_before_pause"] = relay_stats(llm)["held_requests"]
        engine.engine_core.call_utility("pause_scheduler", "abort", False)
        drain()
        result["prompts_after_pause"] = system_prompts(llm)
        engine.engine_core.call_utility("resume_scheduler")
        result["registered_c"] = register_system_prompt(llm, "c", spec["systems"]["c"])  # a retry, waited for
        run(spec["after"])
    else:
        from vllm_relay.system_prompts import SystemPromptRegistry

        mark_ready = SystemPromptRegistry.mark_ready

        def broken(self, name):
            if name == "b":
                raise RuntimeError("injected: the store could not be written")
            return mark_ready(self, name)

        SystemPromptRegistry.mark_ready = broken
        result["registered_b"] = register_system_prompt(llm, "b", spec["systems"]["b"], wait=False)
        run(spec["held"])
        result["prompts_after_fault"] = system_prompts(llm)
        run(spec["after"])  # still serving, relay included
    result["stats"] = relay_stats(llm)
    metrics = {m.name: getattr(m, "value", None) for m in llm.get_metrics()}
    result["preemptions"] = metrics.get("vllm:num_preemptions")
    json.dump(result, open(out_path, "w"))


if __name__ == "__main__":
    main()
