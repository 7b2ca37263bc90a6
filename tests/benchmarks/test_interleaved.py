"""benchmarks/bench_interleaved.py: medians, spreads and ratios of interleaved runs, against
hand-computed values."""

from types import SimpleNamespace

from tests.benchmarks import load

bench = load("bench_interleaved")


def test_summary_takes_medians_spreads_and_per_round_ratios():
    runs = {"noprefix": [{"requests_per_s": x} for x in (60.0, 75.0, 70.0)],
            "noprefix-relay": [{"requests_per_s": x} for x in (63.0, 69.0, 77.0)]}
    s = bench.summary(runs)
    assert s["noprefix"]["median"] == 70.0 and (s["noprefix"]["min"], s["noprefix"]["max"]) == (60.0, 75.0)
    assert s["noprefix-relay"]["median"] == 69.0
    assert abs(s["noprefix-relay"]["median_over_noprefix"] - 69.0 / 70.0) < 1e-12
    assert [round(x, 4) for x in s["noprefix-relay"]["per_round_over_noprefix"]] == [1.05, 0.92, 1.1]
    assert "median_over_noprefix" not in s["noprefix"]


def test_markdown_has_a_row_per_config_with_every_round():
    runs = {"a": [{"requests_per_s": x} for x in (1.0, 2.0)], "b": [{"requests_per_s": x} for x in (3.0, 4.0)]}
    args = SimpleNamespace(rounds=2, gpu_memory_utilization=0.45, workload="single")
    md = bench.markdown(bench.summary(runs), args)
    rows = [line for line in md.splitlines() if line.startswith("| a |") or line.startswith("| b |")]
    assert rows == ["| a | 1.00 | 2.00 | 1.50 | 1.00-2.00 |  |", "| b | 3.00 | 4.00 | 3.50 | 3.00-4.00 | **2.333** |"]
    assert "Per round, b / a: 3.000, 2.000" in md


def test_engine_arguments_come_from_bench_throughputs_engine_kwargs():
    """Every argument bench_throughput's engine_kwargs reads is set, with this benchmark's memory share."""
    args = bench.parse_args(["--model", "m", "--gpu-memory-utilization", "0.3"])
    kw = bench.engine_kwargs(args, "noprefix-relay", [])
    assert kw["gpu_memory_utilization"] == 0.3 and kw["attention_backend"] == "relay"
    assert kw["tensor_parallel_size"] == 1 and "compilation_config" not in kw and "profiler_config" not in kw
    assert "max_num_seqs" not in kw

