"""With relay on, decode CUDA graphs cover max_num_seqs (hooks/capture_sizes.py); otherwise vLLM's sizes."""

import logging
import types

import pytest

import vllm_relay
from vllm_relay.hooks.capture_sizes import MAX_GRAPH_TOKENS, relay_capture_size


def _sizes(backend, max_num_seqs=1024, max_num_batched_tokens=16384, spec=None, mode="FULL_AND_PIECEWISE",
           **compilation):
    """VllmConfig._set_cudagraph_sizes on a config holding only what it reads (a full one needs a
    model and a GPU platform): (largest size, the size list)."""
    from vllm.config import AttentionConfig, CompilationConfig, ParallelConfig
    from vllm.config.compilation import CUDAGraphMode
    from vllm.config.vllm import VllmConfig

    vllm_relay.register()
    cfg = object.__new__(VllmConfig)
    cfg.model_config = types.SimpleNamespace(enforce_eager=False)
    cfg.compilation_config = CompilationConfig(cudagraph_mode=CUDAGraphMode[mode], **compilation)
    cfg.scheduler_config = types.SimpleNamespace(max_num_seqs=max_num_seqs,
                                                 max_num_batched_tokens=max_num_batched_tokens)
    cfg.parallel_config = ParallelConfig()
    cfg.speculative_config = spec
    cfg.attention_config = AttentionConfig(backend=backend)
    cfg._set_cudagraph_sizes()
    return cfg.compilation_config.max_cudagraph_capture_size, cfg.compilation_config.cudagraph_capture_sizes


def _backends():
    from vllm.v1.attention.backends.registry import AttentionBackendEnum as E

    vllm_relay.register()
    return E.CUSTOM, E.FLASH_ATTN


def test_relay_graphs_cover_every_decode_batch():
    relay, flash = _backends()
    top, sizes = _sizes(relay)
    assert top == 1024 and sizes[-1] == 1024 and sizes == sorted(set(sizes))
    assert _sizes(flash)[0] == 512 and _sizes(None)[0] == 512  # vLLM's own engines keep vLLM's sizes
    # the same sizes up to 512, more above
    assert _sizes(relay)[1][: len(_sizes(flash)[1])] == _sizes(flash)[1]


@pytest.mark.parametrize("max_num_seqs, batched, expected", [
    (256, 16384, 512), (700, 16384, 704), (4096, 16384, MAX_GRAPH_TOKENS), (1024, 600, 600)])
def test_relay_size_bounds(max_num_seqs, batched, expected, caplog, monkeypatch):
    monkeypatch.setattr(logging.getLogger("vllm"), "propagate", True)  # vLLM's loggers stop at "vllm"
    relay, flash = _backends()
    top, sizes = _sizes(relay, max_num_seqs=max_num_seqs, max_num_batched_tokens=batched)
    assert top == expected and sizes[-1] == expected
    assert top >= _sizes(flash, max_num_seqs=max_num_seqs, max_num_batched_tokens=batched)[0]
    assert "Truncating" not in caplog.text  # vLLM warns only of sizes the user gave


def test_speculative_tokens_count():
    assert relay_capture_size(400, 3) == MAX_GRAPH_TOKENS and relay_capture_size(300, 1) == 512
    relay, _ = _backends()
    spec = types.SimpleNamespace(num_speculative_tokens=2)
    assert _sizes(relay, max_num_seqs=300, spec=spec)[0] == 912  # 900 decode tokens, rounded up to a size


def test_the_users_sizes_win():
    relay, _ = _backends()
    assert _sizes(relay, max_cudagraph_capture_size=256)[0] == 256
    assert _sizes(relay, cudagraph_capture_sizes=[1, 2, 4, 8])[1] == [1, 2, 4, 8]


def test_only_with_full_graphs():
    relay, _ = _backends()
    assert _sizes(relay, mode="FULL_DECODE_ONLY")[0] == 1024
    assert _sizes(relay, mode="PIECEWISE")[0] == 512  # relay's attention runs eagerly in any case
    assert _sizes(relay, mode="NONE") == (0, [])
