"""The transport of n samples of one prompt from the front end to the engine core: vLLM's against a relay
engine's (`vllm_relay/hooks/transport.py`: a prompt sent right after itself goes as a reference), on the
host's CPU.

vLLM fans a request with n > 1 out in the front end: each child request travels to the engine core on its
own, encoded by the front end and decoded by the engine core's input thread with vLLM's msgpack codec
(`vllm.v1.serial_utils`), each with its own copy of the prompt's ids. Relay's front end sends the first
child's prompt and marks the others as references (`outgoing`), and the engine core gives them the prompt
back (`engine/requests.py`'s `SentPrompts.resolve`). Timed here: ms for all n children of a P-token
prompt (median of --reps), encoding (front end) and decoding (engine core) apart, and the same for n
children of a one-token prompt (what n requests cost whatever their prompts).
Usage: python3 tools/bench_request_transport.py [--prompt-lens 2048,16000] [--n 256] [--out F.json]
"""

import argparse
import copy
import json
import random
import statistics
import time


def children(ids: list, n: int) -> list:
    """The n child requests of one request with prompt `ids` as vLLM's front end makes them (shallow
    copies: one prompt list)."""
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
        reqs.append(child)
    return reqs


class _Client:  # a front-end client (relay's front end remembers what it sent each one's engines)
    pass


def transport_ms(reqs: list, relay: bool, reps: int) -> dict:
    """Median ms to send all of `reqs` (relay's `outgoing`, then encoding) and to receive them (decoding,
    then relay's `SentPrompts.resolve`); the prompts received are checked against those sent."""
    from vllm.v1.engine import EngineCoreRequest
    from vllm.v1.serial_utils import MsgpackDecoder, MsgpackEncoder

    from vllm_relay.engine.requests import SentPrompts
    from vllm_relay.hooks.transport import outgoing

    enc, dec = MsgpackEncoder(), MsgpackDecoder(EngineCoreRequest)
    send, receive = [], []
    for _ in range(reps):
        client, prompts = _Client(), SentPrompts()  # a fresh front end and engine core each round
        t0 = time.perf_counter()
        frames = [enc.encode(outgoing(client, r, 0) if relay else r) for r in reqs]
        t1 = time.perf_counter()
        got = [prompts.resolve(dec.decode(f)) if relay else dec.decode(f) for f in frames]
        t2 = time.perf_counter()
        send.append(t1 - t0)
        receive.append(t2 - t1)
        assert all(g.prompt_token_ids == r.prompt_token_ids for g, r in zip(got, reqs, strict=True))
    return {"send_ms": statistics.median(send) * 1e3, "receive_ms": statistics.median(receive) * 1e3,
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
    for length in [1, *map(int, args.prompt_lens.split(","))]:
        reqs = children([rng.randrange(100, 32000) for _ in range(length)], args.n)
        for side in ("vllm", "relay"):
            row = {"prompt_len": length, "n": args.n, "side": side, **transport_ms(reqs, side == "relay", args.reps)}
            rows.append(row)
            print(f"P={length:6d} n={args.n} {side:5s} send {row['send_ms']:7.2f} ms  receive "
                  f"{row['receive_ms']:7.2f} ms  {row['bytes'] / 1e6:6.2f} MB", flush=True)
    if args.out:
        json.dump({"args": vars(args), "rows": rows}, open(args.out, "w"), indent=1)


if __name__ == "__main__":
    main()
