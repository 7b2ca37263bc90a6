"""A torch profiler trace summed up as text, small enough to keep where the trace (hundreds of MB) is not:
when the GPU waited and on what host work (`trace_summary`), and what each step's GPU work was
(`trace_steps`: its span, busy time and heaviest kernels, by the host range that launched them).
bench_sharing.py's `--profile` keeps it beside vLLM's kernel table (`drop_traces`)."""

import glob
import gzip
import json
import os
from bisect import bisect_right


TRACE_GPU_CATS = ("kernel", "gpu_memcpy", "gpu_memset")  # a trace's GPU work


def trace_events(path: str) -> list[dict]:
    """The complete ("X") events of a trace file, plain or gzipped JSON."""
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt") as f:
        data = json.load(f)
    events = data["traceEvents"] if isinstance(data, dict) else data
    return [e for e in events if e.get("ph") == "X" and "ts" in e and "dur" in e]


def trace_busy(events: list[dict]) -> list[tuple[float, float]]:
    """The GPU's work (kernels, copies, sets on any stream) merged into disjoint [start, end) intervals, us."""
    spans = sorted((float(e["ts"]), float(e["ts"]) + float(e["dur"]))
                   for e in events if e.get("cat") in TRACE_GPU_CATS)
    merged: list[list[float]] = []
    for start, end in spans:
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return [(a, b) for a, b in merged]


def trace_outermost(events: list[dict]) -> list[dict]:
    """Each thread's annotated host ranges not inside another of that thread's, in time order."""
    out = []
    by_thread: dict = {}
    for e in sorted((e for e in events if e.get("cat") == "user_annotation"),
                    key=lambda e: (float(e["ts"]), -float(e["dur"]))):
        key = (e.get("pid"), e.get("tid"))
        end = by_thread.get(key, float("-inf"))
        if float(e["ts"]) >= end:
            out.append(e)
            by_thread[key] = float(e["ts"]) + float(e["dur"])
    return out


def trace_summary(events: list[dict], gap_ms: float = 0.5, most: int = 80) -> str:
    """When the GPU waited, and for what, from a torch profiler trace's events (`trace_events`; Chrome trace
    format: "X" events with `ts` and `dur` in us), as text, times in ms from the trace's first event: the GPU's
    busy time over the span, every idle gap of at least `gap_ms` between its kernels, memcpys and memsets
    with the host's annotated ranges (`user_annotation`: `record_function`) overlapping it most, and the
    host's outermost ranges in time order (`most` of them). A trace is too large to keep (hundreds of MB);
    its kernel table (profiler_out_0.txt) sums kernels but says nothing of the GPU's waits."""
    if not events:
        return "no complete events in the trace\n"
    t0 = min(float(e["ts"]) for e in events)
    t1 = max(float(e["ts"]) + float(e["dur"]) for e in events)
    busy = trace_busy(events)
    ranges = trace_outermost(events)
    ms = lambda us: (us - t0) / 1e3  # noqa: E731
    lines = [f"trace span {(t1 - t0) / 1e3:.2f} ms; GPU busy {sum(b - a for a, b in busy) / 1e3:.2f} ms "
             f"in {len(busy)} intervals"]
    gaps = [(a, b) for a, b in zip([t0] + [end for _, end in busy], [start for start, _ in busy] + [t1])
            if b - a >= gap_ms * 1e3]
    lines.append(f"GPU idle gaps of {gap_ms} ms or more: {len(gaps)}, {sum(b - a for a, b in gaps) / 1e3:.2f} ms "
                 "(start ms, length ms: the host's ranges overlapping it most)")
    for a, b in gaps:
        overlap = sorted(((min(b, float(e["ts"]) + float(e["dur"])) - max(a, float(e["ts"])), e["name"])
                          for e in ranges if float(e["ts"]) < b and float(e["ts"]) + float(e["dur"]) > a),
                         reverse=True)[:3]
        what = "; ".join(f"{name[:60]} {t / 1e3:.2f}" for t, name in overlap) or "no annotated host work"
        lines.append(f"  {ms(a):10.2f} {(b - a) / 1e3:8.2f}  {what}")
    lines.append(f"host ranges (outermost of each thread; start ms, length ms, name), the first {most}:")
    for e in ranges[:most]:
        lines.append(f"  {ms(float(e['ts'])):10.2f} {float(e['dur']) / 1e3:8.2f}  {e['name'][:100]}")
    if len(ranges) > most:
        lines.append(f"  (+{len(ranges) - most} more)")
    return "\n".join(lines) + "\n"


def trace_steps(events: list[dict], top: int = 6, most: int = 12) -> str:
    """Each outermost host range's GPU work (a step's `execute_*` range), as text: the kernels, copies and sets
    its thread launched inside it (matched by the launch's correlation id; a CUDA graph's replay launches all
    of its kernels at once), their span from the first start to the last end, the GPU's busy time within,
    and the `top` heaviest by name (total ms x count); the `most` ranges with the most GPU time, in time order.
    Times in ms, starts from the trace's first event."""
    gpu = [e for e in events if e.get("cat") in TRACE_GPU_CATS]
    launch = {e["args"]["correlation"]: (float(e["ts"]), (e.get("pid"), e.get("tid")))
              for e in events if e.get("cat") in ("cuda_runtime", "cuda_driver") and "correlation" in e.get("args", {})}
    by_thread: dict = {}
    for r in trace_outermost(events):
        by_thread.setdefault((r.get("pid"), r.get("tid")), []).append(r)
    starts = {key: [float(r["ts"]) for r in rs] for key, rs in by_thread.items()}
    work: dict = {}
    for k in gpu:
        ts, thread = launch.get(k.get("args", {}).get("correlation"), (None, None))
        if ts is None or thread not in by_thread:
            continue
        i = bisect_right(starts[thread], ts) - 1
        if i >= 0 and ts <= starts[thread][i] + float(by_thread[thread][i]["dur"]):
            work.setdefault(id(by_thread[thread][i]), (by_thread[thread][i], []))[1].append(k)
    if not work:
        return "GPU work by host range: no kernel matched to a launch inside an annotated range\n"
    t0 = min(float(e["ts"]) for e in events)
    busy = [(r, ks, sum(b - a for a, b in trace_busy(ks)) / 1e3) for r, ks in work.values()]
    ranked = sorted(busy, key=lambda rkb: rkb[2], reverse=True)[:most]
    lines = [f"GPU work by the host range that launched it (start ms, GPU span ms, busy ms, kernels; "
             f"the {top} heaviest: total ms x count), the {len(ranked)} of {len(work)} with the most:"]
    for r, ks, busy_ms in sorted(ranked, key=lambda rkb: float(rkb[0]["ts"])):
        first, last = min(float(k["ts"]) for k in ks), max(float(k["ts"]) + float(k["dur"]) for k in ks)
        names: dict = {}
        for k in ks:
            total, count = names.get(k["name"], (0.0, 0))
            names[k["name"]] = (total + float(k["dur"]), count + 1)
        heavy = sorted(names.items(), key=lambda kv: kv[1][0], reverse=True)[:top]
        lines.append(f"  {(float(r['ts']) - t0) / 1e3:10.2f} {(last - first) / 1e3:8.2f} {busy_ms:8.2f} "
                     f"{len(ks):6d}  {r['name'][:100]}")
        lines += [f"      {total / 1e3:8.2f} x{count:<5d} {name[:110]}" for name, (total, count) in heavy]
    return "\n".join(lines) + "\n"


def drop_traces(folder: str) -> None:
    """Keep vLLM's kernel table (profiler_out_0.txt) and each trace's text (`trace_summary` and `trace_steps`:
    when the GPU waited, on what host work, and each step's kernels) in `<trace>.timeline.txt`, not the
    traces (hundreds of MB each)."""
    for trace in glob.glob(os.path.join(folder, "*.pt.trace.json*")):
        try:
            events = trace_events(trace)
            text = trace_summary(events) + trace_steps(events)
        except (OSError, ValueError, KeyError) as e:  # a trace cut short: say so, drop it all the same
            text = f"trace not read: {type(e).__name__}: {e}\n"
        with open(f"{trace}.timeline.txt", "w") as f:
            f.write(text)
        os.remove(trace)
