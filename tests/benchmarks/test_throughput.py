"""benchmarks/bench_throughput.py: the engine arguments every configuration gets, and the preemption
count of a run (vLLM's counter, read from a stand-in engine)."""

from types import SimpleNamespace

from tests.benchmarks import load

bt = load("bench_throughput")


def args(**kw):
    base = dict(model="m", max_model_len=512, seed=0, tensor_parallel_size=1, iteration_details=False,
                gpu_memory_utilization=None, max_num_seqs=None, max_cudagraph_capture_size=None,
                shared_path=None, profile=None)
    return SimpleNamespace(**{**base, **kw})


def test_max_num_seqs_reaches_every_config_and_only_when_given():
    for config in ("default", "relay", "noprefix", "noprefix-relay"):
        assert bt.engine_kwargs(args(max_num_seqs=96), config, [[1, 2, 3]])["max_num_seqs"] == 96
        assert "max_num_seqs" not in bt.engine_kwargs(args(), config, [[1, 2, 3]])
    relay = bt.engine_kwargs(args(max_num_seqs=96), "relay", [[1, 2, 3]])
    assert relay["attention_backend"] == "relay"
    assert relay["additional_config"]["relay"]["max_prompt_tokens"] == 3


def test_preemptions_sum_vllms_counter_over_engines():
    metrics = [SimpleNamespace(name="vllm:num_preemptions", value=3),
               SimpleNamespace(name="vllm:prompt_tokens", value=9),
               SimpleNamespace(name="vllm:num_preemptions", value=4)]
    assert bt.preemptions(SimpleNamespace(get_metrics=lambda: metrics)) == 7
    assert bt.preemptions(SimpleNamespace(get_metrics=lambda: [])) == 0
