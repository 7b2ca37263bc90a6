"""Shared prefixes nobody registered, end to end: relay against vLLM's default, the ceiling and the
bound, on workloads whose requests share prefixes through vLLM's prefix cache (GPU).

Workloads (`--workloads`, each point with fresh random ids, so no point reuses another's cache):
  samples  Hydragen's sweep: one shared prompt of P tokens (`--prefix-lens`), n completions of it
           (`--ns`), `--output-len` tokens each, as one request with SamplingParams(n=n); and the time to
           the first token of n completions of another prompt of the same length (cold).
  latency  bifurcated attention's: ms per decode step of n samples of one C-token context
           (`--contexts` x `--latency-ns`): (time of 1 + steps tokens - time of 1 token) / steps,
           over two contexts of the same length (both cold: the same prefill).
  tree     two levels: a system prompt (`--tree-system`) over D documents, Q questions each, n samples
           per question (`--tree D,Q,n,doc_len,question_len`).
Configs (`--configs`, each in its own process: a fresh engine runs every point of every workload):
  default        vLLM as it ships (prefix caching on, Model Runner V2)
  relay          --attention-backend relay, nothing registered (tree: its system prompt registered)
  relay-sysonly  relay with auto_levels off (tree: the registered system prompt is the only level)
  ceiling        the same completions with the shared part cut from every prompt (BOS only)
  sglang         SGLang's offline Engine (radix cache on) on the same ids, n samples as its `n`, in the
                 environment of `--sglang-env` (tools/gpu_host/sglang/install.sh)
With `--repeat R` each point runs R times, each with fresh ids (the same for every config), and its row
holds every run and their median time.
The bound of a point: the ceiling's time plus, per decode step, one read of every shared level's KV
(a tree: its system prompt, every document and every question) at the card's measured copy
bandwidth or the attention FLOPs of the rows over their shared paths at the measured bf16 matmul
rate, whichever is larger (decode steps: output_len x ceil(completions / max_num_seqs)).
Usage (GPU host): python3 benchmarks/bench_sharing.py --model DIR --out results/sharing.json
"""

import argparse
import json
import math
import os
import random
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import (JIT_MONITOR, add_sglang_args, attention_shape, compiled_during,  # noqa: E402
                    decode_span_s, host_speed_us, jit_compiled, json_object, measure_card, model_config,
                    profiler_config, prompt_vocab, random_prompt, result_line, run_logged, sglang_command,
                    sglang_engine, sglang_sampling, worker_command)


def shape(model: str) -> dict:
    c = model_config(model)
    return {**attention_shape(c), "vocab": prompt_vocab(c), "hidden": c["hidden_size"],
            "inter": c["intermediate_size"]}


def points(args) -> list[dict]:
    """Every point of the chosen workloads, in order."""
    out = []
    for w in args.workloads.split(","):
        if w == "samples":
            out += [{"workload": w, "P": P, "n": n} for P in map(int, args.prefix_lens.split(","))
                    for n in map(int, args.ns.split(","))]
        elif w == "latency":
            out += [{"workload": w, "C": C, "n": n} for C in map(int, args.contexts.split(","))
                    for n in map(int, args.latency_ns.split(","))]
        elif w == "tree":
            D, Q, n, doc, q = map(int, args.tree.split(","))
            out.append({"workload": w, "D": D, "Q": Q, "n": n, "doc": doc, "q": q, "S": args.tree_system})
    return out


def requests(point, config, rng, vocab, system):
    """(prompts, n, shared tokens per completion) of a point for a config."""
    def ids(k):
        return [rng.randrange(100, vocab) for _ in range(k)]

    w = point["workload"]
    if w in ("samples", "latency"):
        ctx = point["P"] if w == "samples" else point["C"]
        prompt = [1] if config == "ceiling" else random_prompt(rng, ctx, vocab)
        return [prompt], point["n"], ctx
    docs = [ids(point["doc"]) for _ in range(point["D"])]
    prompts = [[1] if config == "ceiling" else system + doc + ids(point["q"]) for doc in docs
               for _ in range(point["Q"])]
    return prompts, point["n"], len(system) + point["doc"] + point["q"]


def max_seqs(args) -> int:
    """The most requests a step of the engines holds: `--engine-args`' max_num_seqs, else `--max-num-seqs`."""
    return args.engine_args.get("max_num_seqs", args.max_num_seqs)


def largest_batch(args) -> int:
    """The most completions any step of the run holds: its largest point's, at most `max_seqs`."""
    most = max(p["n"] * p.get("D", 1) * p.get("Q", 1) for p in points(args))
    return min(max_seqs(args), most)


# vLLM's largest CUDA graph unless told (`VllmConfig`: min(2 x max_num_seqs, 512) on Hopper, 1024 on Blackwell)
VLLM_MAX_GRAPH = 512


def graph_sizes(args) -> dict:
    """vLLM's compilation config with CUDA graphs up to the run's largest batch (`largest_batch`), never
    above vLLM's own largest: larger ones would never replay, and capturing them (relay's twins with
    levels too) adds tens of seconds to a big model's start. Left to vLLM where the engine arguments size
    the graphs themselves or draft tokens (speculative decoding: a decode step of n requests holds more
    than n tokens), or where the run's batches reach its largest anyway."""
    user = args.engine_args.get("compilation_config") or {}
    sized = {"max_cudagraph_capture_size", "cudagraph_capture_sizes"} & set(user)
    largest = largest_batch(args)
    if sized or "speculative_config" in args.engine_args or largest >= VLLM_MAX_GRAPH:
        return {}
    return {"compilation_config": {**user, "max_cudagraph_capture_size": largest}}


def engine_kwargs(args, config, system):
    kw = dict(model=args.model, load_format="dummy", max_model_len=args.max_model_len, seed=0,
              max_num_seqs=args.max_num_seqs, disable_log_stats=False,
              enable_logging_iteration_details=args.iteration_details, **JIT_MONITOR)
    if config.startswith("relay"):
        relay = {"auto_levels": config == "relay"}
        if "tree" in args.workloads:
            relay.update(system_prompts={"system": system}, max_prompt_tokens=len(system))
        kw.update(attention_backend="relay", additional_config={"relay": relay})
    if args.profile:  # vLLM's torch profiler over a window of the first point's steps
        kw["profiler_config"] = profiler_config(args, config)
    return {**kw, **args.engine_args, **graph_sizes(args)}


def vllm_generate(args, system):
    """vLLM's engine for this config: (generate(prompts, n, max_tokens) -> (completions, tokens, span), the
    LLM), span the job's decode after its own first token (`common.decode_span_s`)."""
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    llm = LLM(**engine_kwargs(args, args.worker, system))

    def generate(prompts, n, max_tokens):
        params = SamplingParams(n=n, temperature=1.0, max_tokens=max_tokens, ignore_eos=True)
        outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)
        return (sum(len(o.outputs) for o in outs), sum(len(c.token_ids) for o in outs for c in o.outputs),
                decode_span_s(outs))

    return generate, llm


def sglang_generate(args):
    """SGLang's engine (`common.sglang_engine`): generate(prompts, n, max_tokens) -> (completions, tokens, None)."""
    engine, _ = sglang_engine(args, max_running_requests=max_seqs(args))

    def generate(prompts, n, max_tokens):
        outs = engine.generate(input_ids=prompts, sampling_params=sglang_sampling(max_tokens, n))
        return len(outs), sum(o["meta_info"]["completion_tokens"] for o in outs), None

    return generate


def worker(args):
    """One configuration in this process; prints one RESULT line."""
    sh = shape(args.model)
    system = [1] + [random.Random(7).randrange(100, sh["vocab"]) for _ in range(args.tree_system - 1)]
    llm = None
    if args.worker == "sglang":
        generate = sglang_generate(args)
    else:
        generate, llm = vllm_generate(args, system)
    generate([[1, 2, 3]], 1, 8)  # warm-up
    rows = []
    for i, point in enumerate(points(args)):
        latency = point["workload"] == "latency"
        steps = args.latency_steps if latency else args.output_len

        def run(prompts, n, max_tokens):
            t0, wall0 = time.perf_counter(), time.time()
            completions, tokens, span = generate(prompts, n, max_tokens)
            elapsed, compiled = time.perf_counter() - t0, compiled_during(wall0, time.time())
            if completions != len(prompts) * n or tokens != completions * max_tokens:
                raise RuntimeError(f"{args.worker}: {completions} completions, {tokens} tokens, not "
                                   f"{len(prompts) * n} x {max_tokens}")
            if compiled:  # start-up work inside the timed run: its time is in the figure
                print(f"  {args.worker}: Triton kernels compiled during a timed run: {compiled}", flush=True)
            triton_compiled.extend(compiled)
            return elapsed, completions, tokens, span

        runs, triton_compiled = [], []
        probe = host_speed_us()  # the host's speed at this config's runs (it moves within a job)
        for r in range(args.repeat):
            rng = random.Random(1000 + i + 100003 * r)  # the same ids for every config, fresh ones each run
            prompts, n, _ = requests(point, args.worker, rng, sh["vocab"], system)
            profiling = args.profile and llm is not None and i == 0 and r == 0
            if profiling:  # (the profiler slows the steps it records: this run too)
                llm.start_profile()
            elapsed, completions, tokens, span = run(prompts, n, 1 + steps if latency else steps)
            if profiling:
                llm.stop_profile()
            got = {"elapsed_s": elapsed, "completions": completions, "tokens": tokens}
            if latency or point["workload"] == "samples":
                # The first token of the n completions of another prompt of the same length (cold: its
                # prefill, once or n times, and one step); latency: minus it, ms per decode step.
                first, _, _, _ = run(requests(point, args.worker, rng, sh["vocab"], system)[0], n, 1)
                got["first_token_s"] = first
                if latency:
                    got["ms_per_step"] = (elapsed - first) / steps * 1e3
                elif steps > 1:  # the job less its first token: its later tokens' decode steps
                    got["decode_ms_per_step"] = (elapsed - first) / (steps - 1) * 1e3
                    if span is not None:  # the same from the job's own first token (vLLM's timestamps)
                        got.update(job_first_token_s=elapsed - span, job_decode_ms_per_step=span / (steps - 1) * 1e3)
            runs.append(got)
        row = summarize(point, runs)
        row["triton_compiled"] = triton_compiled  # in the point's timed runs (first-token runs too)
        row["host_speed_us"] = probe
        rows.append(row)
        print(f"  {args.worker} {point}: {row['elapsed_s']:.2f} s, {row['tokens_per_s']:.0f} tok/s"
              + (f", {row['ms_per_step']:.2f} ms/step" if "ms_per_step" in row else "")
              + (f", first token {row['first_token_s']:.3f} s" if "first_token_s" in row else "")
              + (f" (median of {len(runs)})" if len(runs) > 1 else ""), flush=True)
    result = {"config": args.worker, "rows": rows}
    if args.worker.startswith("relay"):
        from vllm_relay.stats import planner_stats, relay_stats

        result["relay_stats"] = {k: v for k, v in relay_stats(llm).items() if k != "prompts"}
        result["planner_stats"] = planner_stats(llm)  # steps planned, graph steps with levels, rows
    print("RESULT " + json.dumps(result), flush=True)


def summarize(point: dict, runs: list[dict]) -> dict:
    """A point's row from its runs: the median run's time (the mean of the middle two for an even
    count), tokens/s over it, the median ms per step, and every run's tokens/s (more than one run)."""
    elapsed = statistics.median(r["elapsed_s"] for r in runs)
    row = {**point, "elapsed_s": elapsed, "completions": runs[0]["completions"],
           "tokens_per_s": runs[0]["tokens"] / elapsed}
    for key in ("ms_per_step", "first_token_s", "decode_ms_per_step", "job_first_token_s",
                "job_decode_ms_per_step"):
        if key in runs[0]:
            row[key] = statistics.median(r[key] for r in runs)
    if len(runs) > 1:
        row["runs_tokens_per_s"] = [r["tokens"] / r["elapsed_s"] for r in runs]
    return row


def run_config(args, config) -> dict:
    cmd = sglang_command(__file__, args) if config == "sglang" else worker_command(__file__, config)
    log, rc = run_logged(cmd, args, config)
    result = result_line(log)
    if result is not None:
        result["vllm_jit_compiled"] = jit_compiled(log)
        return result
    raise RuntimeError(f"{config} failed (rc {rc}):\n{log[-6000:]}")


def bound_s(point, ceiling_s, card, sh, args) -> float:
    """The ceiling's time plus one read of every level's KV (or the attention FLOPs over each row's
    shared path) per decode step. A tree's levels are its system prompt, D documents and D x Q
    questions: each read once, while each row attends to one path (system, document, question)."""
    shared = point.get("P") or point.get("C")  # one level: the prompt (samples) or the context (latency)
    path = shared or point["S"] + point["doc"] + point["q"]
    levels = shared or point["S"] + point["D"] * (point["doc"] + point["Q"] * point["q"])
    completions = point["n"] * point.get("D", 1) * point.get("Q", 1)
    steps = args.output_len * math.ceil(completions / max_seqs(args))
    kv_bytes = 2 * levels * sh["layers"] * sh["hkv"] * sh["head_dim"] * 2  # K and V, bf16
    flops = 4 * min(completions, max_seqs(args)) * path * sh["layers"] * sh["hq"] * sh["head_dim"]
    return ceiling_s + steps * max(kv_bytes / card["copy_bytes_per_s"], flops / card["bf16_flop_per_s"])


def prefill_floor_s(point, card, sh) -> float | None:
    """The least time one prefill of a samples point's shared prompt can take: its FLOPs (the
    linear layers' two a weight a token, the causal attention's four a head dimension a query-key
    pair) at the card's matmul rate. The bound leaves this prefill out, and nothing can hide it:
    every completion's first token needs the whole prompt. None for other workloads (a tree's
    later documents may prefill while earlier ones decode)."""
    if point["workload"] != "samples":
        return None
    P, hq, hkv, hd, hidden = point["P"], sh["hq"], sh["hkv"], sh["head_dim"], sh["hidden"]
    weights = hidden * hd * (2 * hq + 2 * hkv) + 3 * hidden * sh["inter"]  # q, k, v, o; gate, up, down
    flops = sh["layers"] * (2 * weights * P + 4 * hd * hq * P * (P + 1) // 2)
    return flops / card["bf16_flop_per_s"]


def over_bound_plus(tokens_per_s: float, bound: tuple[float, float], prefill_s: float) -> float:
    """Output tokens/s against the bound (its seconds and tokens/s) with `prefill_s` added to its time."""
    b_s, b = bound
    return tokens_per_s * (b_s + prefill_s) / (b * b_s)


def markdown(results, card, sh, args) -> str:
    configs = [c for c in results if c != "card"]
    host = (f", the host's pure Python {card['host_speed_us']:.0f} us (common.host_speed_us)"
            if "host_speed_us" in card else "")
    lines = [f"{card['device']}: copy {card['copy_bytes_per_s'] / 1e12:.2f} TB/s, bf16 matmul "
             f"{card['bf16_flop_per_s'] / 1e12:.0f} TFLOP/s{host}. Output tokens/s (latency: ms per decode step).", "",
             "| point | " + " | ".join(configs) + " | bound | relay / bound | relay / default "
             "| relay / SGLang | relay / reachable |", "|---|" + "---|" * (len(configs) + 5)]
    pts = points(args)
    bounds = {}  # point index: (the bound's seconds, its output tokens/s)
    for i, point in enumerate(pts):
        get = {c: results[c]["rows"][i] for c in configs}
        label = point_label(point)
        if point["workload"] == "latency":
            cells = [f"{get[c]['ms_per_step']:.2f}" for c in configs]
            lines.append(f"| {label} | " + " | ".join(cells) + " | | | | | |")
            continue
        cells = [f"{get[c]['tokens_per_s']:.0f}" for c in configs]
        ratio = lambda a, b: f"{get[a]['tokens_per_s'] / get[b]['tokens_per_s']:.2f}" if a in get and b in get else ""  # noqa: E731
        bound, most = " | ", ""
        if "ceiling" in get:
            b_s = bound_s(point, get["ceiling"]["elapsed_s"], card, sh, args)
            b = get["ceiling"]["tokens_per_s"] * get["ceiling"]["elapsed_s"] / b_s
            bounds[i] = (b_s, b)
            bound = f"{b:.0f} | " + (f"{get['relay']['tokens_per_s'] / b:.2f}" if "relay" in get else "")
            floor = prefill_floor_s(point, card, sh)
            if floor is not None and "relay" in get:
                most = f"{over_bound_plus(get['relay']['tokens_per_s'], bounds[i], floor):.2f}"
        lines.append(f"| {label} | " + " | ".join(cells) + f" | {bound} | {ratio('relay', 'default')} | "
                     f"{ratio('relay', 'sglang')} | {most} |")
    if not any(w == "samples" for w in args.workloads.split(",")):
        return "\n".join(lines + compiled_lines(results, configs, pts)
                         + host_lines(results, configs, pts)) + "\n"
    lines += ["", "Relay / reachable: against the bound plus the least time one prefill of the shared prompt "
              "takes (its FLOPs at the matmul rate above), which the bound leaves out and no engine can skip.", "",
              "First token of the n completions of a cold prompt (s); ms a decode step (the job less that first "
              "token, over its later tokens); the job's own first token and ms a step after it, by vLLM's "
              "request timestamps (time the job spends once, past its prompt's prefill, shows in the first); "
              "and relay's output tokens/s against the "
              "bound plus the prompt's one prefill as this engine ran it (relay's first token at n=1, the "
              "same prefill as vLLM's), where the run has n=1:", "",
              "| point | " + " | ".join(configs) + " | " + " | ".join(f"{c} ms a step" for c in configs)
              + " | " + " | ".join(f"{c} in its job" for c in configs)
              + " | relay / relay at n=1 | relay / (bound + prefill at n=1) |",
              "|---|" + "---|" * (3 * len(configs) + 2)]

    def first(c, j):
        return results[c]["rows"][j]["first_token_s"]

    for i, point in enumerate(pts):
        if point["workload"] != "samples" or "first_token_s" not in results[configs[0]]["rows"][i]:
            continue
        one = [j for j, q in enumerate(pts)
               if q["workload"] == "samples" and q["P"] == point["P"] and q["n"] == 1]
        rel = f"{first('relay', i) / first('relay', one[0]):.2f}" if one and "relay" in results else ""
        run = ""
        if one and "relay" in results and i in bounds:
            tps = results["relay"]["rows"][i]["tokens_per_s"]
            run = f"{over_bound_plus(tps, bounds[i], first('relay', one[0])):.2f}"
        cells = " | ".join(f"{first(c, i):.3f}" for c in configs)
        steps = " | ".join(f"{results[c]['rows'][i]['decode_ms_per_step']:.2f}"
                           if "decode_ms_per_step" in results[c]["rows"][i] else "" for c in configs)
        jobs = " | ".join(f"{r['job_first_token_s']:.3f} s, {r['job_decode_ms_per_step']:.2f} ms"
                          if "job_decode_ms_per_step" in r else "" for r in (results[c]["rows"][i] for c in configs))
        lines.append(f"| P={point['P']}, n={point['n']} | {cells} | {steps} | {jobs} | {rel} | {run} |")
    return "\n".join(lines + compiled_lines(results, configs, pts)
                         + host_lines(results, configs, pts)) + "\n"


def point_label(point: dict) -> str:
    return ", ".join(f"{k}={v}" for k, v in point.items())


def host_lines(results, configs, pts) -> list[str]:
    """The host's pure-Python probe (`common.host_speed_us`, us) as each config's runs of each point began:
    a host-bound step moves with it, and it moves within a job."""
    probes = [f"{c} at {point_label(pts[i])}: {row['host_speed_us']:.0f}"
              for c in configs for i, row in enumerate(results[c]["rows"]) if "host_speed_us" in row]
    return ["", "The host's pure-Python probe as each config's runs began (us; less is faster): "
            + "; ".join(probes)] if probes else []


def compiled_lines(results, configs, pts) -> list[str]:
    """The markdown's note of Triton kernels compiled inside timed runs (start-up work in a figure), if any."""
    leaks = [f"{c} at {point_label(pts[i])}: {', '.join(row['triton_compiled'])}"
             for c in configs for i, row in enumerate(results[c]["rows"]) if row.get("triton_compiled")]
    jit = [f"{c}: {', '.join(results[c]['vllm_jit_compiled'])}" for c in configs
           if results[c].get("vllm_jit_compiled")]
    lines = []
    if leaks:
        lines += ["", "Triton kernels compiled during timed runs (their time is in the figure): " + "; ".join(leaks)]
    if jit:
        lines += ["", "Triton kernels vLLM's JIT monitor saw compiled after the engine's warm-up (in some run of "
                  "the config): " + "; ".join(jit)]
    return lines


def plot(path: str, sh: dict | None = None) -> str:
    """<path>.png from a results file, a panel per shared-prompt length or context and one for the
    tree: output tokens/s against n (samples, with the bound), ms per decode step against n
    (latency), output tokens/s per config (tree, with the bound). `sh`: the model's shape (default:
    the results' model, built locally)."""
    import re
    from types import SimpleNamespace

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    data = json.load(open(path))
    args = SimpleNamespace(**data["args"])
    name = re.sub(r"-[0-9a-f]{10}$", "", os.path.basename(args.model.rstrip("/")))
    if sh is None:
        from vllm_relay.testing.models import get_model

        sh = shape(get_model(name))
    configs = [c for c in data if c not in ("args", "card")]
    pts = points(args)
    panels = [("samples", P) for P in sorted({p["P"] for p in pts if p["workload"] == "samples"})]
    panels += [("latency", C) for C in sorted({p["C"] for p in pts if p["workload"] == "latency"})]
    panels += [("tree", None)] * any(p["workload"] == "tree" for p in pts)

    def bound_tokens_per_s(i):
        r = data["ceiling"]["rows"][i]
        return r["tokens_per_s"] * r["elapsed_s"] / bound_s(pts[i], r["elapsed_s"], data["card"], sh, args)

    fig, axes = plt.subplots(1, len(panels), figsize=(5 * len(panels), 4), squeeze=False)
    for ax, (w, x) in zip(axes[0], panels):
        by = "P" if w == "samples" else "C"
        idx = [i for i, p in enumerate(pts) if p["workload"] == w and p.get(by) == x]
        if w == "tree":  # its one point (no "C": x is None)
            i, bound = idx[0], "ceiling" in data
            speeds = [data[c]["rows"][i]["tokens_per_s"] for c in configs] + [bound_tokens_per_s(i)] * bound
            colors = [f"C{k}" for k in range(len(configs))] + ["k"] * bound
            ax.bar(configs + ["bound"] * bound, speeds, color=colors)
            p = pts[i]
            ax.set_ylabel("output tokens/s")
            ax.set_title(f"a {p['S']}-token system prompt > {p['D']} documents of {p['doc']}\n"
                         f"> {p['Q']} questions of {p['q']} each > {p['n']} samples each", fontsize=9)
            ax.tick_params(axis="x", labelsize=7)
        else:
            ns = [pts[i]["n"] for i in idx]
            key = "tokens_per_s" if w == "samples" else "ms_per_step"
            for c in configs:
                ax.plot(ns, [data[c]["rows"][i][key] for i in idx], marker="o", label=c)
            if w == "samples" and "ceiling" in data:
                ax.plot(ns, [bound_tokens_per_s(i) for i in idx], "k--", label="bound")
            ax.set(xscale="log", yscale="log" if w == "samples" else "linear",
                   xlabel=f"completions n of one {'prompt' if w == 'samples' else 'context'}",
                   ylabel="output tokens/s" if w == "samples" else "ms per decode step",
                   title=f"shared prompt of {x} tokens" if w == "samples" else f"context of {x} tokens")
            ax.legend(fontsize=7)
        ax.grid(alpha=0.3)
    per = f", {args.output_len} output tokens per completion" if panels[0][0] == "samples" else ""
    fig.suptitle(f"{data['card']['device']}, {name}{per}", fontsize=9)
    fig.tight_layout()
    png = os.path.splitext(path)[0] + ".png"
    fig.savefig(png, dpi=110)
    plt.close(fig)
    return png


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model")
    p.add_argument("--plot", help="a results file of this benchmark: write its PNG beside it and exit")
    p.add_argument("--configs", default="ceiling,relay,default")
    p.add_argument("--workloads", default="samples,latency")
    p.add_argument("--prefix-lens", default="1024,4096,16000")
    p.add_argument("--ns", default="16,64,256,1024")
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--contexts", default="2048,8192,16384")
    p.add_argument("--latency-ns", default="1,8,64,256")
    p.add_argument("--latency-steps", type=int, default=32)
    p.add_argument("--tree", default="8,4,8,2048,128", help="D,Q,n,doc_len,question_len")
    p.add_argument("--tree-system", type=int, default=2048)
    p.add_argument("--max-model-len", type=int, default=16384)
    p.add_argument("--max-num-seqs", type=int, default=1024)
    p.add_argument("--engine-args", type=json_object, default={},
                   help="more vLLM engine arguments for every vLLM configuration, as JSON (a feature on for "
                   "every side: '{\"kv_cache_dtype\": \"fp8\"}')")
    p.add_argument("--repeat", type=int, default=1,
                   help="runs of each point, each with fresh ids (the median)")
    p.add_argument("--iteration-details", action="store_true", help="vLLM's per-step log in <out>.<config>.log")
    p.add_argument("--profile", help="DELAY,STEPS: vLLM's torch profiler over STEPS engine steps of the first "
                   "point, after DELAY (0,0: its whole first run); its kernel table lands in "
                   "<out>.<config>.profile/profiler_out_0.txt, each trace's text (traces.py) beside it")
    p.add_argument("--seed", type=int, default=0, help="SGLang's random seed (vLLM's engines take 0)")
    add_sglang_args(p)
    p.add_argument("--out")
    p.add_argument("--worker")
    return p


def main():
    args = parser().parse_args()
    if args.plot:
        return print(plot(args.plot))
    if args.worker:
        return worker(args)
    results = {"card": measure_card()}
    for config in args.configs.split(","):
        results[config] = run_config(args, config)
        if args.out:  # keep what is done, whatever fails later
            json.dump({"args": vars(args), **results}, open(args.out, "w"), indent=1)
    md = markdown(results, results["card"], shape(args.model), args)
    print(md)
    if args.out:
        open(os.path.splitext(args.out)[0] + ".md", "w").write(md)


if __name__ == "__main__":
    main()
