"""benchmarks/bench_sharing.py: the points of each workload, the requests each config sends, and the
bound (the ceiling plus one read of every shared level's KV per decode step), against hand-computed values."""

import json
import random
from pathlib import Path
from types import SimpleNamespace

from tests.benchmarks import BENCH, load

bench = load("bench_sharing")

ARGS = SimpleNamespace(workloads="samples,latency,tree", prefix_lens="1024,16384", ns="16,256", contexts="8192",
                       latency_ns="1,64", tree="2,3,4,100,10", tree_system=50, output_len=128, max_num_seqs=256,
                       engine_args={})
SHAPE = {"layers": 32, "hq": 32, "hkv": 32, "head_dim": 128, "vocab": 32000, "hidden": 4096, "inter": 11008}


def test_points_and_requests():
    points = bench.points(ARGS)
    assert [p["workload"] for p in points] == ["samples"] * 4 + ["latency"] * 2 + ["tree"]
    system = [1] + [5] * 49
    prompts, n, shared = bench.requests(points[-1], "relay", random.Random(0), 32000, system)
    assert len(prompts) == 6 and n == 4 and shared == 160 and all(p[:50] == system for p in prompts)
    assert {tuple(p[50:150]) for p in prompts[:3]} == {tuple(prompts[0][50:150])}  # one document, 3 questions
    ceiling, n, _ = bench.requests(points[-1], "ceiling", random.Random(0), 32000, system)
    assert ceiling == [[1]] * 6 and n == 4  # the shared part cut
    prompts, n, shared = bench.requests(points[1], "relay", random.Random(0), 32000, system)
    assert len(prompts[0]) == 1024 == shared and n == 256


def test_a_repeated_point_reports_its_median_run_and_every_run():
    point = {"workload": "samples", "P": 1024, "n": 4}
    runs = [{"elapsed_s": t, "completions": 4, "tokens": 512} for t in (3.0, 1.0, 2.0)]
    row = bench.summarize(point, runs)
    assert row["elapsed_s"] == 2.0 and row["tokens_per_s"] == 256.0 and row["P"] == 1024
    assert row["runs_tokens_per_s"] == [512 / 3.0, 512.0, 256.0]
    even = bench.summarize(point, runs[:2] + [{"elapsed_s": 4.0, "completions": 4, "tokens": 512}, runs[2]])
    assert even["elapsed_s"] == 2.5  # the middle two of 1, 2, 3, 4
    latency = bench.summarize({"workload": "latency", "C": 8192, "n": 1},
                              [{"elapsed_s": 1.0, "completions": 1, "tokens": 33, "ms_per_step": m}
                               for m in (7.0, 9.0, 6.0)])
    assert latency["ms_per_step"] == 7.0
    decode = bench.summarize(point, [{**r, "first_token_s": 0.1, "decode_ms_per_step": m}
                                     for r, m in zip(runs, (5.0, 3.0, 4.0))])
    assert decode["decode_ms_per_step"] == 4.0 and decode["first_token_s"] == 0.1
    single = bench.summarize(point, runs[1:2])
    assert single["elapsed_s"] == 1.0 and "runs_tokens_per_s" not in single  # one run: the row as before


def test_bound_is_the_ceiling_plus_one_read_of_the_shared_kv_per_step():
    card = {"copy_bytes_per_s": 4e12, "bf16_flop_per_s": 8e14}
    point = {"workload": "samples", "P": 16384, "n": 256}
    kv = 2 * 16384 * 32 * 32 * 128 * 2  # bytes of K and V, every layer
    flops = 4 * 256 * 16384 * 32 * 32 * 128
    assert max(kv / 4e12, flops / 8e14) == flops / 8e14  # 256 rows: the attention FLOPs dominate
    assert abs(bench.bound_s(point, 10.0, card, SHAPE, ARGS) - (10.0 + 128 * flops / 8e14)) < 1e-9
    point = {"workload": "samples", "P": 1024, "n": 512}  # two waves of max_num_seqs
    flops = 4 * 256 * 1024 * 32 * 32 * 128
    want = 2 + 2 * 128 * max(2 * 1024 * 32 * 32 * 128 * 2 / 4e12, flops / 8e14)
    assert abs(bench.bound_s(point, 2.0, card, SHAPE, ARGS) - want) < 1e-9
    # the engines' own max_num_seqs (`--engine-args`) over --max-num-seqs: four waves of 128
    fewer = SimpleNamespace(**{**vars(ARGS), "engine_args": {"max_num_seqs": 128}})
    flops = 4 * 128 * 1024 * 32 * 32 * 128
    want = 2 + 4 * 128 * max(2 * 1024 * 32 * 32 * 128 * 2 / 4e12, flops / 8e14)
    assert abs(bench.bound_s(point, 2.0, card, SHAPE, fewer) - want) < 1e-9


def test_tree_bound_reads_every_level_once_and_each_row_attends_its_path():
    card = {"copy_bytes_per_s": 4e12, "bf16_flop_per_s": 8e14}
    point = {"workload": "tree", "D": 8, "Q": 4, "n": 8, "doc": 2048, "q": 128, "S": 2048}
    levels = 2048 + 8 * 2048 + 8 * 4 * 128  # system prompt, 8 documents, 32 questions: 22528 tokens
    kv = 2 * levels * 32 * 32 * 128 * 2
    flops = 4 * 256 * (2048 + 2048 + 128) * 32 * 32 * 128  # 256 rows, each over its own path
    assert kv / 4e12 > flops / 8e14  # this tree's reads dominate
    assert abs(bench.bound_s(point, 3.0, card, SHAPE, ARGS) - (3.0 + 128 * kv / 4e12)) < 1e-9


def test_prefill_floor_is_the_shared_prompts_flops_at_the_matmul_rate():
    """Llama-2-7B at P=16000, by hand: 202,375,168 linear weights a layer (4 x 4096^2 attention,
    3 x 4096 x 11008 MLP), two FLOPs each a token; causal attention 16000 x 16001 / 2 pairs, four
    FLOPs a head dimension, 32 heads of 128; 32 layers."""
    card = {"copy_bytes_per_s": 4e12, "bf16_flop_per_s": 7e14}
    layer = 2 * 202_375_168 * 16000 + 4 * 128 * 32 * 128_008_000
    floor = bench.prefill_floor_s({"workload": "samples", "P": 16000, "n": 64}, card, SHAPE)
    assert abs(floor - 32 * layer / 7e14) < 1e-12 and 0.39 < floor < 0.40
    gqa = {**SHAPE, "hkv": 8, "inter": 14336}  # Llama-3-8B's: k and v a quarter of q
    layer = 2 * (4096 * 128 * (64 + 16) + 3 * 4096 * 14336) * 1024 + 4 * 128 * 32 * 1024 * 1025 // 2
    assert abs(bench.prefill_floor_s({"workload": "samples", "P": 1024, "n": 8}, card, gqa) - 32 * layer / 7e14) < 1e-12
    tree = {"workload": "tree", "D": 8, "Q": 4, "n": 8, "doc": 2048, "q": 128, "S": 2048}
    assert bench.prefill_floor_s(tree, card, SHAPE) is None


def test_markdown_table_has_a_row_per_point_with_the_ratios():
    args = SimpleNamespace(**{**vars(ARGS), "workloads": "samples,latency", "ns": "1,16,256"})
    points = bench.points(args)
    card = {"copy_bytes_per_s": 4e12, "bf16_flop_per_s": 8e14, "device": "card"}

    def rows(speed, decode=True):
        job = {"decode_ms_per_step": 10 / speed, "job_first_token_s": 2 / speed, "job_decode_ms_per_step": 9 / speed}
        return {"rows": [{**p, "elapsed_s": 1000 / speed, "tokens_per_s": speed, "ms_per_step": 100 / speed,
                          "first_token_s": p.get("n", 1) / speed, **(job if decode else {})} for p in points]}

    results = {"ceiling": rows(1000.0), "relay": rows(800.0), "default": rows(100.0), "sglang": rows(400.0, False)}
    md = bench.markdown(results, card, SHAPE, args)
    lines = [line for line in md.splitlines() if line.startswith("| workload=")]
    assert len(lines) == len(points)
    # relay / default, relay / SGLang, and relay against the bound plus one prefill (samples only)
    assert lines[0].split(" | ")[-3:-1] == ["8.00", "2.00"] and lines[0].endswith(" |")
    for i, line in enumerate(lines):
        if "samples" in line:
            b_s = bench.bound_s(points[i], 1.0, card, SHAPE, args)  # the ceiling: 1000 tokens in 1 s
            reachable = 1000 / (b_s + bench.prefill_floor_s(points[i], card, SHAPE))
            assert line.split(" | ")[-1].rstrip(" |") == f"{800 / reachable:.2f}"
            assert float(line.split(" | ")[-4]) < float(line.split(" | ")[-1].rstrip(" |"))  # relay / bound
    assert lines[-1].endswith("| 0.25 | | | | | |")  # latency rows: no bound, no ratios
    assert "no engine can skip" in md
    # the first token of n completions, each config, and relay's against its own n=1 at the same P; relay's
    # output tokens/s against the bound plus that n=1 first token (the prompt's prefill as the engine ran it)
    first = [line for line in md.splitlines() if line.startswith("| P=")]
    samples = [p for p in points if p["workload"] == "samples"]
    assert len(first) == len(samples)
    for line, p in zip(first, samples):
        ones = [q for q in samples if q["P"] == p["P"] and q["n"] == 1]
        b_s = bench.bound_s(p, 1.0, card, SHAPE, args)
        assert line.endswith(f"| {p['n']:.2f} | {800 * (b_s + 1 / 800) / 1000:.2f} |" if ones else "|  |  |")
        assert line.split(" | ")[2] == f"{p['n'] / 800:.3f}"  # relay's column
        # ms a decode step, each config (SGLang's run without one: empty); then each job's own first token
        # and ms a step after it (vLLM's timestamps)
        assert line.split(" | ")[5:9] == ["0.01", "0.01", "0.10", ""]
        assert line.split(" | ")[9:13] == ["0.002 s, 0.01 ms", "0.003 s, 0.01 ms", "0.020 s, 0.09 ms", ""]
    assert all(line.count("|") == lines[0].count("|") for line in lines)
    assert lines[-1].split(" | ")[1:5] == ["0.10", "0.12", "1.00", "0.25"]  # latency: ms per step


def test_markdown_names_the_triton_kernels_compiled_inside_timed_runs():
    args = SimpleNamespace(**{**vars(ARGS), "workloads": "samples", "prefix_lens": "1024", "ns": "16,64"})
    points = bench.points(args)
    card = {"copy_bytes_per_s": 4e12, "bf16_flop_per_s": 8e14, "device": "card"}

    def rows(compiled):
        return {"rows": [{**p, "elapsed_s": 1.0, "tokens_per_s": 1000.0, "first_token_s": 0.1,
                          "triton_compiled": compiled if i == 1 else []} for i, p in enumerate(points)]}

    quiet = bench.markdown({"ceiling": rows([]), "relay": rows([])}, card, SHAPE, args)
    assert "compiled during timed runs" not in quiet
    md = bench.markdown({"ceiling": rows([]), "relay": rows(["_fuse_in_place_kernel"])}, card, SHAPE, args)
    note = md.splitlines()[-1]
    assert note.startswith("Triton kernels compiled during timed runs")
    assert "relay at workload=samples, P=1024, n=64: _fuse_in_place_kernel" in note and "ceiling" not in note
    jit = bench.markdown({"ceiling": rows([]), "relay": {**rows([]), "vllm_jit_compiled": ["_window_level_kernel"]}},
                         card, SHAPE, args)
    assert jit.splitlines()[-1].startswith("Triton kernels vLLM's JIT monitor saw compiled")
    assert "relay: _window_level_kernel" in jit.splitlines()[-1] and "compiled during timed runs" not in jit


def test_plot_draws_a_panel_per_prompt_length_context_and_tree(tmp_path):
    """One PNG per results file: a panel per shared-prompt length (samples), per context (latency)
    and one for the tree, 5 inches at 110 dpi each."""
    import struct

    import pytest

    pytest.importorskip("matplotlib")
    points = bench.points(ARGS)
    card = {"copy_bytes_per_s": 4e12, "bf16_flop_per_s": 8e14, "device": "card"}
    rows = {c: {"rows": [{**p, "elapsed_s": 1000 / v, "tokens_per_s": v, "ms_per_step": 100 / v} for p in points]}
            for c, v in (("ceiling", 1000.0), ("relay", 800.0), ("default", 100.0))}
    path = tmp_path / "sharing.json"
    path.write_text(json.dumps({"args": {**vars(ARGS), "model": "/m/llama-2-7b-shape-0123456789"}, "card": card,
                                **rows}))
    png = Path(bench.plot(str(path), sh=SHAPE))
    head = png.read_bytes()[:24]
    assert png == tmp_path / "sharing.png" and head[:8] == b"\x89PNG\r\n\x1a\n"
    assert struct.unpack(">I", head[16:20])[0] == 4 * 5 * 110  # 2 prompt lengths, 1 context, the tree


def test_a_profiled_run_keeps_the_kernel_table_beside_out_and_drops_the_traces(tmp_path):
    """`--profile` puts vLLM's profiler output in <out>.<config>.profile/; the traces go, the table stays, and
    each trace leaves its timeline (here one that cannot be read, which says so)."""
    common = load("common")
    args = bench.parser().parse_args(["--profile", "40,6", "--out", str(tmp_path / "s.json")])
    config = common.profiler_config(args, "relay")
    folder = Path(config["torch_profiler_dir"])
    assert folder == tmp_path / "s.relay.profile"
    assert (config["delay_iterations"], config["max_iterations"]) == (40, 6)
    folder.mkdir()
    (folder / "rank0.pt.trace.json.gz").write_bytes(b"x")
    (folder / "profiler_out_0.txt").write_text("table")
    load("traces").drop_traces(str(folder))
    assert sorted(p.name for p in folder.iterdir()) == ["profiler_out_0.txt", "rank0.pt.trace.json.gz.timeline.txt"]
    assert (folder / "rank0.pt.trace.json.gz.timeline.txt").read_text().startswith("trace not read: ")


def test_the_sglang_config_sends_each_point_with_its_n_and_refuses_short_runs(tmp_path, monkeypatch, capsys):
    """SGLang's engine gets a point's prompts with `n` in its sampling (its parallel sampling); a run that
    returns fewer completions or tokens than asked is refused, not measured."""
    import sys

    import pytest

    calls = []

    class Engine:
        def __init__(self, **kw):
            self.kw = kw

        def generate(self, input_ids, sampling_params):
            calls.append((input_ids, sampling_params))
            n, k = sampling_params["n"], sampling_params["max_new_tokens"]
            return [{"meta_info": {"completion_tokens": k - short}} for _ in range(len(input_ids) * n)]

    monkeypatch.setitem(sys.modules, "sglang", SimpleNamespace(Engine=Engine))
    config = {"vocab_size": 1000, "hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2,
              "num_hidden_layers": 2, "intermediate_size": 128}
    (tmp_path / "config.json").write_text(json.dumps(config))
    args = bench.parser().parse_args(["--model", str(tmp_path), "--workloads", "samples",
                                      "--prefix-lens", "64", "--ns", "4", "--output-len", "8",
                                      "--max-num-seqs", "16", "--worker", "sglang"])
    short = 0
    bench.worker(args)
    assert calls[0] == ([[1, 2, 3]], {"n": 1, "max_new_tokens": 8, "temperature": 1.0, "top_p": 1.0,
                                      "ignore_eos": True})  # the warm-up
    prompts, params = calls[1]
    assert len(prompts) == 1 and len(prompts[0]) == 64 and params["n"] == 4 and params["max_new_tokens"] == 8
    assert '"completions": 4' in capsys.readouterr().out
    short = 1
    with pytest.raises(RuntimeError, match="sglang: 4 completions, 28 tokens, not 4 x 8"):
        bench.worker(args)


def test_markdown_gives_the_hosts_probe_at_each_configs_runs():
    """A host-bound step moves with the host's speed, which moves within a job: each config's probe."""
    args = SimpleNamespace(**{**vars(ARGS), "workloads": "samples", "prefix_lens": "1024", "ns": "64"})
    card = {"copy_bytes_per_s": 4e12, "bf16_flop_per_s": 8e14, "device": "card"}

    def rows(probe):
        return {"rows": [{**p, "elapsed_s": 1.0, "tokens_per_s": 1000.0, "first_token_s": 0.1,
                          "host_speed_us": probe} for p in bench.points(args)]}

    md = bench.markdown({"relay": rows(1941.2), "default": rows(3486.0)}, card, SHAPE, args)
    note = md.splitlines()[-1]
    assert note.startswith("The host's pure-Python probe")
    assert "relay at workload=samples, P=1024, n=64: 1941" in note and "default at workload=samples, P=1024, " \
        "n=64: 3486" in note


def test_a_points_timed_runs_report_the_triton_kernels_compiled_inside_them(tmp_path, monkeypatch, capsys):
    """Each timed run (the job and its first-token run) asks `compiled_during` for its own wall times; the
    row keeps every name, and the worker says so as it runs."""
    import sys

    class Engine:
        def __init__(self, **kw):
            pass

        def generate(self, input_ids, sampling_params):
            k = sampling_params["max_new_tokens"]
            return [{"meta_info": {"completion_tokens": k}} for _ in range(len(input_ids) * sampling_params["n"])]

    windows = []

    def compiled(t0, t1):
        windows.append((t0, t1))
        return ["_fuse_in_place_kernel"] if len(windows) == 2 else []  # the first-token run compiled one

    monkeypatch.setitem(sys.modules, "sglang", SimpleNamespace(Engine=Engine))
    monkeypatch.setattr(bench, "compiled_during", compiled)
    config = {"vocab_size": 1000, "hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2,
              "num_hidden_layers": 2, "intermediate_size": 128}
    (tmp_path / "config.json").write_text(json.dumps(config))
    args = bench.parser().parse_args(["--model", str(tmp_path), "--workloads", "samples", "--prefix-lens", "64",
                                      "--ns", "4", "--output-len", "8", "--worker", "sglang"])
    bench.worker(args)
    out = capsys.readouterr().out
    row = json.loads(out.split("RESULT ", 1)[1])["rows"][0]
    assert row["triton_compiled"] == ["_fuse_in_place_kernel"]
    assert row["host_speed_us"] > 0  # the host's probe as the point's runs began
    assert "Triton kernels compiled during a timed run: ['_fuse_in_place_kernel']" in out
    # the warm-up is not timed; the job and its first-token run are, one after the other
    assert len(windows) == 2 and all(a <= b for a, b in windows) and windows[1][0] >= windows[0][1]


def test_a_vllm_job_reports_its_decode_span_by_vllms_request_timestamps(tmp_path, monkeypatch):
    """generate's third value: the median request's seconds from its first token to its last, by the
    timestamps vLLM keeps with stats on (None without them)."""
    import vllm

    stamps = [(10.0, 10.5), (3.0, 3.25), (7.0, 8.0)]

    class LLM:
        def __init__(self, **kw):
            assert kw["disable_log_stats"] is False  # the timestamps need vLLM's stats

        def generate(self, prompts, params, use_tqdm=False):
            return [SimpleNamespace(outputs=[SimpleNamespace(token_ids=[5] * params.max_tokens)] * params.n,
                                    metrics=SimpleNamespace(first_token_ts=a, last_token_ts=b) if a else None)
                    for (a, b), _ in zip(stamps, prompts)]

    monkeypatch.setattr(vllm, "LLM", LLM)
    args = bench.parser().parse_args(["--model", str(tmp_path), "--workloads", "samples", "--worker", "relay"])
    generate, _ = bench.vllm_generate(args, [1, 2, 3])
    assert generate([[1, 2], [1, 3], [1, 4]], 2, 8) == (6, 48, 0.5)
    stamps[:] = [(0.0, 0.0)]  # no stats for the request
    assert generate([[1, 2]], 1, 4) == (1, 4, None)


def test_engine_args_reach_every_vllm_configuration():
    """--engine-args (a feature on for every side) is in the engine of the ceiling, relay and vLLM's
    default alike, over what the configuration sets."""
    args = SimpleNamespace(model="/m", max_model_len=4096, max_num_seqs=64, iteration_details=False, profile=None,
                           workloads="samples", prefix_lens="4096", ns="1,16",
                           engine_args={"kv_cache_dtype": "fp8", "max_num_seqs": 8})
    for config in ("ceiling", "relay", "default"):
        kw = bench.engine_kwargs(args, config, [1, 2, 3])
        assert kw["kv_cache_dtype"] == "fp8" and kw["max_num_seqs"] == 8, (config, kw)
        assert kw["compilation_config"] == {"max_cudagraph_capture_size": 8}, (config, kw)
    assert bench.engine_kwargs(args, "relay", [1])["attention_backend"] == "relay"


def test_cuda_graphs_go_up_to_the_largest_batch_the_run_holds():
    def kwargs(workloads="samples", **engine_args):
        args = SimpleNamespace(model="/m", max_model_len=4096, max_num_seqs=1024, iteration_details=False,
                               profile=None, workloads=workloads, prefix_lens="1024,4096", ns="1,64,256",
                               contexts="2048", latency_ns="1,8", tree="8,4,8,2048,128", tree_system=2048,
                               engine_args=engine_args)
        return bench.engine_kwargs(args, "relay", [1, 2, 3])

    assert kwargs()["compilation_config"] == {"max_cudagraph_capture_size": 256}
    assert kwargs("latency")["compilation_config"] == {"max_cudagraph_capture_size": 8}
    assert kwargs("tree")["compilation_config"] == {"max_cudagraph_capture_size": 256}  # 8 x 4 x 8 completions
    assert kwargs("samples,tree", max_num_seqs=128)["compilation_config"] == {"max_cudagraph_capture_size": 128}
    # never above vLLM's own largest graph: a run of 1024 samples keeps vLLM's sizes
    args = SimpleNamespace(model="/m", max_model_len=4096, max_num_seqs=1024, iteration_details=False, profile=None,
                           workloads="samples", prefix_lens="1024", ns="64,1024", engine_args={})
    assert "compilation_config" not in bench.engine_kwargs(args, "relay", [1])
    mode = {"cudagraph_mode": "FULL"}
    assert kwargs(compilation_config=mode)["compilation_config"] == {**mode, "max_cudagraph_capture_size": 256}
    # sized by the user, or by draft tokens (a step of n requests holds more than n tokens): vLLM's own sizes
    assert kwargs(compilation_config={"cudagraph_capture_sizes": [1, 2]})["compilation_config"] == {
        "cudagraph_capture_sizes": [1, 2]}
    assert "compilation_config" not in kwargs(speculative_config={"method": "ngram", "num_speculative_tokens": 3})
