"""Run one engine in its own process and dump greedy tokens + top-5 logprobs as JSON.

Used by the e2e tests: each engine runs in a fresh process, as vLLM's CPU build spawns its engine
core and workers and two engines in one test process would share global state.
Usage: python run_offline.py SPEC_JSON OUT_JSON, where SPEC_JSON holds
  {"engine": {LLM kwargs}, "prompts": [[token ids], ...], "max_tokens": int or [int per prompt]}
"""

import json
import os
import sys


def main() -> None:
    spec_path, out_path = sys.argv[1:3]
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    spec = json.load(open(spec_path))
    engine = {"dtype": "float32", "enforce_eager": True, "max_model_len": 1024, "seed": 0,
              "block_size": 16, "disable_log_stats": False, **spec["engine"]}
    llm = LLM(**engine)
    max_tokens = spec.get("max_tokens", 12)
    if isinstance(max_tokens, int):
        max_tokens = [max_tokens] * len(spec["prompts"])
    params = [SamplingParams(temperature=0.0, max_tokens=n, logprobs=5, ignore_eos=True) for n in max_tokens]
    outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in spec["prompts"]], params,
                        use_tqdm=False)
    result = {"outputs": [{
        "prompt_len": len(out.prompt_token_ids),
        "tokens": list(out.outputs[0].token_ids),
        "logprobs": [{str(tok): lp.logprob for tok, lp in step.items()} for step in out.outputs[0].logprobs],
    } for out in outs]}
    # Client-visible sampling semantics: n > 1 with a per-request seed, and stop strings.
    sampled = SamplingParams(n=2, seed=11, temperature=1.0, max_tokens=24, stop=["e"])
    outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in spec.get("sampled_prompts", [])],
                        sampled, use_tqdm=False)
    result["sampled"] = [[{"tokens": list(c.token_ids), "text": c.text, "finish_reason": c.finish_reason}
                          for c in out.outputs] for out in outs]
    metrics = {m.name: getattr(m, "value", None) for m in llm.get_metrics()}
    result["preemptions"] = metrics.get("vllm:num_preemptions")
    if engine.get("attention_backend") == "relay":
        from vllm_relay.stats import relay_stats

        result["relay_stats"] = relay_stats(llm)
    json.dump(result, open(out_path, "w"))


if __name__ == "__main__":
    main()
