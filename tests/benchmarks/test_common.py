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


def test_model_config_of_a_multimodal_checkpoint_is_its_language_models(tmp_path):
    text = {"hidden_size": 3584, "num_attention_heads": 28, "num_key_value_heads": 4, "vocab_size": 152064,
            "num_hidden_layers": 28, "intermediate_size": 18944, "model_type": "qwen2_5_vl_text"}
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen2_5_vl", "text_config": text,
                                                      "vision_config": {"hidden_size": 1280}}))
    c = common.model_config(str(tmp_path))
    assert {k: c[k] for k in text} == text
    assert c["vision_config"] == {"hidden_size": 1280}


def test_random_prompts_draw_below_the_multimodal_placeholders():
    assert common.prompt_vocab({"vocab_size": 32000}) == 32000
    qwen_vl = {"vocab_size": 152064, "vision_start_token_id": 152060, "vision_end_token_id": 152061,
               "image_token_id": 152062, "video_token_id": 152063}
    assert common.prompt_vocab(qwen_vl) == 152060


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
    scripts = {p.stem for p in BENCH.glob("*.py")} - {"common", "traces"}
    for path in BENCH.glob("*.py"):
        nodes = list(ast.walk(ast.parse(path.read_text())))
        imported = {n.module for n in nodes if isinstance(n, ast.ImportFrom)} | {
            a.name for n in nodes if isinstance(n, ast.Import) for a in n.names}
        assert not imported & scripts, f"{path.name} imports {imported & scripts}: shared helpers go in common.py (traces.py)"


def test_compiled_during_lists_the_kernels_written_inside_the_window(tmp_path):
    """Triton's cache: a folder per kernel hash holding <kernel>.json (and __grp__<kernel>.json); a
    kernel is listed when its .json was written between the run's wall times."""
    import os

    cache = tmp_path / "triton"
    for h, name, mtime in (("a1", "_fuse_in_place_kernel", 150.0), ("b2", "_gather_rows_kernel", 50.0),
                           ("c3", "_prefix_block_table_kernel", 199.0)):
        (cache / h).mkdir(parents=True)
        for f in (f"{name}.json", f"__grp__{name}.json", f"{name}.cubin"):
            (cache / h / f).write_text("{}")
            os.utime(cache / h / f, (mtime, mtime))
    assert common.compiled_during(100.0, 200.0, [str(cache)]) == ["_fuse_in_place_kernel", "_prefix_block_table_kernel"]
    assert common.compiled_during(200.5, 300.0, [str(cache)]) == []


def test_jit_compiled_reads_vllms_jit_monitor_warnings():
    """vLLM 0.33 logs each Triton compile after its warm-up; those lines name the kernel, the rest do not."""
    log = ("(EngineCore pid=1) INFO 12-06 19:51:18 [jit_monitor.py:84] Kernel JIT monitor activated; monitored "
           "JIT compilations during inference will use mode=warn.\n"
           "(EngineCore pid=1) WARNING 12-06 23:41:46 [jit_monitor.py:140] Triton kernel JIT compilation during "
           "inference: _window_level_kernel. This causes a latency spike; consider extending warmup\n"
           "(EngineCore pid=1) WARNING 12-06 23:44:59 [jit_monitor.py:140] Triton kernel JIT compilation during "
           "inference: _compute_local_logits_stats_kernel. This causes a latency spike\n"
           "(EngineCore pid=1) WARNING 12-06 23:45:00 [jit_monitor.py:140] Triton kernel JIT compilation during "
           "inference: _window_level_kernel (constexprs={BLOCK_M=64, SPLITS=1}; signature={q_ptr='*bf16'}). This\n")
    assert common.jit_compiled(log) == ["_window_level_kernel", "_compute_local_logits_stats_kernel",
                                        "_window_level_kernel"]
    assert common.jit_compiled("RESULT {}\n") == []


def test_triton_cache_dirs_include_the_ones_vllm_gives_its_engine(tmp_path, monkeypatch):
    """With no TRITON_CACHE_DIR, vLLM's compiler points its engine's Triton at a folder under its cache
    root (torch_compile_cache/<hash>/.../triton_cache): compilations there count as well."""
    vllm_cache = tmp_path / "vllm" / "torch_compile_cache" / "c9f45ffef8" / "rank_0_0" / "triton_cache"
    vllm_cache.mkdir(parents=True)
    own = tmp_path / "own"
    own.mkdir()
    monkeypatch.setenv("VLLM_CACHE_ROOT", str(tmp_path / "vllm"))
    monkeypatch.setenv("TRITON_HOME", str(tmp_path / "home"))  # no ~/.triton/cache there
    monkeypatch.delenv("TRITON_CACHE_DIR", raising=False)
    assert common.triton_cache_dirs() == [str(vllm_cache)]
    monkeypatch.setenv("TRITON_CACHE_DIR", str(own))
    assert common.triton_cache_dirs() == [str(own), str(vllm_cache)]
