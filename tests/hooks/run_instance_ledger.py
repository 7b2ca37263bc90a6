"""Run a relay engine in this process (its engine core and worker too) and dump every change relay
made to vLLM: the patched attributes and the instance-level changes (`hooks._patch`).

Used by tests/hooks/test_register.py. Usage: python -m tests.hooks.run_instance_ledger SPEC_JSON OUT_JSON ({"model": folder, ...})
"""

import json
import sys

from tests.e2e.stepping import stepped_llm


def main() -> None:
    spec_path, out_path = sys.argv[1:3]
    model = json.load(open(spec_path))["model"]
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    from vllm_relay.hooks import applied_patches
    from vllm_relay.hooks._patch import instance_changes

    system = list(range(100, 140))
    llm = stepped_llm({"model": model, "dtype": "float32", "enforce_eager": True, "attention_backend": "relay",
                       "max_model_len": 512, "block_size": 32, "additional_config": {
                           "relay": {"system_prompts": {"sys": system}, "max_prompt_tokens": 256}}})
    params = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
    llm.generate([TokensPrompt(prompt_token_ids=system + [7, 8, 9]), TokensPrompt(prompt_token_ids=[5, 6] * 20)],
                 params, use_tqdm=False)
    json.dump({"patched": applied_patches(), "instances": instance_changes()}, open(out_path, "w"))


if __name__ == "__main__":
    main()
