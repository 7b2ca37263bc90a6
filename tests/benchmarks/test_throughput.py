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
