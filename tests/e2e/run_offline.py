"""Run one engine in its own process and dump greedy tokens + top-5 logprobs as JSON.

Used by test_engine.py: each backend runs in a fresh process, as vLLM's CPU build spawns its
engine core and workers and two engines in one test process would share global state.
Usage: python run_offline.py MODEL_DIR BACKEND(relay|default) PROMPTS_JSON OUT_JSON
"""

import json
import os
import sys


def main() -> None:
    model, backend, prompts_path, out_path = sys.argv[1:5]
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    prompts = json.load(open(prompts_path))
    kwargs = {} if backend == "default" else {"attention_backend": backend}
    llm = LLM(model=model, dtype="float32", enforce_eager=True, max_model_len=1024, seed=0,
              block_size=16, max_num_seqs=16, **kwargs)
    params = SamplingParams(temperature=0.0, max_tokens=12, logprobs=5, ignore_eos=True)
    outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)
    result = []
    for out in outs:
        comp = out.outputs[0]
        result.append({
            "tokens": list(comp.token_ids),
            "logprobs": [{str(tok): lp.logprob for tok, lp in step.items()} for step in comp.logprobs],
        })
    json.dump(result, open(out_path, "w"))


if __name__ == "__main__":
    main()
