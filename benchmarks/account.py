"""Account for every millisecond between two configurations' runs of one workload (issue 16 point 1).

`bench_throughput.py --profile 0,0 --repeat N` profiles each configuration's whole first run (the
median of the later runs, unprofiled, gives the gap without the profiler's cost) and keeps, per engine step, its
cycle time, GPU busy time by kernel family and idle time (`trace_steps.py`, `steps_0.json` of rank 0).
This splits the difference of the two profiled runs' times into rows that add up to it exactly:

  steps            how many engine steps each ran (a count, no time)
  <kind> <part>    for steps with prompt tokens ("prefill": prompt chunks, or the tokens of a preempted
                   request computed again, with or without decodes; vLLM's annotation counts a
                   resumed request's tokens as generation in one runner and as context in the other)
                   and decode-only steps (one token per request): the GPU's busy time per kernel
                   family (attention, relay's own kernels, GEMMs, other kernels), less what kernels on
                   other streams overlap, and its idle time (waiting on the host)
  outside steps    the run's time outside the profiled steps: before the first step starts, the last
                   step (which has no next start), and the host's work after it

With --recompute the prefill steps split in two: "prompt" (steps with prompt chunks) and
"recompute" (steps without any in which a request computes more than one token: a preempted request
computed again, whose tokens vLLM's V1 runner annotates as generation). Only where both
configurations run on the V1 runner (relay, noprefix-relay): Model Runner V2 annotates those tokens
as context.

Usage: python3 benchmarks/account.py RESULT.json [--a relay --b noprefix] [--workload single] [--out F]
       [--unprofiled MORE.json ...] [--recompute]
(RESULT.json is bench_throughput.py's --out; the profiles lie beside it, as it leaves them. MORE.json:
more runs of both configurations without the profiler, e.g. from the next call on the same machine;
their runs join the later runs of RESULT.json in the unprofiled gap's medians. One run a side is 1-2%
of noise on a gap of a few percent.)
"""

import argparse
import json
import os
import sys
from types import SimpleNamespace

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_throughput import profile_dir  # noqa: E402

FAMILIES = ("attention", "relay", "gemm", "other")
KINDS = ("prefill", "decode")
SPLIT_KINDS = ("prompt", "recompute", "decode")  # --recompute
PARTS = (*FAMILIES, "overlap", "idle")
NAMES = {"idle": "GPU idle", "overlap": "kernel overlap"}


def kind_of(r: dict, split: bool = False) -> str:
    """A trace_steps row's kind of step: one of KINDS, or with `split` of SPLIT_KINDS."""
    if r["ctx_tokens"]:
        return "prompt" if split else "prefill"
    if r["gen_tokens"] > r["gen_reqs"]:
        return "recompute" if split else "prefill"
    return "decode"


def totals(rows: list[dict], split: bool = False) -> dict:
    """Seconds per (kind, part) and step counts per kind, from trace_steps rows (us)."""
    kinds = SPLIT_KINDS if split else KINDS
    out = {(k, p): 0.0 for k in kinds for p in PARTS}
    count = dict.fromkeys(kinds, 0)
    for r in rows:
        kind = kind_of(r, split)
        count[kind] += 1
        for fam, us in r["families_us"].items():
            out[kind, fam if fam in FAMILIES else "other"] += us / 1e6
        out[kind, "idle"] += r["idle_us"] / 1e6
        # busy is the union of the kernels' intervals, the families sum their durations: kernels
        # that overlap (other streams) count twice there, and this row takes it back (<= 0).
        out[kind, "overlap"] += (r["busy_us"] - sum(r["families_us"].values())) / 1e6
    return {"seconds": out, "steps": count, "in_steps": sum(r["cycle_us"] for r in rows) / 1e6}


def account(rows_a: list[dict], elapsed_a: float, rows_b: list[dict], elapsed_b: float,
            split: bool = False) -> list[dict]:
    """Rows (name, a, b, a - b) whose differences add up to elapsed_a - elapsed_b (`split`: the
    prefill steps as prompt and recompute steps)."""
    ta, tb = totals(rows_a, split), totals(rows_b, split)
    table = [{"row": f"{k} steps", "a": ta["steps"][k], "b": tb["steps"][k], "diff": None} for k in ta["steps"]]
    for k in ta["steps"]:
        for p in PARTS:
            a, b = ta["seconds"][k, p], tb["seconds"][k, p]
            table.append({"row": f"{k}: {NAMES.get(p, p)}", "a": a, "b": b, "diff": a - b})
    a, b = elapsed_a - ta["in_steps"], elapsed_b - tb["in_steps"]
    table.append({"row": "outside steps", "a": a, "b": b, "diff": a - b})
    table.append({"row": "run time", "a": elapsed_a, "b": elapsed_b, "diff": elapsed_a - elapsed_b})
    return table


def markdown(table: list[dict], names: tuple[str, str], unprofiled: tuple[float, float] | None,
             runs: tuple[int, int] | None = None) -> str:
    a, b = names
    gap = table[-1]["diff"]
    lines = [f"| row | {a} | {b} | {a} - {b} | share of the gap |", "|---|---|---|---|---|"]
    for r in table:
        if r["diff"] is None:
            lines.append(f"| {r['row']} | {r['a']} | {r['b']} | | |")
            continue
        share = f"{r['diff'] / gap:.0%}" if gap else ""
        lines.append(f"| {r['row']} | {r['a']:.3f} s | {r['b']:.3f} s | {r['diff'] * 1e3:+.0f} ms | {share} |")
    parts = sum(r["diff"] for r in table[:-1] if r["diff"] is not None)
    lines.append("")
    lines.append(f"The rows add up to {parts * 1e3:+.0f} ms; the profiled runs' gap is {gap * 1e3:+.0f} ms.")
    if unprofiled:
        ua, ub = unprofiled
        count = f": {runs[0]} and {runs[1]}" if runs else ""
        line = (f"Without the profiler (the median of each engine's unprofiled runs{count}): "
                f"{a} {ua:.3f} s, {b} {ub:.3f} s, ")
        if ua == ub:
            line += "no gap."
        else:
            line += (f"gap {(ua - ub) * 1e3:+.0f} ms ({ua / ub:.3f}x the time); the rows add up to "
                     f"{parts / (ua - ub):.1%} of it.")
        lines.append(line)
    return "\n".join(lines) + "\n"


def load(result_path: str, config: str, workload: str) -> tuple[list[dict], float, float | None]:
    """(step rows of the profiled run, its seconds, the median seconds of the later, unprofiled runs
    or None)."""
    later = run_seconds(result_path, config, workload, profiled=True)
    run = json.load(open(result_path))[config][workload]
    folder = profile_dir(SimpleNamespace(out=result_path), config)
    steps = json.load(open(os.path.join(folder, "steps_0.json")))
    if "steps" not in steps:
        raise SystemExit(f"{folder}/steps_0.json holds no steps: {steps.get('error', steps)}")
    return steps["steps"], run["elapsed_s"], float(np.median(later)) if later else None


def run_seconds(result_path: str, config: str, workload: str, profiled: bool | None = None) -> list[float]:
    """The seconds of each unprofiled run of `config` in a bench_throughput result: its first run is
    left out when it was profiled (`profiled`; None: when the result's arguments name a profile)."""
    result = json.load(open(result_path))
    if config not in result:
        configs = ", ".join(k for k in result if k != "args")
        raise SystemExit(f"{result_path} has no run of {config} (configs: {configs})")
    run = result[config][workload]
    runs = run.get("runs_requests_per_s", [])
    if profiled is None:
        profiled = bool(result.get("args", {}).get("profile"))  # bench_throughput profiles the first run
    return [run["requests"] / r for r in runs[1 if profiled else 0:]]


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("result")
    p.add_argument("--a", default="relay")
    p.add_argument("--b", default="noprefix")
    p.add_argument("--workload", default="single")
    p.add_argument("--out", help="markdown here, and the rows as JSON beside it (<stem>.rows.json: "
                                 "<stem>.json is bench_throughput's result)")
    p.add_argument("--unprofiled", nargs="*", default=[], help="more bench_throughput results of both "
                   "configs, run without the profiler: their runs join the unprofiled medians")
    p.add_argument("--recompute", action="store_true", help="prefill steps split into prompt and recompute "
                   "steps (both configurations on vLLM's V1 runner)")
    args = p.parse_args()
    rows_a, ea, _ = load(args.result, args.a, args.workload)
    rows_b, eb, _ = load(args.result, args.b, args.workload)
    sa, sb = ([t for path, profiled in ((args.result, True), *((u, None) for u in args.unprofiled))
               for t in run_seconds(path, c, args.workload, profiled)] for c in (args.a, args.b))
    ua, ub = (float(np.median(s)) if s else None for s in (sa, sb))
    table = account(rows_a, ea, rows_b, eb, split=args.recompute)
    md = markdown(table, (args.a, args.b), (ua, ub) if ua and ub else None, (len(sa), len(sb)))
    print(md)
    if args.out:
        with open(args.out, "w") as f:
            f.write(md)
        with open(os.path.splitext(args.out)[0] + ".rows.json", "w") as f:
            json.dump({"a": args.a, "b": args.b, "rows": table, "unprofiled_s": [ua, ub],
                       "unprofiled_runs_s": [sa, sb]}, f, indent=1)


if __name__ == "__main__":
    main()
