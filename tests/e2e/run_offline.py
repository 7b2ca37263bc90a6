"""Run one engine in its own process and dump greedy tokens + top-5 logprobs as JSON.

Used by the e2e tests: each engine runs in a fresh process, as vLLM's CPU build spawns its engine
core and workers and two engines in one test process would share global state.
Usage: python run_offline.py SPEC_JSON OUT_JSON, where SPEC_JSON holds
  {"engine": {LLM kwargs}, "prompts": [[token ids] or {"ids": [...], "cache_salt": s} or
   {"ids": [...], "lora": [name, int id, adapter folder]} or {"ids": [...], "image": [h, w, seed]}, ...],
   "max_tokens": int or [int per prompt], "samples": [{"prompt": [ids], "n": k, "seed": s,
   "max_tokens": m}, ...] (optional: seeded sampling, every sample with its top-5 logprobs),
   "first": {"prompts": [...], "max_tokens": int} (optional: a greedy batch run before the rest,
   its outputs and, for relay, the workers' stats right after it),
   "sleep": 1 or 2 (optional: after "first", sleep at that level and wake up; at level 2 the
   weights are loaded again in between, as vLLM's docs do),
   "drafts": true (optional: the engine core in this process, and every draft token a drafter model
   proposed for each prompt, step by step), "logprobs": k (optional: the top k of the prompts'
   outputs, 5 unless given)}
With data_parallel_size > 1 the engine is an AsyncLLM (vllm.LLM refuses data parallelism).
"""

import json
import os
import sys


def main() -> None:
    spec_path, out_path = sys.argv[1:3]
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    # Lets collective_rpc carry `worker_stats` (a function) to the workers: test harness only.
    os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")
    spec = json.load(open(spec_path))
    if spec.get("drafts"):  # the drafter runs in this process, where its proposals can be recorded
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    engine = {"dtype": "float32", "enforce_eager": True, "max_model_len": 1024, "seed": 0,
              "block_size": 32, "disable_log_stats": False, **spec["engine"]}
    max_tokens = spec.get("max_tokens", 12)
    if isinstance(max_tokens, int):
        max_tokens = [max_tokens] * len(spec["prompts"])
    top = spec.get("logprobs", 5)
    params = [SamplingParams(temperature=0.0, max_tokens=n, logprobs=top, ignore_eos=True) for n in max_tokens]
    if engine.get("data_parallel_size", 1) > 1:  # vllm.LLM refuses data parallelism: the server's AsyncLLM
        return json.dump(run_async(engine, spec["prompts"], params), open(out_path, "w"))
    llm = LLM(**engine)
    drafts = record_drafts(llm) if spec.get("drafts") else None
    relay = engine.get("attention_backend") == "relay"
    result = {}
    if first := spec.get("first"):
        sp = SamplingParams(temperature=0.0, max_tokens=first["max_tokens"], logprobs=5, ignore_eos=True)
        outs = llm.generate([tokens_prompt(p) for p in first["prompts"]], sp, use_tqdm=False,
                            lora_request=lora_requests(first["prompts"]))
        result["first"] = {"outputs": [greedy(out) for out in outs]}
        if relay:
            from vllm_relay.attention.workers import worker_stats

            result["first"]["worker_stats"] = llm.collective_rpc(worker_stats)[0]
    if level := spec.get("sleep"):
        llm.sleep(level=level)
        if level == 2:
            llm.wake_up(tags=["weights"])
            llm.collective_rpc("reload_weights")
            llm.wake_up(tags=["kv_cache"])
        else:
            llm.wake_up()
    outs = llm.generate([tokens_prompt(p) for p in spec["prompts"]], params, use_tqdm=False,
                        lora_request=lora_requests(spec["prompts"]))
    result["outputs"] = [greedy(out) for out in outs]
    if drafts is not None:
        result["drafts"] = [drafts.get(out.request_id, []) for out in outs]
    if spec.get("samples"):  # all at once: the samples of every prompt decode in the same steps
        groups = spec["samples"]
        outs = llm.generate([TokensPrompt(prompt_token_ids=g["prompt"]) for g in groups],
                            [SamplingParams(n=g["n"], seed=g["seed"], temperature=1.0, max_tokens=g["max_tokens"],
                                            logprobs=5, ignore_eos=True) for g in groups], use_tqdm=False)
        result["samples"] = [[{"tokens": list(c.token_ids),
                               "logprobs": [{str(t): lp.logprob for t, lp in step.items()} for step in c.logprobs]}
                              for c in out.outputs] for out in outs]
    # Client-visible sampling semantics: n > 1 with a per-request seed, and stop strings.
    sampled = SamplingParams(n=2, seed=11, temperature=1.0, max_tokens=24, stop=["e"])
    outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in spec.get("sampled_prompts", [])],
                        sampled, use_tqdm=False)
    result["sampled"] = [[{"tokens": list(c.token_ids), "text": c.text, "finish_reason": c.finish_reason}
                          for c in out.outputs] for out in outs]
    metrics = {m.name: getattr(m, "value", None) for m in llm.get_metrics()}
    result["preemptions"] = metrics.get("vllm:num_preemptions")
    result["draft_tokens"] = metrics.get("vllm:spec_decode_num_draft_tokens")  # speculative decoding
    result["accepted_tokens"] = metrics.get("vllm:spec_decode_num_accepted_tokens")
    if relay:
        from vllm_relay.stats import relay_stats

        result["relay_stats"] = relay_stats(llm)
        from vllm_relay.hooks import transport

        result["prompts_sent_once"] = transport.sent_once  # requests sent as a reference to the prompt before
        from vllm_relay.attention.workers import worker_stats

        result["worker_stats"] = llm.collective_rpc(worker_stats)[0]
    json.dump(result, open(out_path, "w"))


def record_drafts(llm) -> dict:
    """request id -> the draft tokens proposed for it, a list per step that samples it (the drafter
    wrapped in place: the V1 runner's `drafter`, the CPU's, or Model Runner V2's `speculator`)."""
    worker = llm.llm_engine.model_executor.driver_worker
    runner = getattr(worker, "worker", worker).model_runner
    log = {}
    if getattr(runner, "speculator", None) is not None:  # Model Runner V2 (GPUs): no prompt chunked here
        propose = runner.speculator.propose

        def proposed(input_batch, *args, **kwargs):
            out = propose(input_batch, *args, **kwargs)
            if not kwargs.get("dummy_run"):
                for rid, tokens in zip(input_batch.req_ids, out.tolist()):
                    log.setdefault(rid.split("-")[0], []).append(tokens)
            return out

        runner.speculator.propose = proposed
        return log
    propose = runner.drafter.propose

    def recorded(*args, **kwargs):
        out = propose(*args, **kwargs)
        partial = runner.discard_request_mask.np  # a prefill chunk short of its prompt: no draft kept
        for i, (rid, tokens) in enumerate(zip(runner.input_batch.req_ids, out.tolist())):
            if not partial[i]:  # (the engine's request id: the client's and a suffix)
                log.setdefault(rid.split("-")[0], []).append(tokens)
        return out

    runner.drafter.propose = recorded
    return log


def tokens_prompt(p):
    from vllm.inputs import TokensPrompt

    if isinstance(p, dict) and "cache_salt" in p:
        return TokensPrompt(prompt_token_ids=p["ids"], cache_salt=p["cache_salt"])
    if isinstance(p, dict) and "image" in p:  # [height, width, seed]: random pixels
        import numpy as np
        from PIL import Image

        h, w, seed = p["image"]
        pixels = np.random.default_rng(seed).integers(0, 256, (h, w, 3), dtype=np.uint8)
        return TokensPrompt(prompt_token_ids=p["ids"], multi_modal_data={"image": Image.fromarray(pixels)})
    return TokensPrompt(prompt_token_ids=p["ids"] if isinstance(p, dict) else p)


def lora_requests(prompts: list):
    """The LoRA adapter of each prompt ({"lora": [name, id, folder]}), or None when none has one."""
    from vllm.lora.request import LoRARequest

    loras = [LoRARequest(*p["lora"]) if isinstance(p, dict) and p.get("lora") else None for p in prompts]
    return loras if any(loras) else None


def greedy(out) -> dict:
    return {"prompt_len": len(out.prompt_token_ids), "tokens": list(out.outputs[0].token_ids),
            "logprobs": [{str(tok): lp.logprob for tok, lp in step.items()} for step in out.outputs[0].logprobs]}


def run_async(engine: dict, prompts: list, params: list) -> dict:
    """The prompts, all at once, through an AsyncLLM (data parallelism: its client balances them
    over the engine cores); relay stats added up over the engines, each engine's kept."""
    import asyncio

    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.inputs import TokensPrompt
    from vllm.v1.engine.async_llm import AsyncLLM

    async def go() -> dict:
        llm = AsyncLLM.from_engine_args(AsyncEngineArgs(**engine))
        try:
            async def one(i, ids, sp):
                final = None
                async for out in llm.generate(TokensPrompt(prompt_token_ids=ids), sp, request_id=f"r{i}"):
                    final = out
                return final

            outs = await asyncio.gather(*(one(i, ids, sp) for i, (ids, sp) in enumerate(zip(prompts, params))))
            result = {"outputs": [greedy(out) for out in outs], "sampled": [], "preemptions": None}
            if engine.get("attention_backend") == "relay":
                from vllm_relay.attention.workers import worker_stats
                from vllm_relay.stats import async_planner_stats, async_relay_stats

                result["relay_stats"] = await async_relay_stats(llm)
                result["worker_stats"] = await async_planner_stats(llm)  # every engine's workers
                result["first_worker_stats"] = (await llm.collective_rpc(worker_stats))[0]  # engine 0's first
            return result
        finally:
            llm.shutdown()

    return asyncio.run(go())


if __name__ == "__main__":
    main()
