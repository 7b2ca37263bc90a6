"""benchmarks/common.py: running one configuration's process and reading back its result, the engine
arguments every configuration gets, and the requests without their system prompt."""

import argparse
import ast
import json
import sys
from types import SimpleNamespace

import pytest

from tests.benchmarks import BENCH, load

common = load("common")


def test_model_config_reads_the_folders_config_json(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"vocab_size": 32000}))
    assert common.model_config(str(tmp_path))["vocab_size"] == 32000


def test_result_line_is_the_workers_result_and_none_without_one():
    log = "INFO starting\nRESULT {\"config\": \"relay\", \"single\": {\"requests_per_s\": 7.5}}\nINFO done\n"
    assert common.result_line(log) == {"config": "relay", "single": {"requests_per_s": 7.5}}
    assert common.result_line("Traceback (most recent call last):\n") is None


def test_run_logged_keeps_the_log_beside_out_and_returns_the_exit_code(tmp_path):
    args = type("Args", (), {"out": str(tmp_path / "r.json"), "profile": None})()
    cmd = [sys.executable, "-c", "import sys; print('RESULT {\"x\": 1}'); sys.exit(3)"]
    log, rc = common.run_logged(cmd, args, "relay")
    assert rc == 3 and common.result_line(log) == {"x": 1}
    assert (tmp_path / "r.relay.log").read_text() == log


def test_worker_command_repeats_this_run_for_one_config(monkeypatch):
    monkeypatch.setattr(sys, "argv", ["bench_x.py", "--model", "m", "--out", "o.json"])
    assert common.worker_command("/b/bench_x.py", "noprefix") == [
        sys.executable, "/b/bench_x.py", "--model", "m", "--out", "o.json", "--worker", "noprefix"]


def args(**kw):
    base = dict(model="m", max_model_len=512, seed=0, tensor_parallel_size=1, iteration_details=False,
                gpu_memory_utilization=None, max_num_seqs=None, max_cudagraph_capture_size=None,
                shared_path=None, profile=None, engine_args={})
    return SimpleNamespace(**{**base, **kw})


def test_max_num_seqs_reaches_every_config_and_only_when_given():
    for config in ("default", "relay", "noprefix", "noprefix-relay"):
        assert common.engine_kwargs(args(max_num_seqs=96), config, [[1, 2, 3]])["max_num_seqs"] == 96
        assert "max_num_seqs" not in common.engine_kwargs(args(), config, [[1, 2, 3]])
    relay = common.engine_kwargs(args(max_num_seqs=96), "relay", [[1, 2, 3]])
    assert relay["attention_backend"] == "relay"
    assert relay["additional_config"]["relay"]["max_prompt_tokens"] == 3


def test_engine_args_turn_a_feature_on_for_every_config_beside_its_own_arguments():
    fp8 = {"kv_cache_dtype": "fp8"}
    for config in ("default", "relay", "noprefix", "noprefix-relay"):
        kw = common.engine_kwargs(args(engine_args=fp8), config, [[1, 2, 3]])
        assert kw["kv_cache_dtype"] == "fp8" and kw["model"] == "m", kw
    assert common.engine_kwargs(args(engine_args=fp8), "relay", [[1, 2]])["attention_backend"] == "relay"
    p = argparse.ArgumentParser()
    common.add_workload_args(p)
    assert p.parse_args(["--model", "m"]).engine_args == {}
    assert p.parse_args(["--model", "m", "--engine-args", '{"kv_cache_dtype": "fp8"}']).engine_args == fp8
    with pytest.raises(SystemExit):  # a JSON value that is not an object: argparse's error
        p.parse_args(["--model", "m", "--engine-args", "[1]"])


def test_strip_system_keeps_bos_and_the_requests_own_tokens():
    systems = [[1, 7, 7], [1, 7, 7, 8, 8]]
    prompts = [[1, 7, 7, 5], [1, 7, 7, 8, 8, 6], [1, 9]]
    assert common.strip_system(prompts, systems) == [[1, 5], [1, 6], [1, 9]]  # the longest prompt that matches
    # With no shared prompt (the single workload at --prefix-len 0 shares only BOS), nothing changes
    assert common.strip_system(prompts, [[1]]) == prompts


def test_no_benchmark_imports_another_benchmarks_internals():
    scripts = {p.stem for p in BENCH.glob("*.py")} - {"common"}
    for path in BENCH.glob("*.py"):
        nodes = list(ast.walk(ast.parse(path.read_text())))
        imported = {n.module for n in nodes if isinstance(n, ast.ImportFrom)} | {
            a.name for n in nodes if isinstance(n, ast.Import) for a in n.names}
        assert not imported & scripts, f"{path.name} imports {imported & scripts}: shared helpers go in common.py"


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
    text = common.trace_summary(common.trace_events(write_trace(tmp_path / "t.json", TRACE)), gap_ms=0.4)
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
    assert common.trace_summary(common.trace_events(str(path)), gap_ms=1.0).splitlines()[1].startswith(
        "GPU idle gaps of 1.0 ms or more: 1, 3.00 ms")
    assert common.trace_summary([]) == "no complete events in the trace\n"


def write_trace(path, events):
    path.write_text(json.dumps({"traceEvents": events}))
    return str(path)
