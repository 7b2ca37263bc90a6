"""Chat with a relay server through the official `openai` client, streaming, unchanged.

Registers the system prompt over HTTP (`POST /v1/relay/system_prompts`, through the SDK's generic
`post`), streams a chat that starts with it, prints the usage (the full prompt: relay changes
nothing a client sees), then reads the prompt's entry to show the request was served by relay.

    VLLM_PLUGINS=relay vllm serve MODEL --attention-backend relay --enable-prompt-tokens-details
    python examples/openai_chat.py --base-url http://localhost:8000/v1 [--api-key KEY] [--model NAME]
"""

import argparse
import sys

import openai

SYSTEM = (
    "You are the support assistant of a shipping company. Answer in two sentences at most, "
    "and ask for the tracking number when you need it."
)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--base-url", default="http://localhost:8000/v1")
    p.add_argument("--api-key", default="EMPTY", help="the server's --api-key, if any")
    p.add_argument("--model", help="default: the server's first model")
    p.add_argument("--name", default="support", help="name of the system prompt to register")
    args = p.parse_args()

    client = openai.OpenAI(base_url=args.base_url, api_key=args.api_key)
    model = args.model or client.models.list().data[0].id
    try:  # register it (waits until its KV is filled); an existing one of that name is fine too
        prompt = client.post(
            "/relay/system_prompts",
            cast_to=object,
            body={"name": args.name, "messages": [{"role": "system", "content": SYSTEM}]},
        )
        print(f"registered {prompt['name']!r}: {prompt['tokens']} tokens in slot {prompt['slot']}")
    except openai.ConflictError as e:
        print(f"already registered: {e.body['message'] if isinstance(e.body, dict) else e}")

    stream = client.chat.completions.create(
        model=model,
        max_tokens=48,
        temperature=0.0,
        stream=True,
        stream_options={"include_usage": True},
        messages=[{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Where is my parcel?"}],
    )
    usage = None
    print("reply: ", end="", flush=True)
    for chunk in stream:
        for choice in chunk.choices:
            print(choice.delta.content or "", end="", flush=True)
        usage = chunk.usage or usage
    print()
    cached = usage.prompt_tokens_details.cached_tokens if usage.prompt_tokens_details else 0
    print(
        f"usage: {usage.prompt_tokens} prompt tokens ({cached} not recomputed), "
        f"{usage.completion_tokens} completion"
    )

    entry = client.get(f"/relay/system_prompts/{args.name}", cast_to=object)
    print(
        f"{entry['name']!r}: {entry['requests_served']} request(s) served by relay, "
        f"{entry['tokens_reused']} system tokens reused"
    )
    return 0 if entry["requests_served"] > 0 else 1


if __name__ == "__main__":
    sys.exit(main())
