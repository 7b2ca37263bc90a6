"""vllm_relay/attention/backend.py on the CPU: the level stream's knob (the CUDA paths run in the GPU
tests: tests/ops/test_relay_attention.py, tests/e2e/test_gpu_relay.py)."""

import pytest

from vllm_relay.attention import backend


@pytest.mark.parametrize("value, mode", [(None, "graphs"), ("1", "all"), ("2", "graphs"), ("0", "off")])
def test_level_stream_mode_reads_the_knob(monkeypatch, value, mode):
    if value is None:
        monkeypatch.delenv("VLLM_RELAY_LEVEL_STREAM", raising=False)
    else:
        monkeypatch.setenv("VLLM_RELAY_LEVEL_STREAM", value)
    assert backend.level_stream_mode() == mode
    assert backend.level_stream("cpu") is None  # no CUDA stream off CUDA, in any mode


@pytest.mark.parametrize("value", ["3", "-1", "yes"])
def test_a_bad_level_stream_value_is_a_clear_error(monkeypatch, value):
    monkeypatch.setenv("VLLM_RELAY_LEVEL_STREAM", value)
    with pytest.raises(ValueError, match="VLLM_RELAY_LEVEL_STREAM"):
        backend.level_stream("cpu")
