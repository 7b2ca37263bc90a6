"""Offline batch inference with relay attention (`vllm.LLM`): two system prompts given at start-up,
a third registered at run time, one batch of chats over all three.

    python examples/offline_batch.py                  # the tiny test model, built locally, on the CPU
    python examples/offline_batch.py --model DIR [--dtype auto] [--block-size 32]

Prints each reply and the relay counters; exits 1 if a chat was not served by relay.
"""

import argparse
import os
import sys

SUPPORT = (
    "You are the support assistant of a shipping company. Answer in one sentence, and ask for the tracking "
    "number when you need it."
)
BILLING = (
    "You answer billing questions for a shipping company. Be precise about amounts and dates, and say which "
    "invoice you mean."
)
RETURNS = (
    "You explain the returns policy of a shipping company: 30 days, original packaging, free pickup, and a "
    "refund within a week of the pickup."
)
QUESTIONS = {
    SUPPORT: ["Where is my parcel?", "Can I change the delivery address?"],
    BILLING: ["Why was I charged twice?"],
    RETURNS: ["How do I send a parcel back?", "Is the pickup really free?"],
}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", help="a model folder or hub name (default: the tiny test model)")
    p.add_argument("--dtype", default=None, help="default: float32 for the tiny model, else vLLM's auto")
    p.add_argument(
        "--block-size", type=int, help="KV cache block size (default: 32 for the tiny model, else vLLM's)"
    )
    args = p.parse_args()
    if args.model is None:
        from vllm_relay.testing.models import get_model

        args.model, args.dtype = get_model("tiny-llama-gqa"), args.dtype or "float32"
        args.block_size = args.block_size or 32  # relay shares whole blocks; vLLM's CPU default is 128
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB of KV cache on the CPU: plenty here

    from vllm import LLM, SamplingParams

    from vllm_relay.stats import register_system_prompt, relay_stats

    relay = {
        "system_prompts": {"support": {"chat_system": SUPPORT}, "billing": {"chat_system": BILLING}},
        "max_prompts": 3,
        "max_prompt_tokens": 1024,
    }
    llm = LLM(
        model=args.model,
        dtype=args.dtype or "auto",
        attention_backend="relay",
        max_model_len=2048,
        block_size=args.block_size,
        enforce_eager=True,
        additional_config={"relay": relay},
    )  # returns once both are filled
    registered = register_system_prompt(llm, "returns", {"chat_system": RETURNS})  # at run time; waits
    print(
        f"registered {registered['name']!r} at run time: {registered['tokens']} tokens, "
        f"slot {registered['slot']}"
    )

    chats = [
        [{"role": "system", "content": system}, {"role": "user", "content": q}]
        for system, questions in QUESTIONS.items()
        for q in questions
    ]
    outputs = llm.chat(chats, SamplingParams(temperature=0.0, max_tokens=24), use_tqdm=False)
    for chat, out in zip(chats, outputs):
        print(
            f"[{chat[1]['content']}] -> {out.outputs[0].text!r} ({len(out.prompt_token_ids)} prompt tokens)"
        )

    stats = relay_stats(llm)
    print(
        f"relay requests {stats['relay_requests']} of {len(chats)}, system tokens reused "
        f"{stats['system_tokens_reused']}; prompts: "
        + ", ".join(f"{p['name']} ({p['tokens']} tokens, {p['state']})" for p in stats["prompts"])
    )
    return 0 if stats["relay_requests"] == len(chats) else 1


if __name__ == "__main__":
    sys.exit(main())
