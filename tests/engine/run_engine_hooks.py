"""Start one relay engine (vllm.LLM) and dump what tests/engine/test_core.py checks, as JSON.

Run in its own process, as vLLM's CPU build spawns its engine core and workers.
Usage: python run_engine_hooks.py MODEL_DIR OUT_JSON
"""

import json
import os
import sys
import time

SYS = list(range(100, 140))  # a configured prompt given as token ids
RT = list(range(300, 340))  # registered at run time: one whole block of 32 and a partial one
OWN = [7, 8, 9, 10, 11]


def main() -> None:
    model, out_path = sys.argv[1:3]
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    from vllm_relay.stats import register_system_prompt, relay_stats, system_prompts
    from vllm_relay.testing.tokenizer import SYSTEM_MESSAGE

    result: dict = {}
    start = time.monotonic()
    llm = LLM(model=model, dtype="float32", enforce_eager=True, attention_backend="relay", max_model_len=1024,
              block_size=32, seed=0, additional_config={"relay": {
                  "max_prompts": 3, "max_prompt_tokens": 256,
                  "system_prompts": {"sys": SYS, "chat": {"chat_system": SYSTEM_MESSAGE}}}})
    result["startup_s"] = time.monotonic() - start
    result["prompts_at_start"] = system_prompts(llm)

    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    outs = llm.generate([TokensPrompt(prompt_token_ids=SYS + OWN), TokensPrompt(prompt_token_ids=OWN * 3)],
                        params, use_tqdm=False)
    result["prompt_lens"] = [len(o.prompt_token_ids) for o in outs]
    result["cached_tokens"] = [o.num_cached_tokens for o in outs]
    result["output_lens"] = [len(o.outputs[0].token_ids) for o in outs]
    result["stats_generate"] = relay_stats(llm)

    start = time.monotonic()
    result["registered"] = register_system_prompt(llm, "rt", RT)
    result["register_s"] = time.monotonic() - start
    llm.generate([TokensPrompt(prompt_token_ids=RT + OWN)], params, use_tqdm=False)
    result["stats_runtime"] = relay_stats(llm)

    chat = llm.chat([{"role": "system", "content": SYSTEM_MESSAGE}, {"role": "user", "content": "Hi there"}],
                    params, use_tqdm=False)
    result["chat_prompt_len"] = len(chat[0].prompt_token_ids)
    result["stats_chat"] = relay_stats(llm)
    try:
        register_system_prompt(llm, "bad", [])
    except Exception as e:  # noqa: BLE001
        result["register_error"] = str(e)
    json.dump(result, open(out_path, "w"))


if __name__ == "__main__":
    main()
