"""End-to-end offline throughput: relay against vLLM's default, on vLLM's random-dataset workload.

Workloads (`--workloads`, several run one after the other on the same engine):
  single  every request shares one random P-token prefix (the system prompt) followed by its own
          tokens, exactly as `vllm bench throughput --dataset-name random --random-prefix-len P`
          builds them: vLLM's own `RandomDataset`, tokenized as the engine would;
  multi   four system prompts of 512, 1024, 2048 and 4096 tokens and 20% plain requests, each
          request with 64-256 own tokens and 128-384 output tokens (random ids, seeded).
`--latency` also measures decode steps on the same engine: B requests behind the single workload's
system prompt (128 own tokens), ms per decode step = (time of 1 + N tokens - time of 1 token) / N,
for B in 1..256. Each configuration runs in its own process (a fresh engine, its own GPU memory):

  default   vLLM as it ships (prefix caching on, Model Runner V2), full prompts
  relay     --attention-backend relay with the shared prefix registered up front as a system prompt
  noprefix  the same requests with no system prompt at all (P = 0): the target's reference
  noprefix-relay  the same, with --attention-backend relay and nothing registered: what relay costs
            traffic it cannot help
  bench     `vllm bench throughput` itself, for the default configuration (cross-check of this driver)
  sglang    SGLang's offline `Engine` on the same token ids (RadixAttention on, its default attention
            backend and CUDA graphs, dummy weights), in the environment of `--sglang-env` (the
            `env.sh` of tools/gpu_host/sglang/install.sh), sampling as the others do

`--repeat K` runs each workload K times on the same engine, the prefix cache reset before each
repeat (the same prompts again would hit it; relay then fills its prompts again), the first run
staying the headline figure. Each run lists the Triton kernels compiled inside it (start-up work
leaking into the measurement, `common.compiled_during`); `--triton-cache DIR` gives each configuration
a fresh Triton cache, so that kernels a warm cache would load are compiled, and seen, too.
With `relay` and `noprefix` in one job (on a GPU), the summary also gives the least time any engine on
vLLM can take for the single workload: the no-prompt run's time plus the system prompt's attention in
relay's run (each query token it scheduled, drafts included, against every prompt key, at the card's
matmul rate: `prompt_attention`), and what that allows against the default.
`--accuracy` instead compares relay with FLASH_ATTN on the same full prompts (greedy, top-5
logprobs over the first 8 generated tokens). `--tensor-parallel-size N` runs every configuration
over N GPUs (data parallelism is a serving feature: vllm.LLM refuses it). Usage (GPU host):
  python3 benchmarks/bench_throughput.py --model DIR --prefix-len 2048 --num-prompts 1000 \
      --max-model-len 4096 --configs default,relay --out results.json
"""

import argparse
import json
import os
import re
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import (add_sglang_args, add_workload_args, attention_shape, compiled_during,  # noqa: E402
                    decode_span_s, engine_kwargs, has_gpu, jit_compiled, measure_card, model_config,
                    prompt_vocab, result_line, run_logged, sampling_params, sglang_command, sglang_engine,
                    sglang_sampling, strip_system, worker_command, workload)


def decode_latency(llm, system_ids, args):
    """ms per decode step at each batch size, behind `system_ids` (or none), 128 own tokens each:
    B requests start together and decode 1 + N tokens; a request's step time is the engine's
    (last token - first token) / N, so prefill is excluded; the median over the B requests."""
    import random

    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    rng = random.Random(args.seed + 2)
    vocab = prompt_vocab(model_config(args.model))
    rows, steps = [], args.latency_steps
    for B in map(int, args.latency_batches.split(",")):
        prompts = [TokensPrompt(prompt_token_ids=system_ids + [rng.randrange(100, vocab) for _ in range(128)])
                   for _ in range(B)]
        params = SamplingParams(temperature=0.0, max_tokens=1 + steps, ignore_eos=True)
        llm.generate(prompts[:1], SamplingParams(max_tokens=4, ignore_eos=True), use_tqdm=False)  # warm-up
        outs = llm.generate(prompts, params, use_tqdm=False)
        span = decode_span_s(outs)
        if span is None:
            raise RuntimeError("decode latency: vLLM's requests carry no token timestamps (its stats are off)")
        rows.append({"batch": B, "ms_per_step": span / steps * 1e3})
        print(f"  latency B={B:4d}: {rows[-1]['ms_per_step']:.2f} ms/step", flush=True)
    return rows


ALLOCATOR_KEYS = ("num_alloc_retries", "num_ooms", "num_sync_all_streams", "num_device_alloc", "num_device_free")


def allocator_stats(_worker=None) -> dict:
    """A worker's CUDA caching-allocator events so far ({} without CUDA). A retry frees cached
    blocks and synchronises the device: the GPU idles while the host catches up."""
    import torch

    if not (torch.cuda.is_available() and torch.cuda.is_initialized()):
        return {}
    stats = torch.cuda.memory_stats()
    return {k: stats.get(k, 0) for k in ALLOCATOR_KEYS}


def sglang_worker(args):
    """The `sglang` configuration in this process (SGLang's environment); prints one JSON line.
    The workloads are the same token ids (built with vLLM's `RandomDataset`, importable there: SGLang's
    bundle runs over vLLM's site), sampled as `sampling_params` does; the radix cache is flushed
    before each repeat."""
    names = args.workloads.split(",")
    kw = {}
    if args.gpu_memory_utilization:
        kw["mem_fraction_static"] = args.gpu_memory_utilization
    if args.max_num_seqs:
        kw["max_running_requests"] = args.max_num_seqs
    engine, kw = sglang_engine(args, **kw)
    result = {"config": args.worker, "engine_args": kw}
    with open(args.requests_file) as f:
        loads = json.load(f)
    for name in names:
        systems, prompts, out_lens = loads[name]
        params = [sglang_sampling(n) for n in out_lens]
        runs = []
        for i in range(args.repeat):
            if i and not engine.flush_cache().success:
                raise RuntimeError("flush_cache() failed before a repeat run")
            t0 = time.perf_counter()
            outs = engine.generate(input_ids=prompts, sampling_params=params)
            runs.append(time.perf_counter() - t0)
        r = {"requests": len(prompts), "elapsed_s": runs[0], "requests_per_s": len(prompts) / runs[0],
             "system_lens": [len(x) for x in systems], "prompt_tokens": sum(map(len, prompts)),
             "output_tokens": sum(o["meta_info"]["completion_tokens"] for o in outs),
             "cached_tokens": sum(o["meta_info"].get("cached_tokens", 0) for o in outs),
             "runs_requests_per_s": [len(prompts) / x for x in runs]}
        if r["output_tokens"] != sum(out_lens):
            raise RuntimeError(f"SGLang generated {r['output_tokens']} tokens, not the {sum(out_lens)} "
                               "asked for")
        result[name] = r
        rates = ", ".join(f"{x:.2f}" for x in r["runs_requests_per_s"])
        print(f"  {args.worker} {name}: {rates} requests/s; {r['cached_tokens']} of {r['prompt_tokens']} "
              "prompt tokens from the radix cache", flush=True)
    engine.shutdown()
    print("RESULT " + json.dumps(result), flush=True)


def worker(args):
    """One configuration in this process; prints one JSON line."""
    if args.worker == "sglang":
        return sglang_worker(args)
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    names = args.workloads.split(",")
    loads = {name: workload(args, name) for name in names}
    systems = [s for name in names for s in loads[name][0]]
    accuracy = args.worker.startswith("accuracy")
    llm = LLM(**engine_kwargs(args, args.worker, systems))
    result = {"config": args.worker}
    relayed = 0
    for name in names:
        load_systems, prompts, out_lens = loads[name]
        if args.worker.startswith("noprefix"):  # the same requests without their system prompts
            prompts = strip_system(prompts, load_systems)
        if accuracy:
            prompts, out_lens = prompts[:64], [8] * 64
        if accuracy:
            params = SamplingParams(temperature=0.0, max_tokens=8, logprobs=5, ignore_eos=True)
        else:
            params = sampling_params(out_lens)
        runs = []  # the first run is what `vllm bench throughput` measures; repeats show the warm engine
        for i in range(1 if accuracy else args.repeat):
            if i and not llm.reset_prefix_cache():  # a repeat sends the same prompts: none may be cached
                raise RuntimeError("reset_prefix_cache() failed before a repeat run")
            tokens0 = scheduled_relay_tokens(llm, args.worker)
            profiling = args.profile and i == 0 and name == names[0]
            if profiling:  # (outside the timed span; the profiler itself slows the steps it records)
                llm.start_profile()
            t0, wall0, preempted = time.perf_counter(), time.time(), preemptions(llm)
            outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)
            runs.append({"elapsed_s": time.perf_counter() - t0, "wall": [wall0, time.time()],
                         "preemptions": preemptions(llm) - preempted,
                         "relay_tokens": scheduled_relay_tokens(llm, args.worker) - tokens0})
            if profiling:
                llm.stop_profile()
        elapsed = runs[0]["elapsed_s"]
        r = {"requests": len(prompts), "elapsed_s": elapsed, "requests_per_s": len(prompts) / elapsed,
             "system_lens": [len(s) for s in load_systems], "prompt_tokens": sum(map(len, prompts)),
             "output_tokens": sum(len(o.outputs[0].token_ids) for o in outs),
             "runs_requests_per_s": [len(prompts) / x["elapsed_s"] for x in runs],
             "runs_preemptions": [x["preemptions"] for x in runs]}
        if args.worker == "relay":  # the query tokens relay computed in each run (prompt chunks, drafts too)
            r["runs_relay_tokens"] = [x["relay_tokens"] for x in runs]
        r["triton_compiled"] = [compiled_during(*x["wall"]) for x in runs]
        relayed += sum(1 for p in prompts if any(p[: len(s)] == s and len(p) > len(s) for s in load_systems))
        if accuracy:
            r["outputs"] = [[list(o.outputs[0].token_ids),
                             [{str(k): v.logprob for k, v in s.items()} for s in o.outputs[0].logprobs]]
                            for o in outs]
        result[name] = r
        print(f"  {args.worker} {name}: {', '.join(f'{x:.2f}' for x in r['runs_requests_per_s'])} requests/s; "
              f"preemptions {r['runs_preemptions']}; Triton kernels compiled during the runs: "
              f"{r['triton_compiled']}", flush=True)
    result["allocator"] = llm.collective_rpc(allocator_stats)
    print(f"  {args.worker} allocator: {result['allocator']}", flush=True)
    if args.latency and not accuracy:
        system_ids = [] if args.worker.startswith("noprefix") else loads[names[0]][0][0]
        result["latency"] = decode_latency(llm, system_ids, args)
    if args.worker in ("relay", "accuracy-relay", "noprefix-relay"):
        from vllm_relay.stats import planner_stats

        result["planner_stats"] = planner_stats(llm)  # steps planned, graph steps, levels, rows
    if args.worker in ("relay", "accuracy-relay"):
        from vllm_relay.stats import relay_stats

        result["relay_stats"] = relay_stats(llm)
        if result["relay_stats"]["relay_requests"] < relayed:
            raise RuntimeError(f"relay served only {result['relay_stats']['relay_requests']} of the "
                               f"{relayed} requests behind a system prompt: they were not routed")
    print("RESULT " + json.dumps(result), flush=True)


def scheduled_relay_tokens(llm, config: str) -> int:
    """The query tokens a relay engine has scheduled for requests on a registered prompt so far (0 for
    other configurations): each attends to all of its system prompt's keys."""
    if config != "relay":
        return 0
    from vllm_relay.stats import relay_stats

    return relay_stats(llm)["relay_tokens"]


def prompt_attention(args, relay: dict, card: dict) -> dict | None:
    """The system prompt's attention in relay's first run of the single workload: every query token it
    scheduled (its own prompt tokens and, with speculative decoding, every draft it verified) attends to
    all `prefix_len` prompt keys in every layer and query head, at 4 FLOPs a head dimension (Q.K and
    P.V). No engine skips that work, and the no-prompt engine does the rest of relay's (the same
    model, requests, drafts and sampling): its time plus this work at the card's matmul rate is the least
    any engine on vLLM can take. None for models whose layers attend to fewer keys (sliding windows) or
    in another form (MLA), and runs that did not count their tokens."""
    c = model_config(args.model)
    tokens = relay.get("single", {}).get("runs_relay_tokens", [0])[0]
    windows = (c.get("sliding_window") and c.get("use_sliding_window", True)) or any(
        t != "full_attention" for t in c.get("layer_types") or ())
    if not tokens or windows or c.get("kv_lora_rank"):
        return None
    sh = attention_shape(c)
    flops = 4 * tokens * args.prefix_len * sh["layers"] * sh["hq"] * sh["head_dim"]
    return {"query_tokens": tokens, "flops": flops, "bf16_flop_per_s": card["bf16_flop_per_s"],
            "seconds": flops / card["bf16_flop_per_s"]}


def bound_lines(bound: dict, elapsed: dict) -> str:
    """`bound` (`prompt_attention`) completed with the least time it gives (the no-prompt run's time
    plus the prompt's attention) and what that allows against the default; its summary lines."""
    bound["bound_s"] = elapsed["noprefix"] + bound["seconds"]
    lines = [f"  the prompt's attention in relay's run: {bound['query_tokens']} query tokens, "
             f"{bound['flops'] / 1e15:.3f} PFLOP, {bound['seconds']:.2f} s at the card's matmul rate "
             f"({bound['bf16_flop_per_s'] / 1e12:.0f} TFLOP/s); no prompt + that = {bound['bound_s']:.2f} s"]
    if "default" in elapsed:
        bound["most_over_default"] = elapsed["default"] / bound["bound_s"]
        lines.append(f"  the most any engine can reach here: {bound['most_over_default']:.3f}x the default")
    bound["relay_over_bound"] = bound["bound_s"] / elapsed["relay"]
    lines.append(f"  relay / that bound = {bound['relay_over_bound']:.3f}")
    return "\n".join(lines)


def preemptions(llm) -> int:
    """Requests vLLM's scheduler has preempted so far (its `vllm:num_preemptions` counter): each is
    computed again from its first token (a relay request's tokens then attend its system prompt again)."""
    return int(sum(m.value for m in llm.get_metrics() if m.name == "vllm:num_preemptions"))


def run_config(args, config):
    if config == "bench":  # `vllm bench throughput` itself (single workload only)
        cmd = [sys.executable, "-m", "vllm.entrypoints.cli.main", "bench", "throughput", "--model", args.model,
               "--load-format", "dummy", "--dataset-name", "random", "--random-input-len", str(args.input_len),
               "--random-output-len", str(args.output_len), "--random-prefix-len", str(args.prefix_len),
               "--num-prompts", str(args.num_prompts), "--max-model-len", str(args.max_model_len),
               "--seed", str(args.seed), "--tensor-parallel-size", str(args.tensor_parallel_size)]
    elif config == "sglang":  # in SGLang's environment (its PYTHONPATH in front of vLLM's site), where vLLM's
        # datasets do not import (SGLang's older openai): the same requests, built here, go in a file
        fd, requests = tempfile.mkstemp(suffix=".json", prefix="sglang-requests-")
        with os.fdopen(fd, "w") as f:
            json.dump({name: workload(args, name) for name in args.workloads.split(",")}, f)
        cmd = sglang_command(__file__, args) + ["--requests-file", requests]
    else:
        cmd = worker_command(__file__, config)
    env = dict(os.environ, VLLM_ALLOW_INSECURE_SERIALIZATION="1")  # collective_rpc(allocator_stats)
    if args.triton_cache:  # a fresh cache per configuration: every compilation is seen (and paid)
        env["TRITON_CACHE_DIR"] = os.path.join(args.triton_cache, config)
    try:
        log, rc = run_logged(cmd, args, config, env)
    finally:
        if config == "sglang":
            os.unlink(requests)
    result = result_line(log)
    if result is not None:
        # The KV cache each engine got: a pinned system prompt and larger graphs leave fewer
        # tokens, and at 1000 requests both engines preempt and recompute.
        kv = re.findall(r"GPU KV cache size: ([\d,]+) tokens|max_total_num_tokens=(\d+)", log)
        result["kv_cache_tokens"] = [int((a or b).replace(",", "")) for a, b in kv]
        result["vllm_jit_compiled"] = jit_compiled(log)
        if args.iteration_details:
            result["iterations"] = iteration_summary(log)
        return result
    for line in log.splitlines():
        if line.startswith("Throughput:"):
            return {"config": "bench", "single": {"requests_per_s": float(line.split()[1])}}
    raise RuntimeError(f"{config} failed (rc {rc}):\n{log[-6000:]}")


def iteration_summary(log: str) -> dict:
    """vLLM's per-iteration log lines (`enable_logging_iteration_details`) summed up: time in steps
    with prompt tokens, and the median decode-only step by batch size (rounded to 64)."""
    import statistics

    pat = re.compile(r"Iteration\((\d+)\): (\d+) context requests, (\d+) context tokens, (\d+) generation "
                     r"requests, \d+ generation tokens, iteration elapsed time: ([\d.]+) ms")
    mixed_ms, mixed, by_batch = 0.0, 0, {}
    for m in pat.finditer(log):
        ctx_reqs, gen_reqs, ms = int(m[2]), int(m[4]), float(m[5])
        if ctx_reqs:
            mixed_ms, mixed = mixed_ms + ms, mixed + 1
        else:
            by_batch.setdefault(64 * round(gen_reqs / 64), []).append(ms)
    return {"steps_with_prompts": mixed, "ms_in_steps_with_prompts": round(mixed_ms, 1),
            "decode_steps": sum(map(len, by_batch.values())),
            "ms_in_decode_steps": round(sum(map(sum, by_batch.values())), 1),
            "decode_ms_median_by_batch": {b: round(statistics.median(v), 2) for b, v in sorted(by_batch.items())}}


def compare(ref, relay):
    agree = total = 0
    worst = 0.0
    for (rt, rl), (xt, xl) in zip(ref["outputs"], relay["outputs"], strict=True):
        for a, b in zip(rt, xt):
            total += 1
            agree += a == b
            if a != b:
                break  # after a divergence the contexts differ; stop comparing this request
        for sa, sb in zip(rl, xl):
            common = set(sa) & set(sb)
            worst = max([worst] + [abs(sa[k] - sb[k]) for k in common])
            if list(sa) != list(sb):
                break
    return {"greedy_agreement": agree / total, "max_top5_logprob_diff": worst}


def main():
    p = argparse.ArgumentParser()
    add_workload_args(p)
    p.add_argument("--tensor-parallel-size", type=int, default=1)
    p.add_argument("--configs", default="default,relay")
    p.add_argument("--max-cudagraph-capture-size", type=int, help="vLLM's largest CUDA graph, for every config "
                   "(default: its own, min(2 x max_num_seqs, 512): larger decode batches run eagerly)")
    p.add_argument("--max-num-seqs", type=int, help="vLLM's cap on running requests, for every config "
                   "(default: its own); one the KV cache finishes without preempting: what preemption costs")
    p.add_argument("--gpu-memory-utilization", type=float, help="vLLM's (default: its own; on the CPU the "
                   "fraction of host memory for the KV cache)")
    p.add_argument("--workloads", default="single", help="single and/or multi, comma-separated")
    p.add_argument("--latency", action="store_true", help="also the decode-latency sweep (B = 1..256)")
    p.add_argument("--latency-steps", type=int, default=64)
    p.add_argument("--latency-batches", default="1,2,4,8,16,32,64,128,256")
    p.add_argument("--shared-path", help="relay's shared_path setting (default: its own, auto)")
    p.add_argument("--accuracy", action="store_true")
    p.add_argument("--repeat", type=int, default=1, help="runs of each workload on the same engine (the first "
                   "is reported as requests_per_s, all in runs_requests_per_s)")
    p.add_argument("--iteration-details", action="store_true", help="vLLM's per-step log, summed up per config")
    p.add_argument("--triton-cache", help="a folder for a fresh Triton cache per configuration, to report the "
                   "kernels compiled inside the timed runs")
    p.add_argument("--profile", help="DELAY,STEPS: vLLM's torch profiler over STEPS engine steps of the first "
                   "run, after DELAY steps; its kernel table lands in <out>.<config>.profile/profiler_out_0.txt "
                   "(that run's time includes the profiler's cost)")
    add_sglang_args(p)
    p.add_argument("--out")
    p.add_argument("--requests-file", help=argparse.SUPPRESS)  # the sglang worker's requests, made by the parent
    p.add_argument("--worker")
    args = p.parse_args()
    if args.worker:
        return worker(args)
    results = {}
    if args.accuracy:
        ref, relay = run_config(args, "accuracy-reference"), run_config(args, "accuracy-relay")
        w = args.workloads.split(",")[0]
        results = {"accuracy": compare(ref[w], relay[w]), "system_lens": relay[w]["system_lens"],
                   "relay_stats": relay["relay_stats"]}
        print(json.dumps(results))
    else:
        for config in args.configs.split(","):
            results[config] = run_config(args, config)
            if args.out:  # keep what is done, whatever fails later
                with open(args.out, "w") as f:
                    json.dump({"args": {k: v for k, v in vars(args).items() if k != "worker"}, **results}, f,
                              indent=1)
        for name in args.workloads.split(","):
            line = ", ".join(f"{c} {r[name]['requests_per_s']:.2f}" for c, r in results.items() if name in r)
            print(f"{name}: requests/s: {line}")
            got = {c: r[name]["requests_per_s"] for c, r in results.items() if name in r}
            if "relay" in got and "default" in got:
                print(f"  relay / default = {got['relay'] / got['default']:.3f}x")
            if "relay" in got and "sglang" in got:
                print(f"  relay / SGLang = {got['relay'] / got['sglang']:.3f}x")
            if "relay" in got and "noprefix" in got:
                print(f"  relay / no system prompt = {got['relay'] / got['noprefix']:.3f}")
            if "noprefix-relay" in got and "noprefix" in got:
                print(f"  relay backend without prompts / default = {got['noprefix-relay'] / got['noprefix']:.3f}")
        if "single" in results.get("relay", {}) and "single" in results.get("noprefix", {}) and has_gpu():
            bound = prompt_attention(args, results["relay"], measure_card())  # (its engines are gone)
            if bound is not None:
                results["prompt_attention"] = bound
                elapsed = {c: r["single"]["elapsed_s"] for c, r in results.items() if "single" in r}
                print(bound_lines(bound, elapsed))
        lat = {c: r["latency"] for c, r in results.items() if "latency" in r}
        if "relay" in lat and "default" in lat:
            for a, b in zip(lat["relay"], lat["default"]):
                print(f"  decode B={a['batch']:4d}: relay {a['ms_per_step']:.2f} ms, default "
                      f"{b['ms_per_step']:.2f} ms, relay/default {a['ms_per_step'] / b['ms_per_step']:.3f}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"args": {k: v for k, v in vars(args).items() if k != "worker"}, **results}, f, indent=1)


if __name__ == "__main__":
    main()
