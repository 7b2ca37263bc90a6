"""Host cost of the prefix-cache lookup of n samples of one prompt: vLLM's walk against relay's memo.

vLLM fans `SamplingParams(n=...)` out into n requests; its scheduler looks each one up in the prefix
cache block by block (`KVCacheManager.get_computed_blocks`) and, at its first output, walks its blocks
again (`estimate_cached_tokens`). `engine/cache_hits.py` starts a lookup from the blocks a recent one
found. This times both on this machine's CPU with vLLM's own KV-cache manager (no model, no engine):
the prompt computed once, then n samples admitted as the scheduler admits them, microseconds a request,
the median of --rounds rounds, the two managers taking turns.

    python tools/bench_cache_hits.py --prompt-lens 1024,4096,16000 --n 256 \
        --out cache_hits.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import statistics
import time

BS = 16


def manager(num_blocks: int, memo: bool):
    import torch
    from vllm.v1.core.kv_cache_manager import KVCacheManager
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec

    from vllm_relay.engine.cache_hits import CacheHitMemo

    spec = FullAttentionSpec(block_size=BS, num_kv_heads=8, head_size=128, dtype=torch.bfloat16)
    config = KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=[],
                           kv_cache_groups=[KVCacheGroupSpec(["layer"], spec)])
    kv = KVCacheManager(config, max_model_len=32768, scheduler_block_size=BS, hash_block_size=BS)
    if memo:
        assert CacheHitMemo.install(kv) is not None
    return kv


def one_round(prompt: list, n: int, memo: bool, hasher, tag: str) -> dict:
    """The prompt's first request computes it; n samples are then looked up, admitted and counted."""
    from vllm import SamplingParams
    from vllm.v1.request import Request

    from vllm_relay.engine.hashes import PromptHashMemo

    kv = manager(len(prompt) // BS + 2 * n + 8, memo)
    hash_fn = PromptHashMemo(hasher, BS) if memo else hasher  # relay's engine hashes the samples once

    def request(i):
        return Request(request_id=f"{tag}{i}", prompt_token_ids=list(prompt), pooling_params=None,
                       sampling_params=SamplingParams(), block_hasher=hash_fn)

    first = request(0)
    blocks, hit = kv.get_computed_blocks(first)[:2]
    kv.allocate_slots(first, first.num_tokens - hit, hit, blocks)
    first.num_computed_tokens = first.num_tokens
    samples = [request(i) for i in range(1, n + 1)]
    lookup = estimate = 0.0
    for r in samples:
        t = time.perf_counter()
        blocks, hit = kv.get_computed_blocks(r)[:2]
        lookup += time.perf_counter() - t
        assert hit == (len(prompt) - 1) // BS * BS
        kv.allocate_slots(r, r.num_tokens - hit, hit, blocks)
        r.num_computed_tokens = r.num_tokens
    for r in samples:
        t = time.perf_counter()
        kv.estimate_cached_tokens(r)
        estimate += time.perf_counter() - t
    return {"lookup_us": lookup / n * 1e6, "estimate_us": estimate / n * 1e6}


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--prompt-lens", default="1024,4096,16000")
    p.add_argument("--n", type=int, default=256)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--out")
    args = p.parse_args()
    from vllm.utils.hashing import get_hash_fn_by_name
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash

    fn = get_hash_fn_by_name("sha256")
    init_none_hash(fn)
    hasher = get_request_block_hasher(BS, fn)
    rng = random.Random(0)
    rows = []
    for plen in map(int, args.prompt_lens.split(",")):
        prompt = [rng.randrange(100, 32000) for _ in range(plen)]
        runs = {"vllm": [], "relay": []}
        for i in range(args.rounds):
            for name in ("vllm", "relay"):
                runs[name].append(one_round(prompt, args.n, name == "relay", hasher, f"{name}{i}-"))
        row = {"prompt_len": plen, "n": args.n}
        for name, rs in runs.items():
            for key in ("lookup_us", "estimate_us"):
                row[f"{name}_{key}"] = statistics.median(r[key] for r in rs)
        rows.append(row)
    cpu = platform.processor() or platform.machine()
    lines = [f"CPU: {cpu}, {os.cpu_count()} cores; n = {args.n} samples, "
             f"median of {args.rounds} rounds, microseconds a request", "",
             "| prompt tokens | lookup, vLLM | lookup, relay | cached-token count, vLLM | the same, relay |",
             "|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['prompt_len']} | {r['vllm_lookup_us']:.0f} | {r['relay_lookup_us']:.0f} | "
                     f"{r['vllm_estimate_us']:.1f} | {r['relay_estimate_us']:.1f} |")
    md = "\n".join(lines) + "\n"
    print(md)
    if args.out:
        os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
        json.dump({"args": vars(args), "rows": rows}, open(args.out, "w"), indent=1)
        open(os.path.splitext(args.out)[0] + ".md", "w").write(md)


if __name__ == "__main__":
    main()
