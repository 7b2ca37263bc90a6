"""Sweep the fused Triton level kernel's tile (GPU, vllm==0.26.0).

The fused level (`ops/level_attention.py`) is one launch, so a CUDA graph holding it costs plain
requests about 4 us per layer where the FlashAttention level (gather + FA3 + fusion) costs 10-15
(`results/layer_h200.md`); but with many rows it is slower than FA3. This sweeps its tile (query
rows per program, keys per iteration, warps, pipeline stages) on the layers of `bench_layer.Layer`
(n decode requests of one slot, S system tokens, c=128 own tokens, planned by the real planner,
timed as CUDA-graph replays), next to the FlashAttention level and the no-prompt ceiling.

Writes <out>/tune_level.{json,md}.
Usage: python3 benchmarks/tune_level.py [--models llama3-8b,llama2-7b] [--ns 64,256,512]
       [--system-lens 2048,8192] [--out DIR]
"""

import argparse
import itertools
import json
import os
import sys

import torch
import triton

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import vllm_relay.ops.level_attention as la  # noqa: E402
from bench_layer import Layer  # noqa: E402
from bench_ops import FA, MODELS, capture_graph  # noqa: E402

TILES = [dict(BLOCK_M=m, BLOCK_N=n, NUM_WARPS=w, NUM_STAGES=s)
         for m, n, w, s in itertools.product((64, 128), (32, 64, 128), (4, 8), (2, 3))]
DEFAULT = dict(BLOCK_M=la.BLOCK_M, BLOCK_N=la.BLOCK_N, NUM_WARPS=la.NUM_WARPS, NUM_STAGES=la.NUM_STAGES)


def graph_us(fn) -> float:
    try:
        fn()
        torch.cuda.synchronize()
        return triton.testing.do_bench(capture_graph(fn).replay, warmup=10, rep=40, return_mode="median") * 1e3
    except Exception as e:  # noqa: BLE001 - a tile that does not fit (shared memory) is reported, not fatal
        print(f"  failed: {type(e).__name__}: {str(e)[:160]}", flush=True)
        return float("nan")


def set_tile(tile: dict) -> None:
    for k, v in tile.items():
        setattr(la, k, v)


def main(args) -> None:
    fa, rows = FA(), []
    for model in args.models.split(","):
        hq, hkv = MODELS[model]
        for S in map(int, args.system_lens.split(",")):
            for n in map(int, args.ns.split(",")):
                set_tile(DEFAULT)
                layer = Layer(fa, hq, hkv, n, S, 128)
                row = dict(model=model, S=S, n=n)
                os.environ["VLLM_RELAY_LEVEL_KERNEL"] = "flash"
                row["noprompt_us"] = graph_us(layer.call(layer.plan("never", True, plain=True)[0]))
                row["flash_us"] = graph_us(layer.call(layer.plan("always", True)[0]))
                row["flash_empty_us"] = graph_us(layer.call(layer.plan("always", True, plain=True)[0]))
                os.environ["VLLM_RELAY_LEVEL_KERNEL"] = "triton"
                row["tiles"] = []
                for tile in TILES:
                    set_tile(tile)
                    us = graph_us(layer.call(layer.plan("always", True)[0]))
                    row["tiles"].append(dict(tile, us=us))
                set_tile(DEFAULT)
                best = min((t for t in row["tiles"] if t["us"] == t["us"]), key=lambda t: t["us"], default=None)
                row["best"] = best
                row["default_us"] = next(t["us"] for t in row["tiles"] if all(t[k] == v for k, v in DEFAULT.items()))
                rows.append(row)
                print(f"{model} S={S} n={n}: no prompt {row['noprompt_us']:.1f}, flash {row['flash_us']:.1f} "
                      f"(empty {row['flash_empty_us']:.1f}), triton default {row['default_us']:.1f}, best "
                      f"{best and best['us']:.1f} {best}", flush=True)
                del layer
                torch.cuda.empty_cache()
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "tune_level.json"), "w") as f:
        json.dump(dict(gpu=torch.cuda.get_device_name(), default=DEFAULT, rows=rows), f, indent=1)
    lines = [f"# Fused Triton level: tile sweep on {torch.cuda.get_device_name()}", "",
             "Whole layer, CUDA-graph replay, us (median); c=128 own tokens per request. Default tile "
             f"{DEFAULT}.", "",
             "| model | S | n | no prompt | FA level | triton, default tile | triton, best tile | best tile |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        b = r["best"] or {}
        lines.append(f"| {r['model']} | {r['S']} | {r['n']} | {r['noprompt_us']:.1f} | {r['flash_us']:.1f} | "
                     f"{r['default_us']:.1f} | {b.get('us', float('nan')):.1f} | "
                     f"{b.get('BLOCK_M')}/{b.get('BLOCK_N')}/{b.get('NUM_WARPS')}w/{b.get('NUM_STAGES')}s |")
    with open(os.path.join(args.out, "tune_level.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", default="llama3-8b,llama2-7b")
    p.add_argument("--ns", default="64,256,512")
    p.add_argument("--system-lens", default="2048,8192")
    p.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results"))
    main(p.parse_args())
