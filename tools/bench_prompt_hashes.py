"""The engine core's prefix-cache hashing of new requests: vLLM's hasher against a relay engine's
(`engine/hashes.py`: the hashes of the whole blocks a prompt shares with a recent one reused), on the
host's CPU.

A `Request` built as the engine core builds each new one (sha256 block hashes, blocks of 16), for:
  same       the same prompt of P tokens again (the n samples of one prompt)
  document   one document of P tokens with a different 64-token question each time
  plain      unrelated prompts of P tokens (nothing to reuse: what plain traffic pays)
Median of --reps requests, in ms per request (the Request's own construction included), the two
hashers taking turns on each prompt.
Usage: python3 tools/bench_prompt_hashes.py [--prompt-lens 2048,16000] [--out F.json]
"""

import argparse
import json
import random
import statistics
import time

KINDS = ("same", "document", "plain")


def per_request_ms(hashers: dict, prompts: list) -> dict:
    """Median ms per request of each hasher, the hashers taking turns on each prompt (a loaded host
    slows them alike)."""
    from vllm import SamplingParams
    from vllm.v1.request import Request

    times = {name: [] for name in hashers}
    for i, ids in enumerate(prompts):
        for name, hasher in hashers.items():
            t0 = time.perf_counter()
            Request(request_id=str(i), prompt_token_ids=list(ids), sampling_params=SamplingParams(max_tokens=1),
                    pooling_params=None, block_hasher=hasher)
            times[name].append(time.perf_counter() - t0)
    return {name: statistics.median(t[1:]) * 1e3 for name, t in times.items()}  # the first hashes everything


def prompts(kind: str, length: int, reps: int, rng: random.Random) -> list:
    draw = lambda n: [rng.randrange(100, 32000) for _ in range(n)]  # noqa: E731
    if kind == "same":
        one = draw(length)
        return [one] * (reps + 1)  # each Request gets its own copy
    if kind == "document":
        doc = draw(length)
        return [doc + draw(64) for _ in range(reps + 1)]
    return [draw(length) for _ in range(reps + 1)]


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--prompt-lens", default="2048,16000")
    p.add_argument("--reps", type=int, default=40)
    p.add_argument("--out")
    args = p.parse_args()
    from vllm.utils.hashing import get_hash_fn_by_name
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash

    from vllm_relay.engine.hashes import PromptHashMemo

    fn = get_hash_fn_by_name("sha256")
    init_none_hash(fn)
    rows = []
    for length in map(int, args.prompt_lens.split(",")):
        for kind in KINDS:
            hashers = {"vllm": get_request_block_hasher(16, fn),
                       "relay": PromptHashMemo(get_request_block_hasher(16, fn), 16)}
            ms = per_request_ms(hashers, prompts(kind, length, args.reps, random.Random(length)))
            row = {"prompt_len": length, "kind": kind, **{f"{name}_ms": v for name, v in ms.items()}}
            rows.append(row)
            print(f"P={length:6d} {kind:9s} vLLM {row['vllm_ms']:7.3f} ms  relay {row['relay_ms']:7.3f} ms a request",
                  flush=True)
    if args.out:
        json.dump({"args": vars(args), "rows": rows}, open(args.out, "w"), indent=1)


if __name__ == "__main__":
    main()
