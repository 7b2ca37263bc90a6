"""benchmarks/traces.py: a torch profiler trace left as text, on small traces made by hand."""

import json

from tests.benchmarks import load

traces = load("traces")


# A torch profiler trace summed up (`trace_summary`): a small trace made by hand.

def trace_event(cat, name, start_ms, end_ms, tid=1):
    return {"ph": "X", "cat": cat, "name": name, "ts": 1e6 + start_ms * 1e3, "dur": (end_ms - start_ms) * 1e3,
            "pid": 7, "tid": tid}


TRACE = [
    trace_event("user_annotation", "execute_model", 0.0, 1.5),
    trace_event("user_annotation", "inner_range", 0.2, 0.4),            # inside execute_model: not listed
    trace_event("kernel", "gemm", 0.5, 1.2, tid=99),
    trace_event("kernel", "attn", 1.0, 2.0, tid=98),                    # overlaps gemm: one busy interval 0.5-2.0
    trace_event("user_annotation", "schedule", 2.0, 4.5),
    trace_event("user_annotation", "execute_model", 4.5, 6.5),
    trace_event("gpu_memcpy", "HtoD", 5.0, 5.2, tid=97),
    trace_event("kernel", "gemm", 5.2, 6.0, tid=99),
    {"ph": "i", "name": "marker", "ts": 1e6},                     # not a complete event: ignored
]


def test_trace_gaps_are_where_the_gpu_waited_and_name_the_host_work(tmp_path):
    text = traces.trace_summary(traces.trace_events(write_trace(tmp_path / "t.json", TRACE)), gap_ms=0.4)
    lines = text.splitlines()
    assert lines[0] == "trace span 6.50 ms; GPU busy 2.50 ms in 2 intervals"
    assert lines[1].startswith("GPU idle gaps of 0.4 ms or more: 3, 4.00 ms")
    gaps = [line.split() for line in lines[2:5]]
    assert [g[:2] for g in gaps] == [["0.00", "0.50"], ["2.00", "3.00"], ["6.00", "0.50"]]
    assert lines[3].split("  ")[-1] == "schedule 2.50; execute_model 0.50"
    host = lines[lines.index(next(x for x in lines if x.startswith("host ranges"))) + 1:]
    assert [h.split()[-1] for h in host] == ["execute_model", "schedule", "execute_model"]


def test_trace_summary_reads_gzipped_traces_and_one_without_events(tmp_path):
    import gzip

    path = tmp_path / "t.json.gz"
    with gzip.open(path, "wt") as f:
        json.dump({"traceEvents": TRACE}, f)
    assert traces.trace_summary(traces.trace_events(str(path)), gap_ms=1.0).splitlines()[1].startswith(
        "GPU idle gaps of 1.0 ms or more: 1, 3.00 ms")
    assert traces.trace_summary([]) == "no complete events in the trace\n"


def write_trace(path, events):
    path.write_text(json.dumps({"traceEvents": events}))
    return str(path)


# Each step's GPU work (`trace_steps`): kernels follow their launch's correlation id to the host range
# that launched them, whenever they run.

def launch(name, at_ms, correlation, tid=1):
    return {**trace_event("cuda_runtime", name, at_ms, at_ms + 0.01, tid=tid), "args": {"correlation": correlation}}


def kernel(name, start_ms, end_ms, correlation):
    return {**trace_event("kernel", name, start_ms, end_ms, tid=99), "args": {"correlation": correlation}}


STEPS = [
    trace_event("user_annotation", "execute_a", 0.0, 2.0),
    trace_event("user_annotation", "execute_b", 3.0, 5.0),
    launch("cudaLaunchKernel", 0.1, 1), launch("cudaLaunchKernel", 0.3, 2),
    launch("cudaGraphLaunch", 3.2, 3),                                  # one replay: three kernels
    launch("cudaLaunchKernel", 2.5, 4),                                 # between the ranges: no step's
    launch("cudaLaunchKernel", 0.5, 5, tid=2),                          # another thread, inside a's time
    kernel("gemm", 0.5, 1.0, 1), kernel("attn", 1.0, 1.6, 2),
    kernel("gemm", 5.0, 5.5, 3), kernel("attn", 5.5, 5.7, 3), kernel("gemm", 6.0, 6.5, 3),  # after b's host range
    kernel("copy", 2.6, 2.8, 4), kernel("other", 0.6, 0.9, 5),
]


def test_trace_steps_puts_each_kernel_under_the_range_that_launched_it(tmp_path):
    text = traces.trace_steps(traces.trace_events(write_trace(tmp_path / "s.json", STEPS)), top=1)
    lines = text.splitlines()
    assert lines[0].startswith("GPU work by the host range that launched it") and "the 2 of 2 with the most" in lines[0]
    assert lines[1].split() == ["0.00", "1.10", "1.10", "2", "execute_a"]
    assert lines[2].split() == ["0.60", "x1", "attn"]                 # the heaviest of a's
    assert lines[3].split() == ["3.00", "1.50", "1.20", "3", "execute_b"]
    assert lines[4].split() == ["1.00", "x2", "gemm"]
    assert len(lines) == 5                                           # copy (no range) and other (thread 2): nowhere


def test_trace_steps_says_when_nothing_matched():
    assert traces.trace_steps([trace_event("kernel", "gemm", 0.0, 1.0)]).startswith(
        "GPU work by host range: no kernel matched")
