"""vllm_relay/attention/backend.py on the CPU: no level stream off CUDA (the CUDA paths run in the GPU
tests: tests/ops/test_relay_attention.py, tests/e2e/test_gpu_relay.py)."""

import pytest

from vllm_relay.attention import backend


@pytest.mark.parametrize("mode", ["graphs", "all", "off"])
def test_no_level_stream_off_cuda(monkeypatch, mode):
    monkeypatch.setattr(backend, "LEVEL_STREAM", mode)
    assert backend.level_stream("cpu") is None
