"""Engine steps in a torch-profiler trace: each step's cycle time, GPU busy time by kernel family, idle.

vLLM's torch profiler (`--profile DELAY,STEPS` of bench_throughput.py / bench_sharing.py) writes a
Chrome trace per worker. Its GPU-side annotations `execute_context_<R>(<T>)_generation_<R>(<T>)`
mark each step; its kernels carry their GPU start and duration. For each step (from one annotation
to the next) this reports:
  cycle   the time from the step's start to the next step's start (what the engine pays per step)
  busy    the union of the kernels' intervals in that span (the GPU at work)
  idle    cycle - busy (the GPU waiting on the host: scheduling, inputs, sampling, output)
  and busy time per kernel family (attention, relay's own kernels, GEMMs, the rest).
The last annotated step has no next start and is left out. Without GPU-side annotations in the
trace, the host's (`user_annotation`, launch times) mark the steps instead. With `--idle-host N`, the N
steps that idled longest also get `idle_host`: what the host was in while their GPU idled (vLLM's
annotations, torch ops, CUDA runtime calls, Python functions overlapping the idle spans, us per name, the
longest, and the idle time no host event covered). `kernels` tables the kernels of the decode steps (no
prompt tokens) by their whole name and launch grid: which call of a family costs what (vLLM's own table
cuts the names; FlashAttention's attention and split-combine kernels differ only in template arguments).
Traces are large: run this on the GPU host and keep its JSON (bench_throughput.py does when it drops
the traces).
Usage: python3 benchmarks/trace_steps.py TRACE.json[.gz] [--idle-host N] [--out steps.json]
"""

import argparse
import bisect
import gzip
import json
import re
import statistics

STEP = re.compile(r"execute_context_(\d+)\((\d+)\)_generation_(\d+)\((\d+)\)")
FAMILIES = [  # first match wins
    ("relay", re.compile(r"_fuse_in_place_kernel|_relay_fusion_kernel|_gather_rows_kernel|"
                         r"_prefix_block_table_kernel|_level_kernel")),
    ("attention", re.compile(r"flash|FlashAttn|attention|paged", re.I)),
    ("gemm", re.compile(r"nvjet|gemm|xmma|cutlass.*(Kernel|kernel)|sm90_", re.I)),
]


def family(name: str) -> str:
    for fam, pat in FAMILIES:
        if pat.search(name):
            return fam
    return "other"


def load(path: str) -> list[dict]:
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt") as f:
        data = json.load(f)
    return data["traceEvents"] if isinstance(data, dict) else data


def union_length(intervals: list[tuple[float, float]]) -> float:
    total, end = 0.0, float("-inf")
    for a, b in sorted(intervals):
        if b <= end:
            continue
        total += b - max(a, end)
        end = b
    return total


def idle_spans(spans: list[tuple[float, float]], t0: float, t1: float) -> list[tuple[float, float]]:
    """The parts of [t0, t1) that no span covers."""
    gaps, end = [], t0
    for a, b in sorted(spans):
        if a > end:
            gaps.append((end, min(a, t1)))
        end = max(end, b)
    if end < t1:
        gaps.append((end, t1))
    return [(a, b) for a, b in gaps if b > a]


HOST_CATS = ("user_annotation", "cpu_op", "cuda_runtime", "python_function")
UNCOVERED = "(no host event)"  # idle time no host event covers: Python outside vLLM's scopes and torch's ops


def host_during(events: list[dict], windows: list[tuple[float, float, int]], top: int = 8) -> dict:
    """Microseconds of each host event name (HOST_CATS) inside the windows (start, end, label), per
    label, the `top` longest, and the windows' time that no host event covers (UNCOVERED: the host
    in Python outside vLLM's annotated scopes and torch's ops, e.g. garbage collection): one pass
    over the events."""
    windows = sorted(windows)
    starts = [w[0] for w in windows]
    longest = max((b - a for a, b, _ in windows), default=0.0)
    out: dict = {}
    covered: dict = {}  # window -> the host events' spans inside it
    for e in events:
        if e.get("ph") != "X" or e.get("cat") not in HOST_CATS:
            continue
        a = float(e["ts"])
        b = a + float(e.get("dur", 0))
        i = bisect.bisect_left(starts, a - longest)  # no window starting earlier reaches a
        while i < len(windows) and windows[i][0] < b:
            w0, w1, label = windows[i]
            overlap = min(b, w1) - max(a, w0)
            if overlap > 0:
                name = e.get("name", "")[:100]
                per = out.setdefault(label, {})
                per[name] = per.get(name, 0.0) + overlap
                covered.setdefault(i, []).append((max(a, w0), min(b, w1)))
            i += 1
    for i, (w0, w1, label) in enumerate(windows):
        per = out.setdefault(label, {})
        per[UNCOVERED] = per.get(UNCOVERED, 0.0) + (w1 - w0) - union_length(covered.get(i, []))
    return {label: dict(sorted(per.items(), key=lambda kv: -kv[1])[:top]) for label, per in out.items()}


def step_marks(events: list[dict], cat: str) -> list[dict]:
    """The step annotations of one track. The profiler repeats a GPU-side annotation on every stream
    that ran kernels inside it, cut to those kernels (relay's levels run on a second stream): the
    steps are the track whose annotations span the most time, the stream that ran the whole steps."""
    tracks = {}
    for e in events:
        if e.get("ph") == "X" and e.get("cat") == cat and STEP.fullmatch(e.get("name", "")):
            tracks.setdefault((e.get("pid"), e.get("tid")), []).append(e)
    if not tracks:
        return []
    marks = max(tracks.values(), key=lambda t: sum(float(e.get("dur", 0)) for e in t))
    return sorted(marks, key=lambda e: e["ts"])


def steps(events: list[dict], idle_host: int = 0) -> list[dict]:
    """One row per annotated step that has a next step (times in us); the `idle_host` steps that
    idled longest also say what the host was in meanwhile (`host_during`)."""
    marks = step_marks(events, "gpu_user_annotation") or step_marks(events, "user_annotation")
    kernels = sorted((e for e in events if e.get("ph") == "X" and e.get("cat") == "kernel"), key=lambda e: e["ts"])
    rows, kept, k = [], [], 0
    for mark, nxt in zip(marks, marks[1:]):
        t0, t1 = float(mark["ts"]), float(nxt["ts"])
        while k < len(kernels) and kernels[k]["ts"] < t0:
            k += 1
        spans, fams = [], {}
        j = k
        while j < len(kernels) and kernels[j]["ts"] < t1:
            a = float(kernels[j]["ts"])
            b = min(a + float(kernels[j]["dur"]), t1)
            spans.append((a, b))
            f = family(kernels[j]["name"])
            fams[f] = fams.get(f, 0.0) + (b - a)
            j += 1
        ctx_reqs, ctx_tokens, gen_reqs, gen_tokens = map(int, STEP.fullmatch(mark["name"]).groups())
        busy = union_length(spans)
        rows.append({"ctx_reqs": ctx_reqs, "ctx_tokens": ctx_tokens, "gen_reqs": gen_reqs, "gen_tokens": gen_tokens,
                     "cycle_us": t1 - t0, "busy_us": busy, "idle_us": t1 - t0 - busy, "families_us": fams})
        if idle_host:  # kept only when asked: the chosen steps' idle spans come from them
            kept.append((spans, t0, t1))
    chosen = sorted(range(len(rows)), key=lambda i: -rows[i]["idle_us"])[:idle_host]
    windows = [(a, b, i) for i in chosen for a, b in idle_spans(*kept[i])]
    during = host_during(events, windows) if chosen else {}
    for i in chosen:
        rows[i]["idle_host"] = during.get(i, {})
    return rows


def kernels(events: list[dict], top: int = 40) -> list[dict]:
    """The `top` kernels by GPU time inside decode steps (annotated steps with no prompt tokens), each by
    its whole name: calls, total and mean us, and per launch grid its calls and us (the grid, "x,y,z",
    from the trace's kernel args), the costliest grids first."""
    marks = step_marks(events, "gpu_user_annotation") or step_marks(events, "user_annotation")
    spans = [(float(m["ts"]), float(n["ts"])) for m, n in zip(marks, marks[1:])
             if int(STEP.fullmatch(m["name"]).group(2)) == 0]
    starts = [a for a, _ in spans]
    table = {}
    for e in events:
        if e.get("ph") != "X" or e.get("cat") != "kernel":
            continue
        i = bisect.bisect_right(starts, float(e["ts"])) - 1
        if i < 0 or float(e["ts"]) >= spans[i][1]:
            continue
        dur = float(e.get("dur", 0))
        row = table.setdefault(e["name"], {"name": e["name"], "calls": 0, "us": 0.0, "grids": {}})
        row["calls"] += 1
        row["us"] += dur
        grid = ",".join(map(str, (e.get("args") or {}).get("grid", []))) or "?"
        g = row["grids"].setdefault(grid, [0, 0.0])
        g[0] += 1
        g[1] += dur
    rows = sorted(table.values(), key=lambda r: -r["us"])[:top]
    for r in rows:
        r["mean_us"] = r["us"] / r["calls"]
        r["grids"] = [{"grid": k, "calls": c, "us": u} for k, (c, u) in sorted(r["grids"].items(), key=lambda kv: -kv[1][1])]
    return rows


def summary(rows: list[dict]) -> dict:
    """Medians over the steps, and totals (us)."""
    if not rows:
        return {"steps": 0}
    fams = sorted({f for r in rows for f in r["families_us"]})
    med = lambda key: statistics.median(r[key] for r in rows)  # noqa: E731
    return {"steps": len(rows), "cycle_us_median": med("cycle_us"), "busy_us_median": med("busy_us"),
            "idle_us_median": med("idle_us"),
            "families_us_median": {f: statistics.median(r["families_us"].get(f, 0.0) for r in rows) for f in fams},
            "cycle_us_total": sum(r["cycle_us"] for r in rows), "busy_us_total": sum(r["busy_us"] for r in rows)}


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("trace")
    p.add_argument("--idle-host", type=int, default=0, help="the steps that idled longest, their host work")
    p.add_argument("--out")
    args = p.parse_args()
    events = load(args.trace)
    rows = steps(events, args.idle_host)
    result = {"trace": args.trace, "summary": summary(rows), "steps": rows, "decode_kernels": kernels(events)}
    print(json.dumps(result["summary"], indent=1))
    if args.out:
        json.dump(result, open(args.out, "w"), indent=1)


if __name__ == "__main__":
    main()
