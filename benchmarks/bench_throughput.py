"""End-to-end offline throughput: relay against vLLM's default, on vLLM's random-dataset workload.

Every request shares one random P-token prefix (the system prompt) followed by its own tokens,
exactly as `vllm bench throughput --dataset-name random --random-prefix-len P` builds them: we use
vLLM's own `RandomDataset` and tokenize its prompts as the engine would. Each configuration runs in
its own process (a fresh engine, its own GPU memory):

  default   vLLM 0.26 as it ships (prefix caching on, Model Runner V2, cascade off), full prompts
  relay     --attention-backend relay with the shared prefix registered up front as a system prompt
  noprefix  the same requests with no system prompt at all (P = 0): the target's reference
  noprefix-relay  the same, with --attention-backend relay (no system prompt registered): what relay
            costs a workload it cannot help (piecewise CUDA graphs, V1 runner)
  v1        vLLM's default with the V1 model runner (what relay runs on), to show the runner costs nothing
  bench     `vllm bench throughput` itself, for the default configuration (cross-check of this driver)

`--accuracy` instead compares relay with FLASH_ATTN on the same full prompts (greedy, top-5
logprobs over the first 8 generated tokens). `--tensor-parallel-size N` runs every configuration
over N GPUs (data parallelism is a serving feature: vllm.LLM refuses it). Usage (GPU host):
  python3 benchmarks/bench_throughput.py --model DIR --prefix-len 2048 --num-prompts 1000 \
      --max-model-len 4096 --configs default,relay --out results.json
"""

import argparse
import functools
import json
import os
import subprocess
import sys
import time


from vllm_relay.system_prompts.fill import common_prefix


def sample_requests(args):
    """vLLM's random dataset, tokenized: (prompt token ids per request, output lengths)."""
    from vllm.benchmarks.datasets import RandomDataset
    from vllm.tokenizers import get_tokenizer

    tok = get_tokenizer(args.model)
    reqs = RandomDataset(random_seed=args.seed).sample(
        tokenizer=tok, num_requests=args.num_prompts, prefix_len=args.prefix_len,
        input_len=args.input_len, output_len=args.output_len)
    return [tok.encode(r.prompt) for r in reqs], [r.expected_output_len for r in reqs]


def engine_kwargs(args, config, system_ids):
    kw = dict(model=args.model, load_format="dummy", max_model_len=args.max_model_len, seed=args.seed,
              tensor_parallel_size=args.tensor_parallel_size)
    if config == "noprefix-relay":
        kw["attention_backend"] = "relay"
    elif config in ("relay", "accuracy-relay"):
        kw["attention_backend"] = "relay"
        kw["additional_config"] = {"relay": {
            "system_prompts": {"bench": system_ids}, "max_prompts": 1, "max_prompt_tokens": len(system_ids)}}
    elif config == "accuracy-reference":
        kw["attention_backend"] = "FLASH_ATTN"
    return kw


def worker(args):
    """One configuration in this process; prints one JSON line."""
    if args.worker == "v1":
        os.environ["VLLM_USE_V2_MODEL_RUNNER"] = "0"
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    prompts, out_lens = sample_requests(args)
    system_ids = functools.reduce(common_prefix, prompts)  # the shared prefix of all requests
    if args.worker.startswith("noprefix"):  # the same requests without the shared prefix
        prompts = [p[:1] + p[len(system_ids):] for p in prompts]
    accuracy = args.worker.startswith("accuracy")
    if accuracy:
        prompts, out_lens = prompts[:64], [8] * 64
    llm = LLM(**engine_kwargs(args, args.worker, system_ids))
    if accuracy:
        params = SamplingParams(temperature=0.0, max_tokens=8, logprobs=5, ignore_eos=True)
    else:
        params = [SamplingParams(temperature=1.0, top_p=1.0, ignore_eos=True, max_tokens=n) for n in out_lens]
    t0 = time.perf_counter()
    outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)
    elapsed = time.perf_counter() - t0
    result = {"config": args.worker, "requests": len(prompts), "elapsed_s": elapsed,
              "requests_per_s": len(prompts) / elapsed, "system_len": len(system_ids),
              "prompt_tokens": sum(map(len, prompts)),
              "output_tokens": sum(len(o.outputs[0].token_ids) for o in outs)}
    if accuracy:
        result["outputs"] = [[list(o.outputs[0].token_ids),
                              [{str(k): v.logprob for k, v in s.items()} for s in o.outputs[0].logprobs]]
                             for o in outs]
    if args.worker in ("relay", "accuracy-relay"):
        from vllm_relay.stats import relay_stats

        result["relay_stats"] = relay_stats(llm)
        if result["relay_stats"]["relay_requests"] < len(prompts):
            raise RuntimeError(f"relay served only {result['relay_stats']['relay_requests']} of "
                               f"{len(prompts)} requests: the prefix was not routed")
    print("RESULT " + json.dumps(result), flush=True)


def run_config(args, config):
    if config == "bench":
        cmd = [sys.executable, "-m", "vllm.entrypoints.cli.main", "bench", "throughput", "--model", args.model,
               "--load-format", "dummy", "--dataset-name", "random", "--random-input-len", str(args.input_len),
               "--random-output-len", str(args.output_len), "--random-prefix-len", str(args.prefix_len),
               "--num-prompts", str(args.num_prompts), "--max-model-len", str(args.max_model_len),
               "--seed", str(args.seed), "--tensor-parallel-size", str(args.tensor_parallel_size)]
    else:
        cmd = [sys.executable, __file__, *sys.argv[1:], "--worker", config]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    log = proc.stdout + proc.stderr
    for line in log.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[7:])
        if line.startswith("Throughput:"):
            return {"config": "bench", "requests_per_s": float(line.split()[1])}
    raise RuntimeError(f"{config} failed (rc {proc.returncode}):\n{log[-6000:]}")


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
    p.add_argument("--model", required=True)
    p.add_argument("--prefix-len", type=int, default=2048)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=256)
    p.add_argument("--num-prompts", type=int, default=1000)
    p.add_argument("--max-model-len", type=int, default=4096)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--tensor-parallel-size", type=int, default=1)
    p.add_argument("--configs", default="default,relay")
    p.add_argument("--accuracy", action="store_true")
    p.add_argument("--out")
    p.add_argument("--worker")
    args = p.parse_args()
    if args.worker:
        return worker(args)
    results = {}
    if args.accuracy:
        ref, relay = run_config(args, "accuracy-reference"), run_config(args, "accuracy-relay")
        results = {"accuracy": compare(ref, relay), "system_len": relay["system_len"],
                   "relay_stats": relay["relay_stats"]}
        print(json.dumps(results))
    else:
        for config in args.configs.split(","):
            results[config] = run_config(args, config)
            print(f"{config:>9}: {results[config]['requests_per_s']:.2f} requests/s "
                  f"{json.dumps(results[config].get('relay_stats', ''))}", flush=True)
        base = results.get("default", {}).get("requests_per_s")
        if base and "relay" in results:
            print(f"relay / default = {results['relay']['requests_per_s'] / base:.2f}x")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"args": {k: v for k, v in vars(args).items() if k != "worker"}, **results}, f, indent=1)


if __name__ == "__main__":
    main()
