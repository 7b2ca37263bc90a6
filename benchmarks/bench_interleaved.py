"""Interleaved offline throughput: configurations measured in turn (A B A B ...) on warm engines.

Two runs of one configuration can differ by 10-30% (a cold engine against a warm one, one host against
another), more than the differences worth measuring between configurations that should be equal, such as
the relay backend with nothing registered against vLLM's default on traffic that shares nothing. So the
engines stay warm, each in its own process on the one GPU (`--gpu-memory-utilization` each, started one
after the other so that their memory profiles do not overlap), and the same requests run on each in turn,
`--rounds` times: whatever drifts falls on all alike. Each engine first serves the first 32 requests for 4
tokens, untimed (one-off start-up costs); its prefix cache is reset before every round (a cold cache each).
Configurations (`noprefix`, `noprefix-relay`, `default`, `relay`) and workloads (`single`, `multi`) are
bench_throughput.py's, from common.py. Workload `samples` is bench_sharing.py's: `--n` completions of one cold
prompt of `--prefix-len` tokens, a new prompt each round (the same on every engine), on `default` and `relay`
(nothing registered: its automatic levels find the prompt), in output tokens/s; a job of a second or less,
where one engine's runs alone differ by a quarter, so its ratio wants rounds. Printed as markdown; with
`--out`, JSON (markdown and engine logs beside it): every run, each configuration's median and spread, the
ratio of medians, each round's ratio against the first configuration, and what each sent (equal digests: the
same requests). Usage (GPU host):
  python3 benchmarks/bench_interleaved.py --model DIR --configs default,noprefix-relay --prefix-len 0 \
      --rounds 5 --gpu-memory-utilization 0.45 --out results/plain_interleaved.json
  python3 benchmarks/bench_interleaved.py --model DIR --workload samples --prefix-len 4096 --n 64 \
      --output-len 128 --max-model-len 4352 --configs default,relay --out results/samples_interleaved.json
"""

import argparse
import hashlib
import json
import os
import random
import statistics
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import (add_workload_args, engine_kwargs, model_config, prompt_vocab,  # noqa: E402
                    random_prompt, sampling_params, strip_system, worker_command, workload)

CONFIGS = ("noprefix", "noprefix-relay", "default", "relay")
SAMPLES_CONFIGS = ("default", "relay")
WARMUP = 32  # requests each engine serves (4 tokens each) before the rounds, untimed


def describe(prompts: list[list[int]], out_lens: list[int]) -> dict:
    """What a configuration sends, in short: two with the same digest send the same requests."""
    return {"requests": len(prompts), "prompt_tokens": sum(map(len, prompts)), "output_tokens": sum(out_lens),
            "digest": hashlib.sha256(json.dumps([prompts, out_lens]).encode()).hexdigest()[:16]}


def random_prompts(args, count: int, length: int, seed: int) -> list[list[int]]:
    """`count` prompts of `length` tokens (`common.random_prompt`), the r-th drawn from seed + r."""
    vocab = prompt_vocab(model_config(args.model))
    return [random_prompt(random.Random(seed + r), length, vocab) for r in range(count)]


def worker(args):
    """One configuration's engine: READY once warm, then one RUN line for each `run` line on stdin."""
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    if args.workload == "samples":
        # relay with nothing registered: the n samples' prompt is a level its planner finds each step
        config, systems = ("noprefix-relay" if args.worker == "relay" else args.worker), []
        prompts = random_prompts(args, args.rounds, args.prefix_len, args.seed + 1000)  # one a round
        out_lens = [args.n * args.output_len] * args.rounds  # each request's output tokens, its n samples'
        params = SamplingParams(n=args.n, temperature=1.0, top_p=1.0, ignore_eos=True,
                                max_tokens=args.output_len)
        warm = [TokensPrompt(prompt_token_ids=p) for p in random_prompts(args, 1, 64, args.seed + 999)]
        warm_params = SamplingParams(n=args.n, max_tokens=4, ignore_eos=True)
    else:
        systems, prompts, out_lens = workload(args, args.workload)
        if args.worker.startswith("noprefix"):  # the same requests without their system prompt
            prompts = strip_system(prompts, systems)
        config, params = args.worker, sampling_params(out_lens)
        warm = [TokensPrompt(prompt_token_ids=p) for p in prompts[:WARMUP]]
        warm_params = SamplingParams(max_tokens=4, ignore_eos=True)
    llm = LLM(**engine_kwargs(args, config, systems))
    inputs = [TokensPrompt(prompt_token_ids=p) for p in prompts]
    # An engine's first requests pay one-off costs (allocator growth, lazy compilations): out of the rounds
    llm.generate(warm, warm_params, use_tqdm=False)
    print("READY " + json.dumps(describe(prompts, out_lens)), flush=True)
    for i, line in enumerate(sys.stdin):
        if line.strip() != "run":
            break
        if not llm.reset_prefix_cache():  # every round a cold cache (a registered prompt refills)
            raise RuntimeError("reset_prefix_cache() failed before a round")
        batch = inputs[i:i + 1] if args.workload == "samples" else inputs
        t0 = time.perf_counter()
        outs = llm.generate(batch, params, use_tqdm=False)
        elapsed = time.perf_counter() - t0
        tokens = sum(len(c.token_ids) for o in outs for c in o.outputs)
        if args.workload == "samples" and tokens != out_lens[i]:  # its tokens/s would count what did not run
            raise RuntimeError(f"{args.worker}: {tokens} output tokens, not {args.n} x {args.output_len}")
        print("RUN " + json.dumps({"elapsed_s": elapsed, "requests_per_s": len(batch) / elapsed,
                                   "tokens_per_s": tokens / elapsed, "output_tokens": tokens}), flush=True)


class Engine:
    """A configuration's worker process, warm once started; everything it prints goes to its log."""

    def __init__(self, args, config: str):
        self.config = config
        self.log = open(f"{os.path.splitext(args.out)[0]}.{config}.log" if args.out else os.devnull, "w")
        self.proc = subprocess.Popen(worker_command(__file__, config), stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=self.log, text=True, bufsize=1)
        self.requests = json.loads(self.expect("READY"))

    def expect(self, tag: str) -> str:
        for line in self.proc.stdout:
            self.log.write(line)
            if line.startswith(tag + " "):
                return line[len(tag) + 1:]
        self.log.close()
        raise RuntimeError(f"{self.config}: the worker exited (rc {self.proc.wait()}) before {tag}; "
                           f"see {self.log.name}")

    def run(self) -> dict:
        self.proc.stdin.write("run\n")
        return json.loads(self.expect("RUN"))

    def close(self):
        if self.proc.poll() is None:
            self.proc.stdin.close()  # the worker's loop ends
            self.proc.wait(timeout=120)
        self.log.close()


def metric(workload_name: str) -> str:
    """What a workload's rounds are measured in: output tokens/s for samples, requests/s otherwise."""
    return "tokens_per_s" if workload_name == "samples" else "requests_per_s"


def summary(runs: dict[str, list[dict]], key: str = "requests_per_s") -> dict:
    """Per configuration its `key` (requests/s) per round, median, min, max and spread ((max - min) /
    median); for each configuration after the first, its median over the first's and each round's ratio."""
    rps = {c: [r[key] for r in rs] for c, rs in runs.items()}
    out = {c: {"runs": xs, "median": statistics.median(xs), "min": min(xs), "max": max(xs),
               "spread": (max(xs) - min(xs)) / statistics.median(xs)} for c, xs in rps.items()}
    base = next(iter(runs))
    for c in list(runs)[1:]:
        out[c]["median_over_" + base] = out[c]["median"] / out[base]["median"]
        out[c]["per_round_over_" + base] = [a / b for a, b in zip(rps[c], rps[base], strict=True)]
    return out


def markdown(s: dict, sent: dict[str, dict], workload_name: str, gpu_memory_utilization: float) -> str:
    """The summary's table, whether every configuration sent the same requests, and the ratios."""
    configs, base = list(s), next(iter(s))
    n = len(s[base]["runs"])
    unit = "Output tokens/s" if workload_name == "samples" else "Requests/s"
    lines = [f"{unit}, {n} interleaved rounds ({', '.join(configs)} in turn, warm engines at "
             f"gpu_memory_utilization {gpu_memory_utilization} each), workload {workload_name}.", "",
             "| config | " + "".join(f"round {i + 1} | " for i in range(n))
             + f"median | spread | median / {base} |", "|---|" + "---|" * (n + 3)]
    for c in configs:
        ratio = s[c].get("median_over_" + base)
        lines.append(f"| {c} | " + "".join(f"{x:.2f} | " for x in s[c]["runs"])
                     + f"{s[c]['median']:.2f} | {s[c]['min']:.2f}-{s[c]['max']:.2f} | "
                     + (f"**{ratio:.3f}** |" if ratio else "|"))
    same = len({d["digest"] for d in sent.values()}) == 1
    lines += ["", "Requests: " + ("the same on every configuration" if same else "not the same: " + "; ".join(
        f"{c} {d['requests']} requests, {d['prompt_tokens']} prompt tokens" for c, d in sent.items()))]
    for c in configs[1:]:  # last, where a glance at the end of the output finds them
        ratios = ", ".join(f"{x:.3f}" for x in s[c]["per_round_over_" + base])
        lines.append(f"{c} / {base}: median {s[c]['median_over_' + base]:.3f}, per round {ratios}")
    return "\n".join(lines) + "\n"


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_workload_args(p)
    p.add_argument("--configs", default="noprefix,noprefix-relay",
                   help=f"two or more of {', '.join(CONFIGS)}; the others are compared with the first")
    p.add_argument("--workload", default="single", choices=("single", "multi", "samples"))
    p.add_argument("--n", type=int, default=64, help="samples: the completions of each round's prompt")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--gpu-memory-utilization", type=float, default=0.45,
                   help="each engine's share of the GPU (all engines are up at once)")
    p.add_argument("--iteration-details", action="store_true", help="vLLM's per-step log, in the engine logs")
    p.add_argument("--out", help="the JSON; <out>.md and <out>.<config>.log beside it")
    p.add_argument("--worker", help=argparse.SUPPRESS)
    # The rest of what common.engine_kwargs reads: one GPU, vLLM's own defaults, no profiler
    p.set_defaults(tensor_parallel_size=1, max_num_seqs=None, max_cudagraph_capture_size=None,
                   shared_path=None, profile=None)
    args = p.parse_args(argv)
    configs = args.configs.split(",")
    if len(configs) < 2 or len(set(configs)) < len(configs) or not set(configs) <= set(CONFIGS):
        p.error(f"--configs: two or more different ones of {', '.join(CONFIGS)}, not {args.configs}")
    if args.workload == "samples" and not set(configs) <= set(SAMPLES_CONFIGS):
        p.error(f"--workload samples: configs of {', '.join(SAMPLES_CONFIGS)}, not {args.configs}")
    if args.workload == "samples" and (args.n < 1 or args.prefix_len < 2):
        p.error(f"--workload samples: --n at least 1 and --prefix-len at least 2, not {args.n} and "
                f"{args.prefix_len}")
    if args.rounds < 1:
        p.error(f"--rounds must be at least 1, not {args.rounds}")
    if len(configs) * args.gpu_memory_utilization > 1:
        p.error(f"{len(configs)} engines x --gpu-memory-utilization {args.gpu_memory_utilization} exceed the GPU")
    return args


def save(args, result: dict, md: str = "") -> None:
    """What is done so far (or all of it, with the summary) in `--out`, the markdown beside it."""
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"args": {k: v for k, v in vars(args).items() if k != "worker"}, **result}, f, indent=1)
        if md:
            with open(os.path.splitext(args.out)[0] + ".md", "w") as f:
                f.write(md)


def main():
    args = parse_args()
    if args.worker:
        return worker(args)
    engines, runs, key = [], {c: [] for c in args.configs.split(",")}, metric(args.workload)
    unit = key.replace("_per_s", "/s")
    try:
        for config in runs:  # one after the other: each profiles the GPU's memory alone
            engines.append(Engine(args, config))
            print(f"  {config}: ready, sends {engines[-1].requests}", flush=True)
        sent = {e.config: e.requests for e in engines}
        for i in range(args.rounds):
            for e in engines:
                runs[e.config].append(e.run())
                print(f"  round {i + 1} {e.config}: {runs[e.config][-1][key]:.2f} {unit}", flush=True)
            save(args, {"requests": sent, "runs": runs})  # keep what is done, whatever fails later
    finally:
        for e in engines:
            e.close()
    s = summary(runs, key)
    md = markdown(s, sent, args.workload, args.gpu_memory_utilization)
    print(md, end="")
    save(args, {"requests": sent, "runs": runs, "summary": s}, md)


if __name__ == "__main__":
    main()
