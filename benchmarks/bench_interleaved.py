"""Interleaved throughput runs: configurations measured in turn (A B A B ...) on warm engines.

Two runs of one configuration on one GPU can differ by 10-30% (a cold engine against a warm one,
one machine against another), more than the differences worth measuring between configurations
that should be equal (vLLM's default against the relay backend on plain traffic). Here every
configuration keeps its engine alive in its own process, all on the one GPU at once (each with
`--gpu-memory-utilization`, started one after the other so their memory profiles do not overlap),
and the driver runs the same workload on each in turn, `--rounds` times: whatever drifts (clocks,
the host, warm-up) falls on every configuration alike. Reported: every run, the median and the
spread per configuration, the ratio of medians and each round's ratio against the first config.
Each engine first serves 32 of the requests for 4 tokens (its one-off start-up costs), untimed, and
its prefix cache is reset before every round: each round sends the same requests to a cold cache, as
the first did (without the reset, later rounds find their prompts cached).

Configurations and workloads are bench_throughput.py's (`noprefix`, `noprefix-relay`, `default`,
`relay`, ...; `single`, `multi`). Usage (GPU host):
  python3 benchmarks/bench_interleaved.py --model DIR --configs noprefix,noprefix-relay --rounds 3 \
      --gpu-memory-utilization 0.45 --out results/plain_interleaved.json
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_throughput import engine_kwargs, sampling_params, select_runner, strip_system, workload  # noqa: E402


def worker(args):
    """One configuration's engine; answers each `run` line on stdin with one RUN line."""
    select_runner(args.worker)
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    systems, prompts, out_lens = workload(args, args.workload)
    if args.worker.startswith("noprefix"):
        prompts = strip_system(prompts, systems)
    llm = LLM(**engine_kwargs(args, args.worker, systems))
    params = sampling_params(out_lens)
    inputs = [TokensPrompt(prompt_token_ids=p) for p in prompts]
    # First requests of an engine pay one-off costs (allocator growth, lazy compilations): out of the rounds
    llm.generate(inputs[:32], SamplingParams(max_tokens=4, ignore_eos=True), use_tqdm=False)
    print("READY", flush=True)
    for line in sys.stdin:
        if line.strip() != "run":
            break
        llm.reset_prefix_cache()  # every round the same cold-cache workload (a registered prompt refills)
        t0 = time.perf_counter()
        outs = llm.generate(inputs, params, use_tqdm=False)
        elapsed = time.perf_counter() - t0
        tokens = sum(len(o.outputs[0].token_ids) for o in outs)
        print("RUN " + json.dumps({"elapsed_s": elapsed, "requests_per_s": len(inputs) / elapsed,
                                   "output_tokens": tokens}), flush=True)


class Engine:
    """A configuration's worker process and its log (everything it prints, kept beside --out)."""

    def __init__(self, args, config):
        self.config = config
        log = f"{os.path.splitext(args.out)[0]}.{config}.log" if args.out else os.devnull
        self.log = open(log, "w")
        cmd = [sys.executable, __file__, *sys.argv[1:], "--worker", config]
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.log,
                                     text=True, bufsize=1)
        self.expect("READY")

    def expect(self, tag: str) -> str:
        for line in self.proc.stdout:
            self.log.write(line)
            if line.startswith(tag):
                return line[len(tag):].strip()
        self.log.flush()
        raise RuntimeError(f"{self.config}: the worker exited (rc {self.proc.wait()}) before {tag}; "
                           f"see {self.log.name}")

    def run(self) -> dict:
        self.proc.stdin.write("run\n")
        return json.loads(self.expect("RUN"))

    def close(self):
        if self.proc.poll() is None:
            self.proc.stdin.close()
            self.proc.wait(timeout=120)
        self.log.close()


def summary(runs: dict[str, list[dict]]) -> dict:
    """Median and spread per configuration; ratios of medians and per round against the first."""
    configs = list(runs)
    rps = {c: [r["requests_per_s"] for r in runs[c]] for c in configs}
    out = {c: {"runs": rps[c], "median": statistics.median(rps[c]), "min": min(rps[c]), "max": max(rps[c])}
           for c in configs}
    base = configs[0]
    for c in configs[1:]:
        out[c]["median_over_" + base] = out[c]["median"] / out[base]["median"]
        out[c]["per_round_over_" + base] = [a / b for a, b in zip(rps[c], rps[base])]
    return out


def markdown(s: dict, args) -> str:
    configs = list(s)
    lines = [f"Requests/s, {args.rounds} interleaved rounds ({', '.join(configs)} in turn, warm engines at "
             f"gpu_memory_utilization {args.gpu_memory_utilization} each), workload {args.workload}.", "",
             "| config | " + " | ".join(f"round {i + 1}" for i in range(args.rounds)) + " | median | spread | "
             f"median / {configs[0]} |", "|---|" + "---|" * (args.rounds + 3)]
    for c in configs:
        ratio = s[c].get("median_over_" + configs[0])
        lines.append(f"| {c} | " + " | ".join(f"{x:.2f}" for x in s[c]["runs"]) + f" | {s[c]['median']:.2f} | "
                     f"{s[c]['min']:.2f}-{s[c]['max']:.2f} | " + (f"**{ratio:.3f}**" if ratio else "") + " |")
    for c in configs[1:]:
        lines.append(f"\nPer round, {c} / {configs[0]}: "
                     + ", ".join(f"{x:.3f}" for x in s[c]["per_round_over_" + configs[0]]))
    return "\n".join(lines) + "\n"


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", required=True)
    p.add_argument("--configs", default="noprefix,noprefix-relay")
    p.add_argument("--workload", default="single", help="single or multi (bench_throughput.py's)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--gpu-memory-utilization", type=float, default=0.45)
    p.add_argument("--prefix-len", type=int, default=2048)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=256)
    p.add_argument("--num-prompts", type=int, default=1000)
    p.add_argument("--max-model-len", type=int, default=4096)
    p.add_argument("--multi-system-lens", default="512,1024,2048,4096")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--iteration-details", action="store_true", help="vLLM's per-step log, in <out>.<config>.log")
    p.add_argument("--out")
    p.add_argument("--worker")
    args = p.parse_args(argv)
    # bench_throughput's engine_kwargs reads these; they stay at its defaults here
    args.tensor_parallel_size, args.shared_path, args.profile, args.max_cudagraph_capture_size = 1, None, None, None
    args.max_num_seqs = None
    return args


def main():
    args = parse_args()
    if args.worker:
        return worker(args)
    engines = []
    try:
        for config in args.configs.split(","):  # one after the other: each profiles memory alone
            engines.append(Engine(args, config))
        runs = {e.config: [] for e in engines}
        for i in range(args.rounds):
            for e in engines:
                runs[e.config].append(e.run())
                print(f"  round {i + 1} {e.config}: {runs[e.config][-1]['requests_per_s']:.2f} requests/s",
                      flush=True)
    finally:
        for e in engines:
            e.close()
    s = summary(runs)
    md = markdown(s, args)
    print(md)
    if args.out:
        json.dump({"args": vars(args), "runs": runs, "summary": s}, open(args.out, "w"), indent=1)
        open(os.path.splitext(args.out)[0] + ".md", "w").write(md)


if __name__ == "__main__":
    main()
