"""Where the first token goes, on the host: one engine (relay or vLLM's default) with its engine core in this
process (`VLLM_ENABLE_V1_MULTIPROCESSING=0`), so one cProfile sees the front end, the scheduler, the
KV-cache manager and the model runner together.

Each prompt is a warm system prompt of `--system-len` tokens (registered with relay, in the default's
prefix cache; none by default) and `--prefix-len` fresh random tokens. Timed: the first token of 1 and
of n completions of a new such prompt (the median of `--repeat` prompts each), then the n cases
again under cProfile. Prints both times, the scheduler's steps of the last timed n case (when each began, its
requests, the tokens it computed, the requests it admitted and the tokens these found computed), and
the functions of vLLM and relay with the most cumulative and the most own time. The GPU's work shows
as the runner's waits. With `--multiprocess` the engine core runs in its own process, as `LLM` and the
server run it (each request then also travels to it, serialized): the times only, no steps, and a
profile of the front end alone. Two uses:
  n samples of a cold prompt (the default): --prefix-len 16000 --n 256
  a chat request behind a system prompt, one at a time (serving at a low rate): --system-len 2048
      --prefix-len 128 --n 1 --repeat 20; with --background B, while B such requests decode (a server
      under load: each timed request's prefill shares its steps with their decodes; the engine stepped
      by hand)
Usage: python3 tools/profile_first_token.py --config relay [--model llama-2-7b-shape] [--prefix-len 16000]
         [--system-len 0] [--n 256] [--repeat 1] [--background 0] [--multiprocess] [--no-profile]
         [--out F.json]   (with a profile, F.json.pstats holds all of it: python3 -m pstats F.json.pstats)
"""

import argparse
import cProfile
import itertools
import json
import os
import pstats
import random
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))
from common import host_speed_us  # noqa: E402


def top(stats: pstats.Stats, key: int, k: int) -> list[dict]:
    """The k functions of vLLM and relay with the most time by `key` (2: own, 3: cumulative)."""
    rows = [(v[key], v[1], f"{os.sep.join(f[0].split(os.sep)[-3:])}:{f[1]}({f[2]})")
            for f, v in stats.stats.items() if "vllm" in f[0]]
    rows.sort(reverse=True)
    return [{"s": round(t, 4), "calls": n, "function": name} for t, n, name in rows[:k]]


def model_vocab(model: str) -> int:
    with open(os.path.join(model, "config.json")) as f:
        return json.load(f)["vocab_size"]


def record_steps(llm) -> list[dict]:
    """The scheduler's output of every step from now on (engine core in this process), appended to the
    returned list: its start time (perf_counter), requests, tokens computed, requests admitted and the
    tokens these found computed (prefix cache hits)."""
    scheduler = llm.llm_engine.engine_core.engine_core.scheduler
    schedule, steps = scheduler.schedule, []

    def recorded(*args, **kwargs):
        t = time.perf_counter()
        out = schedule(*args, **kwargs)
        new = out.scheduled_new_reqs
        steps.append({"t": t, "requests": len(out.num_scheduled_tokens),
                      "tokens": out.total_num_scheduled_tokens, "admitted": len(new),
                      "cached": sum(r.num_computed_tokens for r in new)})
        return out

    scheduler.schedule = recorded
    return steps


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--config", choices=("relay", "default"), required=True)
    p.add_argument("--model", default="llama-2-7b-shape", help="a folder, or a model of vllm_relay.testing")
    p.add_argument("--prefix-len", type=int, default=16000)
    p.add_argument("--system-len", type=int, default=0, help="a warm system prompt in front of every prompt")
    p.add_argument("--n", type=int, default=256)
    p.add_argument("--repeat", type=int, default=1, help="prompts timed for each first-token time (median)")
    p.add_argument("--background", type=int, default=0, help="requests decoding while each one is timed")
    p.add_argument("--multiprocess", action="store_true", help="the engine core in its own process")
    p.add_argument("--no-profile", action="store_true", help="the times only, no cProfile runs")
    p.add_argument("--max-model-len", type=int, default=16384)
    p.add_argument("--block-size", type=int)
    p.add_argument("--top", type=int, default=30)
    p.add_argument("--out")
    args = p.parse_args()
    if args.prefix_len < 1 or args.system_len < 0 or args.n < 1 or args.repeat < 1 or args.background < 0:
        p.error("--prefix-len, --n and --repeat must be positive, --system-len and --background not negative")
    # the engine core in this process, under the profiler, unless --multiprocess
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1" if args.multiprocess else "0"
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt
    from vllm.sampling_params import RequestOutputKind

    from vllm_relay.testing.models import get_model

    model = args.model if os.path.isdir(args.model) else get_model(args.model)
    kw = dict(model=model, load_format="dummy", max_model_len=args.max_model_len, seed=0)
    if args.block_size:
        kw["block_size"] = args.block_size
    rng = random.Random(0)
    vocab = model_vocab(model)
    system = [1] + [rng.randrange(100, vocab) for _ in range(args.system_len - 1)] if args.system_len else []
    if args.config == "relay":
        kw["attention_backend"] = "relay"
        if system:
            kw["additional_config"] = {"relay": {"system_prompts": {"system": system}}}
    llm = LLM(**kw)
    steps = [] if args.multiprocess else record_steps(llm)

    def new_prompt():
        ids = system + [rng.randrange(100, vocab) for _ in range(args.prefix_len)]
        return TokensPrompt(prompt_token_ids=ids if system else [1] + ids[1:])

    def first_token_s(n: int) -> float:
        prompt, params = new_prompt(), SamplingParams(n=n, max_tokens=1, ignore_eos=True)
        t0 = time.perf_counter()
        outs = stepped(prompt, params) if background else llm.generate([prompt], params, use_tqdm=False)
        elapsed = time.perf_counter() - t0
        if sum(len(c.token_ids) for o in outs for c in o.outputs) != n:
            raise RuntimeError(f"{args.config}: fewer than {n} first tokens")
        return elapsed

    def stepped(prompt, params) -> list:
        """`prompt`'s outputs, the engine stepped by hand while the background requests decode."""
        params.output_kind = RequestOutputKind.FINAL_ONLY
        rid = f"timed-{next(timed)}"
        llm.llm_engine.add_request(rid, prompt, params)
        while True:
            done = [out for out in llm.llm_engine.step() if out.request_id == rid and out.finished]
            if done:
                return done

    background, timed = [], itertools.count()
    first_token_s(args.n)  # warm-up: graphs, compilation, the allocator at this size (and the system prompt)
    if args.background:  # decoding until aborted at the end (as many tokens as fit)
        params = SamplingParams(max_tokens=args.max_model_len - len(system) - args.prefix_len,
                                ignore_eos=True, output_kind=RequestOutputKind.FINAL_ONLY)
        for i in range(args.background):
            background.append(f"background-{i}")
            llm.llm_engine.add_request(background[-1], new_prompt(), params)
        for _ in range(4):  # admitted and decoding
            llm.llm_engine.step()
    speed = [host_speed_us()]
    times = {"1": statistics.median(first_token_s(1) for _ in range(args.repeat))}
    runs = []
    for _ in range(args.repeat):
        steps.clear()
        t0 = time.perf_counter()
        runs.append(first_token_s(args.n))
    times[str(args.n)] = statistics.median(runs)
    n_steps = [dict(s, t=round((s["t"] - t0) * 1e3, 2)) for s in steps if s["tokens"]]  # t: ms from the call
    speed.append(host_speed_us())
    profiled = stats = None
    if not args.no_profile:
        prof = cProfile.Profile()
        prof.enable()
        profiled = statistics.mean(first_token_s(args.n) for _ in range(args.repeat))  # all of them profiled
        prof.disable()
        stats = pstats.Stats(prof)
    if background:
        llm.llm_engine.abort_request(background)
    result = {"config": args.config, "multiprocess": args.multiprocess, "background": args.background,
              "prefix_len": args.prefix_len, "system_len": args.system_len, "n": args.n,
              "repeat": args.repeat, "first_token_s": times, "host_speed_us": speed,
              "cpus": len(os.sched_getaffinity(0)),
              "steps": n_steps, "profiled_s": profiled, "cumulative": stats and top(stats, 3, args.top),
              "own": stats and top(stats, 2, args.top)}
    t1, tn = times["1"], times[str(args.n)]
    print(f"{args.config}: system {args.system_len}, P={args.prefix_len}, {args.background} decoding, "
          f"first token of 1: {t1 * 1e3:.2f} ms, of {args.n}: {tn * 1e3:.2f} ms "
          f"({tn / t1:.2f}x; medians of {args.repeat})"
          + ("" if profiled is None else f"; under cProfile {profiled * 1e3:.2f} ms (mean)")
          + f"; host speed {speed[0]:.0f} / {speed[1]:.0f} us (before / after)")
    if not args.multiprocess:
        print(f"\nsteps of the first token of {args.n} (ms from the call; requests, tokens computed, "
              "admitted, their cached tokens):")
    for r in n_steps:
        print(f"  {r['t']:9.2f} {r['requests']:6d} {r['tokens']:7d} {r['admitted']:6d} {r['cached']:8d}")
    for what in ("cumulative", "own") if stats else ():
        print(f"\n{what} time, s (calls):")
        for r in result[what]:
            print(f"  {r['s']:8.4f} {r['calls']:>8}  {r['function']}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
        if stats:
            stats.dump_stats(args.out + ".pstats")


if __name__ == "__main__":
    main()
