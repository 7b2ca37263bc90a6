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
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import vllm_relay.ops.level_attention as la  # noqa: E402
from bench_layer import add_grid_args, graph_ms, layer_grid, write_results  # noqa: E402
from bench_ops import FA  # noqa: E402

TILES = [dict(BLOCK_M=m, BLOCK_N=n, NUM_WARPS=w, NUM_STAGES=s)
         for m, n, w, s in itertools.product((64, 128), (32, 64, 128), (4, 8), (2, 3))]
DEFAULT = dict(BLOCK_M=la.BLOCK_M, BLOCK_N=la.BLOCK_N, NUM_WARPS=la.NUM_WARPS, NUM_STAGES=la.NUM_STAGES)


def graph_us(fn) -> float:
    """Median us of a graph replay; NaN for a tile that does not fit (shared memory), reported."""
    return graph_ms(fn, rep=40) * 1e3


def set_tile(tile: dict) -> None:
    for k, v in tile.items():
        setattr(la, k, v)


def main(args) -> None:
    rows = []
    set_tile(DEFAULT)  # a planner plans for the tile set when it is made (each `layer.plan` makes one)
    grid = layer_grid(FA(), args.models.split(","), list(map(int, args.system_lens.split(","))),
                      list(map(int, args.ns.split(","))))
    for model, S, n, layer in grid:
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
    write_results(args.out, "tune_level", dict(gpu=torch.cuda.get_device_name(), default=DEFAULT, rows=rows),
                  "\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_grid_args(p, models="llama3-8b,llama2-7b", ns="64,256,512", system_lens="2048,8192")
    main(p.parse_args())
