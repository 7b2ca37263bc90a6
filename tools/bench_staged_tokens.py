"""Model Runner V2's staging of a step's new requests' token ids: vLLM's list against a relay engine's
`StagedChunks` (`vllm_relay/hooks/staged_tokens.py`), on the host's CPU.

The runner extends one list with each new request's ids and numpy converts it into the UVA buffer when
the step's writes are applied. Timed here, ms for the whole step (stage every request, then convert
into an int32 buffer as `copy_to_uva` does), median of --reps, for n requests of P tokens:
  samples   n samples of one prompt, their lists made of the same int objects, as they reach the runner
            (vLLM's front end gives the n children one prompt list; relay's transport sends it once)
  plain     n unrelated prompts (nothing to share: what other traffic pays)
Usage: python3 tools/bench_staged_tokens.py [--prompt-lens 2048,16000] [--n 256] [--out F.json]
"""

import argparse
import json
import pickle
import random
import statistics
import time

import numpy as np

KINDS = ("samples", "plain")


def requests(kind: str, length: int, n: int, rng: random.Random) -> list:
    """The n requests' token lists as the runner receives them."""
    if kind == "samples":
        prompt = [rng.randrange(100, 32000) for _ in range(length)]
        return [list(prompt) for _ in range(n)]  # equal lists of the same int objects
    return [pickle.loads(pickle.dumps([rng.randrange(100, 32000) for _ in range(length)])) for _ in range(n)]


def step_ms(lists: list, make, reps: int) -> float:
    """Median ms to stage `lists` into `make()` and convert them into an int32 buffer."""
    buf = np.zeros(sum(map(len, lists)) + len(lists), dtype=np.int32)
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        contents = make()
        for ids in lists:
            contents.extend(ids)
            contents.append(len(ids))  # the runner stages single values beside them (total lengths)
        buf[: len(contents)] = contents
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--prompt-lens", default="2048,16000")
    p.add_argument("--n", type=int, default=256)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--out")
    args = p.parse_args()
    from vllm_relay.hooks.staged_tokens import StagedChunks

    rows = []
    for length in map(int, args.prompt_lens.split(",")):
        for kind in KINDS:
            lists = requests(kind, length, args.n, random.Random(length))
            chunks = StagedChunks(np.int32)  # one for every step, cleared after each, as the runner keeps it

            def cleared(chunks=chunks):
                chunks.clear()
                return chunks

            row = {"prompt_len": length, "n": args.n, "kind": kind, "vllm_ms": step_ms(lists, list, args.reps),
                   "relay_ms": step_ms(lists, cleared, args.reps)}
            rows.append(row)
            print(f"P={length:6d} n={args.n} {kind:8s} vLLM {row['vllm_ms']:8.2f} ms  relay "
                  f"{row['relay_ms']:8.2f} ms a step", flush=True)
    if args.out:
        json.dump({"args": vars(args), "rows": rows}, open(args.out, "w"), indent=1)


if __name__ == "__main__":
    main()
