"""The transport of n samples of one prompt from the front end to the engine core, on the host's CPU.

vLLM fans a request with n > 1 out in the front end: each of the n child requests travels to the engine
core on its own, with its own copy of the prompt's token ids, encoded by the front end and decoded by the
engine core's input thread with vLLM's msgpack codec (`vllm.v1.serial_utils`), before the scheduler can
admit it. Timed here, ms for all n children (median of --reps), for a prompt of P tokens:
  every     each child carries the prompt (vLLM's fan-out in the front end)
  first     the first child alone carries it, the others none (what a fan-out in the engine core would send)
  one       each child's prompt is one token (what n requests cost whatever their prompts)
Usage: python3 tools/bench_request_transport.py [--prompt-lens 2048,16000] [--n 256] [--out F.json]
"""

import argparse
import copy
import json
import random
import statistics
import time

WAYS = ("every", "first", "one")


def children(ids: list, n: int, way: str) -> list:
    """The n child requests of one request with prompt `ids`, as the front end sends them."""
    from vllm import SamplingParams
    from vllm.v1.engine import EngineCoreRequest

    parent = EngineCoreRequest(request_id="r", prompt_token_ids=ids, mm_features=None,
                               sampling_params=SamplingParams(max_tokens=128, temperature=1.0, seed=0),
                               pooling_params=None, arrival_time=time.time(), lora_request=None, cache_salt=None,
                               data_parallel_rank=None)
    reqs = []
    for i in range(n):
        child = copy.copy(parent)
        child.request_id = f"{i}_r"
        if way == "one":
            child.prompt_token_ids = ids[:1]
        else:
            child.prompt_token_ids = ids if way == "every" or i == 0 else []
        reqs.append(child)
    return reqs


def transport_ms(reqs: list, reps: int) -> dict:
    """Median ms to encode all of `reqs` (front end) and to decode them (engine core)."""
    from vllm.v1.engine import EngineCoreRequest
    from vllm.v1.serial_utils import MsgpackDecoder, MsgpackEncoder

    enc, dec = MsgpackEncoder(), MsgpackDecoder(EngineCoreRequest)
    encode, decode = [], []
    for _ in range(reps):
        t0 = time.perf_counter()
        frames = [enc.encode(r) for r in reqs]
        t1 = time.perf_counter()
        for f in frames:
            dec.decode(f)
        t2 = time.perf_counter()
        encode.append(t1 - t0)
        decode.append(t2 - t1)
    return {"encode_ms": statistics.median(encode) * 1e3, "decode_ms": statistics.median(decode) * 1e3,
            "bytes": sum(len(x) for f in frames for x in f)}


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--prompt-lens", default="2048,16000")
    p.add_argument("--n", type=int, default=256)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--out")
    args = p.parse_args()
    rng = random.Random(0)
    rows = []
    for length in map(int, args.prompt_lens.split(",")):
        ids = [rng.randrange(100, 32000) for _ in range(length)]
        for way in WAYS:
            row = {"prompt_len": length, "n": args.n, "way": way, **transport_ms(children(ids, args.n, way), args.reps)}
            rows.append(row)
            print(f"P={length:6d} n={args.n} {way:6s} encode {row['encode_ms']:7.2f} ms  decode "
                  f"{row['decode_ms']:7.2f} ms  {row['bytes'] / 1e6:6.2f} MB", flush=True)
    if args.out:
        json.dump({"args": vars(args), "rows": rows}, open(args.out, "w"), indent=1)


if __name__ == "__main__":
    main()
