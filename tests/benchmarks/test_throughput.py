"""benchmarks/bench_throughput.py: the preemption count of a run (vLLM's counter, read from a stand-in
engine). The engine arguments every configuration gets are common.py's (tests/benchmarks/test_common.py)."""

from types import SimpleNamespace

from tests.benchmarks import load

bt = load("bench_throughput")


def test_preemptions_sum_vllms_counter_over_engines():
    metrics = [SimpleNamespace(name="vllm:num_preemptions", value=3),
               SimpleNamespace(name="vllm:prompt_tokens", value=9),
               SimpleNamespace(name="vllm:num_preemptions", value=4)]
    assert bt.preemptions(SimpleNamespace(get_metrics=lambda: metrics)) == 7
    assert bt.preemptions(SimpleNamespace(get_metrics=lambda: [])) == 0


class FakeSGLang:
    """Stands in for SGLang's offline `Engine`: records its arguments, flushes and calls, and
    generates each request's `max_new_tokens` (or one fewer, `short`)."""

    def __init__(self, short=False):
        self.short, self.calls, self.flushes, self.kwargs = short, [], 0, None

    def Engine(self, **kwargs):
        self.kwargs = kwargs
        return self

    def generate(self, input_ids, sampling_params):
        self.calls.append((input_ids, sampling_params))
        return [{"meta_info": {"completion_tokens": p["max_new_tokens"] - self.short, "cached_tokens": 7}}
                for p in sampling_params]

    def flush_cache(self):
        self.flushes += 1
        return SimpleNamespace(success=True)

    def shutdown(self):
        pass


def sglang_args(tmp_path, **over):
    """The worker's arguments, with the requests file the parent writes for it."""
    import json

    from common import workload

    (tmp_path / "config.json").write_text('{"vocab_size": 1000}')
    args = dict(model=str(tmp_path), workloads="multi", multi_system_lens="40,80", num_prompts=5, seed=3,
                max_model_len=512, tensor_parallel_size=1, gpu_memory_utilization=None, max_num_seqs=None,
                sglang_args='{"attention_backend": "fa3"}', repeat=2, worker="sglang",
                requests_file=str(tmp_path / "requests.json"))
    args = SimpleNamespace(**{**args, **over})
    (tmp_path / "requests.json").write_text(json.dumps({"multi": workload(args, "multi")}))
    return args


def test_the_sglang_worker_sends_the_workloads_token_ids_and_sampling(tmp_path, monkeypatch, capsys):
    import json
    import sys

    from common import workload

    fake = FakeSGLang()
    monkeypatch.setitem(sys.modules, "sglang", fake)
    args = sglang_args(tmp_path)
    bt.worker(args)
    _, prompts, out_lens = workload(args, "multi")
    assert len(fake.calls) == 2 and fake.flushes == 1  # the radix cache flushed before the repeat
    for ids, params in fake.calls:
        assert ids == prompts
        assert params == [{"n": 1, "max_new_tokens": n, "temperature": 1.0, "top_p": 1.0, "ignore_eos": True}
                          for n in out_lens]
    assert fake.kwargs["load_format"] == "dummy" and fake.kwargs["attention_backend"] == "fa3"
    assert fake.kwargs["context_length"] == 512 and fake.kwargs["random_seed"] == 3
    line = [x for x in capsys.readouterr().out.splitlines() if x.startswith("RESULT ")][0]
    r = json.loads(line[7:])["multi"]
    assert r["requests"] == 5 and r["output_tokens"] == sum(out_lens) and r["cached_tokens"] == 35
    assert len(r["runs_requests_per_s"]) == 2


def test_the_sglang_worker_refuses_a_run_short_of_its_tokens(tmp_path, monkeypatch):
    import sys

    import pytest

    monkeypatch.setitem(sys.modules, "sglang", FakeSGLang(short=True))
    with pytest.raises(RuntimeError, match="SGLang generated"):
        bt.worker(sglang_args(tmp_path, repeat=1))


def test_the_sglang_config_runs_in_sglangs_environment(tmp_path, monkeypatch):
    import sys

    import json
    import os

    from common import workload

    env = tmp_path / "env.sh"
    env.write_text("export SEEN_BY_WORKER=1\n")
    got = {}

    def run_logged(cmd, args, config, env=None):
        got["cmd"] = cmd
        with open(cmd[-1]) as f:  # the requests the worker reads (vLLM does not import in its environment)
            got["requests"] = json.load(f)
        return 'RESULT {"config": "sglang"}\nmax_total_num_tokens=1234\n', 0

    monkeypatch.setattr(bt, "run_logged", run_logged)
    monkeypatch.setattr(sys, "argv", ["bench_throughput.py", "--model", "m", "--configs", "sglang"])
    args = sglang_args(tmp_path, sglang_env=str(env), triton_cache=None, iteration_details=False)
    result = bt.run_config(args, "sglang")
    assert got["cmd"][:2] == ["bash", "-c"] and str(env) in got["cmd"][2]
    assert got["cmd"][-4:-1] == ["--worker", "sglang", "--requests-file"]
    assert result["kv_cache_tokens"] == [1234]
    assert got["requests"] == {"multi": [list(x) for x in workload(args, "multi")]}
    assert not os.path.exists(got["cmd"][-1])  # removed after the run


def shape_folder(tmp_path, **config):
    import json

    (tmp_path / "config.json").write_text(json.dumps(config))
    return SimpleNamespace(model=str(tmp_path), prefix_len=96)


LLAMA = dict(num_hidden_layers=3, num_attention_heads=6, num_key_value_heads=2, hidden_size=120)


def test_the_prompts_attention_counts_every_scheduled_token_against_every_prompt_key(tmp_path):
    """Each query token relay scheduled meets each of the 96 prompt keys in each of 3 layers and 6 query
    heads of 20: a dot product of 20 and a weighted sum of 20 values, 2 FLOPs an element each."""
    args = shape_folder(tmp_path, **LLAMA)
    relay = {"single": {"runs_relay_tokens": [7, 8]}}  # the first run's
    got = bt.prompt_attention(args, relay, {"bf16_flop_per_s": 1e9})
    pairs = 7 * 96 * 3 * 6  # (token, key, layer, head)
    assert got["flops"] == pairs * (2 * 20 + 2 * 20)
    assert got["seconds"] == got["flops"] / 1e9 and got["query_tokens"] == 7


def test_the_bound_is_no_prompt_plus_the_prompts_attention(tmp_path):
    args = shape_folder(tmp_path, **LLAMA, head_dim=32)
    rate = {"bf16_flop_per_s": 4 * 96 * 3 * 6 * 32}
    bound = bt.prompt_attention(args, {"single": {"runs_relay_tokens": [10]}}, rate)
    assert bound["seconds"] == 10.0  # head_dim read from the config, not hidden / heads
    text = bt.bound_lines(bound, {"default": 60.0, "relay": 45.0, "noprefix": 30.0})
    assert bound["bound_s"] == 40.0 and bound["most_over_default"] == 1.5
    assert bound["relay_over_bound"] == 40 / 45
    assert "1.500x the default" in text and "relay / that bound = 0.889" in text


def test_no_bound_where_layers_see_fewer_keys_or_none_were_counted(tmp_path):
    card = {"bf16_flop_per_s": 1e12}
    counted = {"single": {"runs_relay_tokens": [5]}}
    assert bt.prompt_attention(shape_folder(tmp_path, **LLAMA), {"single": {}}, card) is None
    for other in ({"sliding_window": 1024}, {"layer_types": ["sliding_attention", "full_attention"]},
                  {"kv_lora_rank": 512}):
        assert bt.prompt_attention(shape_folder(tmp_path, **LLAMA, **other), counted, card) is None
    # Qwen2's configs name a window they do not use, and a type for every layer
    for full in ({"sliding_window": 4096, "use_sliding_window": False},
                 {"layer_types": ["full_attention"] * 3}):
        bound = bt.prompt_attention(shape_folder(tmp_path, **LLAMA, **full), counted, card)
        assert bound["query_tokens"] == 5


def test_relay_tokens_are_read_from_relay_engines_only(monkeypatch):
    import vllm_relay.stats

    monkeypatch.setattr(vllm_relay.stats, "relay_stats", lambda llm: {"relay_tokens": llm})
    assert bt.scheduled_relay_tokens(11, "relay") == 11
    assert bt.scheduled_relay_tokens(11, "default") == 0
    assert bt.scheduled_relay_tokens(11, "noprefix-relay") == 0
