"""benchmarks/trace_steps.py: steps, GPU busy time (overlaps counted once), idle and kernel
families from a torch-profiler trace, against a hand-built trace."""

import gzip
import json
from pathlib import Path

from tests.benchmarks import BENCH, load

bench = load("trace_steps")


def mark(ts, name):
    return {"ph": "X", "cat": "gpu_user_annotation", "name": name, "ts": ts, "dur": 1}


def kernel(ts, dur, name):
    return {"ph": "X", "cat": "kernel", "name": name, "ts": ts, "dur": dur}


EVENTS = [
    mark(100, "execute_context_0(0)_generation_4(4)"),
    kernel(110, 30, "nvjet_sm90_tst_128x64_64x8_1x2_h_bz_TNT"),
    kernel(130, 20, "void cutlass::device_kernel<flash::enable_sm90_or_later<flash::FlashAttnFwdSm90<...>>>"),
    kernel(160, 10, "_fuse_in_place_kernel"),
    kernel(175, 5, "triton_red_fused_fused_add_rms_norm_2"),
    mark(200, "execute_context_1(16)_generation_3(3)"),
    kernel(205, 90, "_gather_rows_kernel"),
    kernel(290, 30, "nvjet_sm90_tst_168x128_64x5_1x2_h_bz_TNN"),  # runs past the next step's start
    mark(300, "execute_context_0(0)_generation_4(4)"),
    kernel(310, 5, "nvjet_x"),  # after the last mark: no next start, not counted
    {"ph": "X", "cat": "user_annotation", "name": "execute_context_0(0)_generation_4(4)", "ts": 90, "dur": 5},
]


def test_steps_split_busy_idle_and_families():
    rows = bench.steps(EVENTS)
    assert len(rows) == 2
    a, b = rows
    assert (a["ctx_reqs"], a["ctx_tokens"], a["gen_reqs"], a["gen_tokens"]) == (0, 0, 4, 4)
    assert a["cycle_us"] == 100 and a["busy_us"] == 55 and a["idle_us"] == 45  # 110-150 (overlap once), 160-170, 175-180
    assert a["families_us"] == {"gemm": 30, "attention": 20, "relay": 10, "other": 5}
    assert (b["ctx_reqs"], b["ctx_tokens"]) == (1, 16)
    assert b["busy_us"] == 95 and b["families_us"] == {"relay": 90, "gemm": 10}  # clipped at the next start
    s = bench.summary(rows)
    assert s["steps"] == 2 and s["cycle_us_total"] == 200 and s["busy_us_total"] == 150
    assert s["idle_us_median"] == (45 + 5) / 2 and s["families_us_median"]["relay"] == 50


def test_decode_kernels_by_whole_name_and_grid():
    """Only kernels inside decode steps (no prompt tokens) count; a name's grids, costliest first."""
    flash = "void cutlass::device_kernel<flash::enable_sm90_or_later<flash::FlashAttnFwdSm90<...>>>"
    combine = "void cutlass::device_kernel<flash::FlashAttnFwdCombine<...>>"
    extra = [dict(kernel(150, 4, combine), args={"grid": [64, 32, 1]}),
             dict(kernel(185, 9, combine), args={"grid": [256, 32, 1]}),
             dict(kernel(187, 6, combine), args={"grid": [256, 32, 1]}),
             kernel(250, 50, combine),  # in the prefill step (16 prompt tokens): not a decode kernel
             kernel(305, 50, combine)]  # after the last mark: in no step
    rows = bench.kernels(EVENTS + extra, top=3)
    assert [(r["name"], r["calls"], r["us"]) for r in rows] == [
        ("nvjet_sm90_tst_128x64_64x8_1x2_h_bz_TNT", 1, 30.0), (flash, 1, 20.0), (combine, 3, 19.0)]
    assert rows[2]["grids"] == [{"grid": "256,32,1", "calls": 2, "us": 15.0}, {"grid": "64,32,1", "calls": 1, "us": 4.0}]
    assert rows[2]["mean_us"] == 19.0 / 3 and rows[0]["grids"] == [{"grid": "?", "calls": 1, "us": 30.0}]


def test_the_steps_that_idled_longest_say_what_the_host_was_in():
    host = [{"ph": "X", "cat": "user_annotation", "name": "gpu_model_runner: preprocess", "ts": 140,
             "dur": 40},
            {"ph": "X", "cat": "cuda_runtime", "name": "cudaStreamSynchronize", "ts": 185, "dur": 30},
            {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": 150, "dur": 20},
            {"ph": "X", "cat": "gpu_memset", "name": "Memset", "ts": 100, "dur": 5},  # not a host category
            {"ph": "X", "cat": "user_annotation", "name": "sample", "ts": 320, "dur": 5}]  # after the steps
    rows = bench.steps(EVENTS + host, idle_host=1)
    assert "idle_host" not in rows[1]  # the other step idled less (5 against 45 us)
    # step 1 idles 100-110, 150-160, 170-175, 180-200 (45 us): preprocess (140-180) covers 10 + 5 of them,
    # the sync 15, the op 10; no host event covers 100-110 and 180-185
    assert rows[0]["idle_host"] == {"gpu_model_runner: preprocess": 15.0, "cudaStreamSynchronize": 15.0,
                                    bench.UNCOVERED: 15.0, "aten::mm": 10.0}
    assert bench.idle_spans([(110, 150), (130, 150), (160, 170)], 100, 165) == [(100, 110), (150, 160)]
    assert bench.steps(EVENTS + host) == bench.steps(EVENTS)  # without idle_host: the rows as before


def test_a_second_streams_annotations_are_not_steps():
    """Kernels on a second stream (relay's levels) make the profiler repeat the step's annotation on
    that stream, cut to its kernels: the steps stay those of the stream that ran them whole."""
    main = [dict(e, pid=0, tid=7, dur=90) if e.get("cat") == "gpu_user_annotation" else e for e in EVENTS]
    side = [dict(mark(ts, name), pid=0, tid=9, dur=4) for ts, name in
            [(131, "execute_context_0(0)_generation_4(4)"), (140, "execute_context_0(0)_generation_4(4)"),
             (230, "execute_context_1(16)_generation_3(3)")]]
    rows = bench.steps(main + side)
    assert [(r["ctx_tokens"], r["cycle_us"]) for r in rows] == [(0, 100), (16, 100)]
    assert rows == bench.steps(EVENTS)


def test_load_reads_plain_and_gzipped_traces(tmp_path):
    plain, zipped = tmp_path / "t.pt.trace.json", tmp_path / "t.pt.trace.json.gz"
    plain.write_text(json.dumps({"traceEvents": EVENTS}))
    with gzip.open(zipped, "wt") as f:
        json.dump({"traceEvents": EVENTS}, f)
    assert bench.load(str(plain)) == EVENTS == bench.load(str(zipped))
    assert bench.summary([]) == {"steps": 0}


def test_bench_throughput_keeps_each_traces_steps_and_drops_the_trace(tmp_path, monkeypatch):
    from types import SimpleNamespace

    monkeypatch.syspath_prepend(str(BENCH))
    bt = load("bench_throughput")
    args = SimpleNamespace(out=str(tmp_path / "run.json"), idle_host=0)
    folder = Path(bt.profile_dir(args, "relay"))
    folder.mkdir()
    (folder / "rank0.pt.trace.json").write_text(json.dumps({"traceEvents": EVENTS}))
    (folder / "profiler_out_0.txt").write_text("table")
    bt.drop_traces(args, "relay")
    assert sorted(p.name for p in folder.iterdir()) == ["profiler_out_0.txt", "steps_0.json"]
    kept = json.loads((folder / "steps_0.json").read_text())
    assert kept["trace"] == "rank0.pt.trace.json" and kept["summary"]["steps"] == 2 and len(kept["steps"]) == 2
    assert kept["decode_kernels"] == bench.kernels(EVENTS) and len(kept["decode_kernels"]) == 4


def test_host_annotations_mark_the_steps_when_the_trace_has_no_gpu_ones():
    host = [dict(e, cat="user_annotation") if e.get("cat") == "gpu_user_annotation" else e for e in EVENTS]
    assert [r["cycle_us"] for r in bench.steps(host)] == [10, 100, 100]  # the host mark at 90 is one more step
