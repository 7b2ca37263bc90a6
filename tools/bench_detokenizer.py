"""The front end's detokenizer at a request's first token: vLLM's priming (the whole prompt) against a
relay front end's (the prompt's last 128 tokens, hooks/detokenizer.py), on the host's CPU.

For each prompt length P: a `FastIncrementalDetokenizer` made for a request of P random ids and fed
its first output token, as vLLM's output processor does when the first token of each of n samples
arrives. Median of --reps, in ms per request, and for n requests (the n samples of one prompt).
Usage: python3 tools/bench_detokenizer.py [--prompt-lens 1024,4096,16000] [--n 256] [--out F.json]
"""

import argparse
import json
import random
import statistics
import time


def first_token_ms(tok, prompt, reps: int) -> float:
    from vllm import SamplingParams
    from vllm.v1.engine import EngineCoreRequest
    from vllm.v1.engine.detokenizer import IncrementalDetokenizer

    req = EngineCoreRequest(request_id="r", prompt_token_ids=prompt, mm_features=None,
                            sampling_params=SamplingParams(), pooling_params=None, arrival_time=0.0,
                            lora_request=None, cache_salt=None, data_parallel_rank=None)
    times = []
    for i in range(reps):
        t0 = time.perf_counter()
        IncrementalDetokenizer.from_new_request(tok, req).update([500 + i], False)
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--prompt-lens", default="1024,4096,16000")
    p.add_argument("--n", type=int, default=256, help="requests of one prompt (the n samples)")
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--model", default="llama-2-7b-shape", help="a test model whose tokenizer to use")
    p.add_argument("--out")
    args = p.parse_args()
    from transformers import AutoTokenizer

    import vllm_relay
    from vllm_relay.hooks import detokenizer as hook
    from vllm_relay.testing.models import get_model

    vllm_relay.register()
    tok = AutoTokenizer.from_pretrained(get_model(args.model))
    rng = random.Random(0)
    rows = []
    for P in map(int, args.prompt_lens.split(",")):
        prompt = [1] + [rng.randrange(100, tok._tokenizer.get_vocab_size()) for _ in range(P - 1)]
        hook._enabled = False
        vllm = first_token_ms(tok, prompt, args.reps)
        hook._enabled = True
        relay = first_token_ms(tok, prompt, args.reps)
        rows.append({"P": P, "vllm_ms": vllm, "relay_ms": relay})
    print(f"| P | vLLM's priming, ms a request | relay's | for n={args.n}: vLLM's, s | relay's, s |")
    print("|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['P']} | {r['vllm_ms']:.2f} | {r['relay_ms']:.3f} | {r['vllm_ms'] * args.n / 1e3:.2f} | "
              f"{r['relay_ms'] * args.n / 1e3:.3f} |")
    if args.out:
        json.dump({"args": vars(args), "rows": rows}, open(args.out, "w"), indent=1)


if __name__ == "__main__":
    main()
