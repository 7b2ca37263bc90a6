"""benchmarks/bench_ops.py on the CPU: which decode steps it times (the grid, or `--decode`'s, refused when
malformed), and its tables: relay's TFLOP/s beside its GB/s, and the level's and the joint call's forms for
the steps asked for."""

import pytest

from tests.benchmarks import load

bench = load("bench_ops")

ENV = dict(gpu="G", torch="t", triton="tr", vllm="v", fa_version=3, copy_gbs=3000.0, matmul_tflops=750.0)
FUSION = dict(T=512, relay_fusion_us=9.0, relay_fusion_gbs=1000.0, relay_fusion_pct_copy=30.0,
              relay_fusion_inplace_us=9.0, vllm_cuda_us=9.0, vllm_cuda_pct_copy=30.0, vllm_triton_us=15.0,
              speedup_vs_vllm_cuda=1.0)


def row(**extra):
    return dict(model="llama2-7b", B=256, S=16000, c=128, relay_us=4321.0, plain_fa_us=9e4, cascade_us=float("nan"),
                relay_eager_us=4400.0, plain_fa_eager_us=9e4, relay_gbs=2100.0, relay_pct_copy=70.0,
                relay_tflops=543.0, relay_pct_matmul=72.0, speedup_plain_over_relay=20.8,
                speedup_cascade_over_relay=float("nan"), theory_speedup=30.0, measured_over_theory=0.69, **extra)


def test_the_grid_or_the_steps_asked_for():
    assert len(bench.decode_points(False, None)) == 2 * 3 * 3 * 2
    assert bench.decode_points(True, None) == [(m, B, 2048, 128) for m in bench.MODELS for B in (32, 512)]
    assert bench.decode_points(True, "llama2-7b:256:16000:128,llama3-8b:64:4096:1") == [
        ("llama2-7b", 256, 16000, 128), ("llama3-8b", 64, 4096, 1)]
    for bad in ("llama2-7b:256:16000", "gpt:1:2:3", "llama2-7b:a:2:3"):
        with pytest.raises(SystemExit, match="MODEL:B:S:c"):
            bench.decode_points(False, bad)


def test_tables_give_relays_tflops_and_the_levels_forms_where_timed():
    plain = bench.markdown(ENV, [row()], [FUSION])
    assert "| relay TFLOP/s | relay % matmul |" in plain and "| 543 | 72% |" in plain
    assert "The level's call alone" not in plain
    forms = row(level={0: dict(us=3500.0, tflops=615.0, pct_matmul=82.0), 2: dict(us=3300.0, tflops=652.0,
                                                                                  pct_matmul=87.0)},
                joint={"64x1": 4400.0, "128x0": 3900.0})
    md = bench.markdown(ENV, [forms], [FUSION])
    assert "| cap 0 | cap 2 | joint 64x1 | joint 128x0 |" in md
    assert "| llama2-7b | 256 | 16000 | 3500 us, 615 | 3300 us, 652 | 4400 | 3900 |" in md
    header = next(line for line in md.splitlines() if line.startswith("| model | B | S | c |"))
    separator = md.splitlines()[md.splitlines().index(header) + 1]
    assert header.count("|") == separator.count("|")


def test_a_joint_call_left_out_leaves_the_levels_table_whole():
    forms = row(level={0: dict(us=3500.0, tflops=615.0, pct_matmul=82.0)}, joint={})
    lines = bench.markdown(ENV, [forms], [FUSION]).splitlines()
    header = next(i for i, line in enumerate(lines) if line.startswith("| model | B | S | cap 0"))
    assert lines[header] == "| model | B | S | cap 0 |" and lines[header + 1] == "|---|---|---|---|"
    assert lines[header + 2] == "| llama2-7b | 256 | 16000 | 3500 us, 615 |"
