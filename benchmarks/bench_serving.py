"""Serving benchmark through the real OpenAI server: relay against vLLM's default server.

For each configuration, one server process is started (`vllm serve` on a GPU host, vLLM's
api_server module elsewhere) and streamed /v1/completions requests arrive as a Poisson process at
each rate in turn. The workload is a chat service: two system prompts of about 2k and 1k tokens
(token ids, registered with relay at start-up; ordinary cached prefixes for the default server),
20% of the requests without one, a random user part, and a fixed number of output tokens
(ignore_eos). Per rate: TTFT, TPOT (between the first and the last token of each request) and
end-to-end latency, p50 and p99, and the achieved request throughput.

  default      vLLM as it ships (prefix caching on, full and piecewise CUDA graphs)
  relay        --attention-backend relay with the two system prompts registered
  relay-plain  --attention-backend relay with nothing registered (with --plain-fraction 1: traffic
               sharing nothing)
  sglang       SGLang's OpenAI server (`python -m sglang.launch_server`: radix cache on, its default
               attention backend and CUDA graphs, PyTorch sampling, dummy weights) in the environment of
               `--sglang-env` (tools/gpu_host/sglang/install.sh); `--sglang-server-args` adds to it. Its
               server means are not read (vLLM's metrics only).

Per rate also the server's own means of vLLM's request phases (`server_mean_ms`: TTFT from the front
end's arrival, the queue in the engine core, prefill from scheduled to the first token, decode), from
its /metrics before and after the rate: where a TTFT difference between two servers goes.

With --rounds R > 1 the configurations are compared interleaved on one GPU: every server is started (one
after another, each with an equal share of the GPU's memory) and kept up, then R rounds run every rate on
each server in turn, the order reversed each round (A B, B A, ...). A row's figures are then the median
over the rounds of each round's figure, and "rounds" lists the rounds' own rows. With --restarts R > 1 each
round instead starts every server again, one at a time with the GPU to itself, the order reversed each
round: on a host-bound step (the first token of a request at a low rate) the host's speed differs from one
process to the next by more than the differences measured (up to 1.5x for the same code on the H200 host,
benchmarks/results/2026-12-04_h200_vllm033_first_token_host/), so a ratio needs several processes a side.
Writes {"model", "workload", "configs": {NAME: [{"rate", "ttft_ms": {"p50", "p99"}, "tpot_ms",
"e2e_ms", "req_per_s", "requests", "server_mean_ms"[, "rounds"]}]}} (the shape benchmarks/plot.py reads).
Usage (GPU host):
  python3 benchmarks/bench_serving.py --model DIR --rates 1,4,8,16,32 --duration 25 --out results.json
  python3 benchmarks/bench_serving.py --model DIR --rates 1,4,8 --duration 20 --rounds 2 --out results.json
  python3 benchmarks/bench_serving.py --model DIR --rates 1,4,8 --duration 15 --restarts 2 --out results.json
"""

import argparse
import asyncio
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import (check_config, free_port, gpu_share, has_gpu, model_config, prompt_vocab,  # noqa: E402
                    random_prompt, start_server, wait_healthy)


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", required=True)
    p.add_argument("--configs", default="default,relay")
    p.add_argument("--rates", default="1,4,8,16")
    p.add_argument("--duration", type=float, default=25.0, help="seconds of arrivals per rate")
    p.add_argument("--min-requests", type=int, default=20)
    p.add_argument("--system-lens", default="2048,1024")
    p.add_argument("--plain-fraction", type=float, default=0.2)
    p.add_argument("--user-len", default="64,192", help="min,max tokens of a request's own part")
    p.add_argument("--output-len", type=int, default=200)
    p.add_argument("--max-model-len", type=int, default=4096)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--server-args", default="", help="extra vLLM server arguments")
    p.add_argument("--sglang-env", default="/tmp/site-sglang/env.sh", help="the sglang configuration's "
                   "environment (written by tools/gpu_host/sglang/install.sh)")
    p.add_argument("--sglang-server-args", default="", help="extra SGLang server arguments")
    p.add_argument("--startup-timeout", type=float, default=900)
    p.add_argument("--rounds", type=int, default=1,
                   help="above 1: all servers up at once, every rate on each in turn, R times (A B, B A...)")
    p.add_argument("--restarts", type=int, default=1,
                   help="above 1: R rounds, each starting every server again, one at a time (A B, B A...)")
    p.add_argument("--out")
    return p.parse_args()


def make_workload(args):
    """(system prompts as token ids, a request generator) from a seed; token ids avoid the
    special tokens at the start of the vocabulary."""
    rng = random.Random(args.seed)
    vocab = prompt_vocab(model_config(args.model))
    systems = [random_prompt(rng, n, vocab) for n in map(int, args.system_lens.split(","))]
    lo, hi = map(int, args.user_len.split(","))

    def request(r: random.Random) -> list[int]:
        own = [r.randrange(100, vocab) for _ in range(r.randint(lo, hi))]
        if r.random() < args.plain_fraction:
            return [1] + own
        return r.choice(systems) + own

    return systems, request


async def one_request(session, base, prompt, output_len):
    """Stream one completion; returns (ttft, tpot, e2e) in seconds, or raises."""
    body = {"model": "m", "prompt": prompt, "max_tokens": output_len, "temperature": 0.0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}
    t0 = time.perf_counter()
    first = last = None
    tokens = 0
    async with session.post(f"{base}/v1/completions", json=body) as r:
        if r.status != 200:
            raise RuntimeError(f"HTTP {r.status}: {(await r.text())[:300]}")
        async for raw in r.content:
            line = raw.decode().strip()
            if not line.startswith("data:") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[5:])
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
            if chunk["choices"]:  # a token chunk (dummy weights may decode to empty text)
                now = time.perf_counter()
                first = first or now
                last = now
    if first is None or tokens != output_len:
        raise RuntimeError(f"streamed {tokens} of {output_len} tokens")
    # A chunk may carry several tokens when the server falls behind: time per token, not per chunk.
    tpot = (last - first) / max(tokens - 1, 1)
    return first - t0, tpot, last - t0


# vLLM's request-phase histograms (seconds; v1/metrics/loggers.py): where a request's TTFT went, the
# server's view. Per rate, the mean of each from its _sum and _count before and after the rate's requests.
PHASES = {"ttft": "vllm:time_to_first_token_seconds", "queue": "vllm:request_queue_time_seconds",
          "prefill": "vllm:request_prefill_time_seconds", "decode": "vllm:request_decode_time_seconds"}


def histogram_totals(text: str) -> dict:
    """{metric: (sum, count)} of the PHASES histograms in a Prometheus text page, over all label sets.

    Example:
        >>> page = chr(10).join(['vllm:request_queue_time_seconds_sum{engine="0"} 0.5', '# HELP x',
        ...                      'vllm:request_queue_time_seconds_count{engine="0"} 4.0'])
        >>> histogram_totals(page)["vllm:request_queue_time_seconds"]
        (0.5, 4.0)
    """
    totals = {m: [0.0, 0.0] for m in PHASES.values()}
    for line in text.splitlines():
        if line.startswith("#") or " " not in line:
            continue
        name, _, value = line.rpartition(" ")
        name = name.split("{", 1)[0]
        for suffix, i in (("_sum", 0), ("_count", 1)):
            metric = name.removesuffix(suffix)
            if name.endswith(suffix) and metric in totals:
                totals[metric][i] += float(value)
    return {m: tuple(v) for m, v in totals.items()}


def phase_means_ms(before: dict, after: dict) -> dict:
    """Each phase's mean over the requests finished between two `histogram_totals` (ms; None: none)."""
    out = {}
    for phase, metric in PHASES.items():
        n = after[metric][1] - before[metric][1]
        out[phase] = (after[metric][0] - before[metric][0]) / n * 1e3 if n > 0 else None
    return out


async def server_totals(session, base) -> dict:
    async with session.get(f"{base}/metrics") as r:
        return histogram_totals(await r.text())


def percentiles(xs):
    xs = sorted(xs)

    def q(p):
        return xs[min(len(xs) - 1, int(round(p * (len(xs) - 1))))] * 1e3

    return {"p50": q(0.5), "p99": q(0.99)}


async def run_rate(session, base, rate, args, request):
    rng = random.Random(args.seed * 1000 + int(rate * 10))
    n = max(args.min_requests, int(rate * args.duration))
    tasks, t = [], time.perf_counter()
    start = t
    for _ in range(n):
        tasks.append(asyncio.create_task(one_request(session, base, request(rng), args.output_len)))
        t += rng.expovariate(rate)
        await asyncio.sleep(max(0.0, t - time.perf_counter()))
    results = await asyncio.gather(*tasks, return_exceptions=True)
    elapsed = time.perf_counter() - start
    errors = [r for r in results if isinstance(r, BaseException)]
    if errors:
        raise RuntimeError(f"{len(errors)} of {n} requests failed at rate {rate}: {errors[0]}")
    ttft, tpot, e2e = zip(*results)
    return {"rate": rate, "requests": n, "req_per_s": n / elapsed, "ttft_ms": percentiles(ttft),
            "tpot_ms": percentiles(tpot), "e2e_ms": percentiles(e2e)}


class Server:
    """One configuration's server process, started on construction and up until `stop`."""

    def __init__(self, args, config, systems, log_dir, share=None, log_suffix=""):
        self.config, self.port = config, free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        self.proc, self.log = start_server(args, config, systems, self.port,
                                           os.path.join(log_dir, f"server_{config}{log_suffix}.log"), share)

    async def wait(self, session, args, request):
        t0 = time.monotonic()
        await wait_healthy(session, self.base, self.proc, args.startup_timeout)
        print(f"[{self.config}] healthy after {time.monotonic() - t0:.0f} s", flush=True)
        await one_request(session, self.base, request(random.Random(-1)), 8)  # warm-up

    def stop(self):
        os.killpg(self.proc.pid, signal.SIGTERM)
        try:
            self.proc.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.log.close()


async def run_rates(session, server, args, request):
    """Every rate on one server: the rows, with the server's phase means."""
    rows = []
    for rate in map(float, args.rates.split(",")):
        before = await server_totals(session, server.base)
        row = await run_rate(session, server.base, rate, args, request)
        row["server_mean_ms"] = phase_means_ms(before, await server_totals(session, server.base))
        rows.append(row)
        phases = ", ".join(f"{k} {v:.2f}" for k, v in row["server_mean_ms"].items() if v is not None)
        print(f"[{server.config}] rate {rate:5.1f}: {row['req_per_s']:.2f} req/s, TTFT p50 "
              f"{row['ttft_ms']['p50']:.1f} ms, TPOT p50 {row['tpot_ms']['p50']:.2f} ms "
              f"(p99 {row['tpot_ms']['p99']:.2f}), E2E p50 {row['e2e_ms']['p50']:.0f} ms; "
              f"server means (ms): {phases}", flush=True)
    return rows


def _median(xs):
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def alternating(configs: list[str], rounds: int) -> list[list[str]]:
    """Each round's order of the configurations: as given, then reversed, and so on.

    >>> alternating(["default", "relay"], 3)
    [['default', 'relay'], ['relay', 'default'], ['default', 'relay']]
    """
    return [list(configs) if r % 2 == 0 else list(configs)[::-1] for r in range(rounds)]


def merge_rounds(rounds: list[list[dict]]) -> list[dict]:
    """Per rate, each figure's median over the rounds' rows, the rounds' rows kept under "rounds".

    Example:
        >>> r = lambda t: [{"rate": 4.0, "requests": 10, "req_per_s": 3.9,
        ...                 "ttft_ms": {"p50": t, "p99": 2 * t}, "tpot_ms": {"p50": 5.0, "p99": 6.0},
        ...                 "e2e_ms": {"p50": 1e3, "p99": 1e3},
        ...                 "server_mean_ms": {"ttft": t, "queue": None}}]
        >>> row, = merge_rounds([r(20.0), r(22.0), r(30.0)])
        >>> row["ttft_ms"], row["server_mean_ms"], row["requests"], len(row["rounds"])
        ({'p50': 22.0, 'p99': 44.0}, {'ttft': 22.0, 'queue': None}, 30, 3)
    """
    merged = []
    for rows in zip(*rounds):
        row = {"rate": rows[0]["rate"], "requests": sum(r["requests"] for r in rows),
               "req_per_s": _median(r["req_per_s"] for r in rows)}
        for key in ("ttft_ms", "tpot_ms", "e2e_ms", "server_mean_ms"):
            row[key] = {k: _median(r[key][k] for r in rows) for k in rows[0][key]}
        row["rounds"] = list(rows)
        merged.append(row)
    return merged


async def bench(args, configs, systems, request, log_dir, save):
    """Each configuration's rows: one server at a time (--restarts R: started again in each of R rounds),
    or all up at once in rounds (--rounds R)."""
    import aiohttp

    timeout = aiohttp.ClientTimeout(total=None)
    together = args.rounds > 1
    share = gpu_share(args, len(configs)) if together and has_gpu() else None
    by_config, servers = {c: [] for c in configs}, []

    def merged():  # one round: its rows as they are
        return {c: rs[0] if args.restarts == 1 else merge_rounds(rs) for c, rs in by_config.items() if rs}

    async with aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=0)) as session:
        try:
            if not together:
                for r, order in enumerate(alternating(configs, args.restarts)):
                    for config in order:
                        if args.restarts > 1:
                            print(f"restart {r + 1}/{args.restarts}", end=" ", flush=True)
                        suffix = f"_{r + 1}" if args.restarts > 1 else ""
                        server = Server(args, config, systems, log_dir, log_suffix=suffix)
                        servers.append(server)
                        await server.wait(session, args, request)
                        by_config[config].append(await run_rates(session, server, args, request))
                        server.stop()
                        servers.remove(server)
                        save(merged())
                return merged()
            for config in configs:  # one after another: each profiles its memory with the others settled
                servers.append(Server(args, config, systems, log_dir, share))
                await servers[-1].wait(session, args, request)
            for r, order in enumerate(alternating(configs, args.rounds)):
                for server in sorted(servers, key=lambda s: order.index(s.config)):
                    print(f"round {r + 1}/{args.rounds}", end=" ", flush=True)
                    by_config[server.config].append(await run_rates(session, server, args, request))
                save({c: merge_rounds(rs) for c, rs in by_config.items()})
            return {c: merge_rounds(rs) for c, rs in by_config.items()}
        finally:
            for server in servers:
                server.stop()


def main():
    args = parse_args()
    configs = args.configs.split(",")
    for config in configs:  # an unknown name fails before any server starts
        check_config(config)
    if args.rounds < 1 or args.restarts < 1:
        raise ValueError(f"--rounds and --restarts must be at least 1, not {args.rounds} and {args.restarts}")
    if args.rounds > 1 and args.restarts > 1:
        raise ValueError("--rounds (servers kept up together) and --restarts (servers started again) are "
                         "two ways of repeating: give one")
    systems, request = make_workload(args)
    log_dir = os.path.dirname(os.path.abspath(args.out)) if args.out else "."
    out = {"model": os.path.basename(os.path.normpath(args.model)),
           "workload": {k: getattr(args, k) for k in ("system_lens", "plain_fraction", "user_len",
                                                       "output_len", "duration", "seed", "rounds", "restarts")},
           "configs": {}}

    def save(results):  # keep what is done, whatever fails later
        out["configs"] = dict(results)
        if args.out:
            with open(args.out, "w") as f:
                json.dump(out, f, indent=1)

    save(asyncio.run(bench(args, configs, systems, request, log_dir, save)))
    def ratio(a: dict, b: dict, key: str) -> str:
        return f"{a[key]['p50'] / b[key]['p50']:.3f}"

    for name in [c for c in out["configs"] if c.startswith("relay")] if "default" in out["configs"] else []:
        print(f"rate | TTFT p50 {name}/default | TPOT p50 {name}/default | E2E p50 {name}/default"
              + (" | TTFT, TPOT p50 ratios per round" if max(args.rounds, args.restarts) > 1 else ""))
        for d, r in zip(out["configs"]["default"], out["configs"][name]):
            pairs = zip(d["rounds"], r["rounds"]) if "rounds" in d else []
            per_round = ", ".join(ratio(rr, dr, "ttft_ms") + "/" + ratio(rr, dr, "tpot_ms")
                                  for dr, rr in pairs)
            ratios = " | ".join(ratio(r, d, key) for key in ("ttft_ms", "tpot_ms", "e2e_ms"))
            print(f"{d['rate']:5.1f} | {ratios}" + (f" | {per_round}" if per_round else ""))


if __name__ == "__main__":
    main()
