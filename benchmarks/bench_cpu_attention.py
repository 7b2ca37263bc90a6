"""Attention time on the CPU: the relay backend against vLLM's own CPU backend, same workload.

Each configuration runs in a fresh process with the engine in-process, so the attention layers'
calls can be timed where they run: every `forward` and `do_kv_cache_update` of the backend's
AttentionImpl (the whole attention of a layer: relay's context call, its levels and fusion; vLLM's
CPU kernels) is wrapped with a timer. The workload: `--requests` greedy requests, each a shared
system prompt of `--system` tokens and `--own` tokens of its own, `--max-tokens` answered, on the
tiny GQA test model in fp32; relay with the prompt registered ("relay"), and with nothing
registered (its levels find the prompt in vLLM's prefix cache: "relay-unregistered"); vLLM's
"CPU_ATTN" with prefix caching (its default). Configurations run interleaved, `--repeats` times;
the table shows medians (attention seconds, engine seconds) and relay's ratio to CPU_ATTN.
Usage: python benchmarks/bench_cpu_attention.py [--repeats 3] [--out DIR]
"""

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time

CONFIGS = ("CPU_ATTN", "relay", "relay-unregistered")


def workload(args, vocab: int):
    import random

    rng = random.Random(0)
    system = [1] + [rng.randrange(8, vocab) for _ in range(args.system - 1)]
    return system, [system + [rng.randrange(8, vocab) for _ in range(args.own)] for _ in range(args.requests)]


def run_one(config: str, args) -> dict:
    """One engine, in this process: attention and engine seconds of the workload."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    from pathlib import Path

    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    from vllm_relay.testing.models import get_model

    model = get_model("tiny-llama-gqa")
    vocab = json.loads((Path(model) / "config.json").read_text())["vocab_size"]
    system, prompts = workload(args, vocab)
    engine = {"model": model, "dtype": "float32", "enforce_eager": True, "seed": 0, "block_size": 16,
              "max_model_len": 1024, "max_num_seqs": args.requests}
    if config == "CPU_ATTN":
        engine["attention_backend"] = "CPU_ATTN"
        from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackendImpl as Impl
    else:
        engine["attention_backend"] = "relay"
        relay = {"shared_path": args.shared_path}
        if config == "relay":
            relay["system_prompts"] = {"s": system}
        engine["additional_config"] = {"relay": relay}
        from vllm_relay.attention.cpu_backend import RelayCPUImpl as Impl
    spent = [0.0]

    def timed(fn):
        def wrapper(*a, **k):
            t0 = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                spent[0] += time.perf_counter() - t0
        return wrapper

    Impl.forward = timed(Impl.forward)
    Impl.do_kv_cache_update = timed(Impl.do_kv_cache_update)
    llm = LLM(**engine)
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    llm.generate([TokensPrompt(prompt_token_ids=prompts[0])], params, use_tqdm=False)  # warm-up
    spent[0] = 0.0
    t0 = time.perf_counter()
    outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)
    engine_s = time.perf_counter() - t0
    assert all(len(o.outputs[0].token_ids) == args.max_tokens for o in outs)
    return {"config": config, "attention_s": spent[0], "engine_s": engine_s}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--requests", type=int, default=64)
    p.add_argument("--system", type=int, default=512)
    p.add_argument("--own", type=int, default=32)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--shared-path", default="auto", choices=("auto", "always", "never"),
                   help="relay's shared_path setting (auto: the planner's measured rule)")
    p.add_argument("--one", choices=CONFIGS, help=argparse.SUPPRESS)  # a child process's configuration
    p.add_argument("--out", help="a folder for cpu_attention.json and cpu_attention.md")
    args = p.parse_args()
    if args.one:
        return print("RESULT " + json.dumps(run_one(args.one, args)))
    runs = {c: [] for c in CONFIGS}
    for _ in range(args.repeats):
        for config in CONFIGS:
            cmd = [sys.executable, __file__, "--one", config] + [
                f"--{k}={getattr(args, k.replace('-', '_'))}"
                for k in ("requests", "system", "own", "max-tokens", "shared-path")]
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
            line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")), None)
            if proc.returncode != 0 or line is None:
                sys.exit(f"{config} failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
            runs[config].append(json.loads(line[len("RESULT "):]))
    med = {c: {k: statistics.median(r[k] for r in rs) for k in ("attention_s", "engine_s")} for c, rs in runs.items()}
    base = med["CPU_ATTN"]["attention_s"]
    lines = [f"CPU attention, {args.requests} requests x ({args.system} shared + {args.own} own tokens), "
             f"{args.max_tokens} answered; tiny-llama-gqa fp32; {platform.processor() or platform.machine()}, "
             f"{os.cpu_count()} cores; medians of {args.repeats}",
             "", "| configuration | attention s | engine s | attention vs CPU_ATTN |", "|---|---|---|---|"]
    for c in CONFIGS:
        lines.append(f"| {c} | {med[c]['attention_s']:.2f} | {med[c]['engine_s']:.2f} | "
                     f"{med[c]['attention_s'] / base:.2f}x |")
    print("\n".join(lines))
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        json.dump({"args": vars(args), "runs": runs, "medians": med}, open(f"{args.out}/cpu_attention.json", "w"),
                  indent=1)
        open(f"{args.out}/cpu_attention.md", "w").write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
