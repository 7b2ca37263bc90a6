"""vllm_relay/attention/backend.py on the CPU: no level stream off CUDA (the CUDA paths run in the GPU
tests: tests/ops/test_relay_attention.py, tests/e2e/test_gpu_relay.py)."""

import pytest

from vllm_relay.attention import backend


@pytest.mark.parametrize("mode", ["graphs", "all", "off"])
def test_no_level_stream_off_cuda(monkeypatch, mode):
    monkeypatch.setattr(backend, "LEVEL_STREAM", mode)
    assert backend.level_stream("cpu") is None


def test_a_drafters_builder_plans_its_passes_with_the_drafter_step_and_nothing_else_does(monkeypatch):
    """A builder marked as a drafter's (`draft_of`, hooks/drafter.py) plans a pass vLLM hands no step with
    the model state's `draft_step`, as a full-graph step wherever the planner's rule says one runs; a step
    vLLM hands over, and a graph capture, keep theirs."""
    from types import SimpleNamespace as NS

    from vllm.v1.attention.backends.flash_attn import FlashAttentionMetadataBuilder

    class Planned(Exception):  # the plan is all this test reads: vLLM's own build is not reached
        pass

    def base_build(self, common_prefix_len, cm, fast_build=False):
        raise Planned

    monkeypatch.setattr(FlashAttentionMetadataBuilder, "build", base_build)
    planned = []
    builder = object.__new__(backend.RelayMetadataBuilder)
    builder.capturing = (False, False)
    builder.planner = NS(plan=lambda cm, step, **kw: planned.append((step, kw["capture"], kw["graph"])))
    builder.draft_of = NS(draft_step=NS(num_reqs=2, num_tokens=2, graph_levels=None))
    cm = NS(num_reqs=4, num_actual_tokens=4)
    own = NS(num_reqs=3, num_tokens=3, graph_levels=None)
    for step in (None, own):
        with pytest.raises(Planned):
            builder.build(0, cm, relay_step=step)
    with pytest.raises(Planned):
        builder.build_for_cudagraph_capture(cm)
    # the drafter's pass: a graph where the planner's rule says one runs (vLLM picks it unseen)
    assert planned == [(builder.draft_of.draft_step, False, None), (own, False, False), (None, True, True)]
    assert backend.RelayMetadataBuilder.draft_of is None  # the target's builders: no drafter step


@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])
def test_window_warm_up_reads_caches_laid_out_as_the_layers(fp8, monkeypatch):
    """The builder's warm-up of the window level's kernel (interpreted here) runs on a two-page cache that
    `_caches` views as the layers' forward does: [blocks, block_size, Hkv, D], FP8 where the cache is."""
    from types import SimpleNamespace as NS

    import torch

    from vllm_relay.ops import window_level

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    calls = []
    monkeypatch.setattr(backend, "warm_up_window_level",
                        lambda *a, **kw: calls.append((a, kw)) or window_level.warm_up_window_level(*a, **kw))
    fp8_dtype = torch.float8_e4m3fn if fp8 else None
    planner = NS(hkv=2, page_size=16, window=64, max_tokens=40, device=torch.device("cpu"),
                 q_buf=torch.zeros(8, 4, 32, dtype=torch.bfloat16),
                 out_buf=torch.zeros(8, 4, 32, dtype=torch.bfloat16))
    impl = NS(head_size=32, fp8_dtype=fp8_dtype, scale=0.17, logits_soft_cap=None)
    builder = NS(planner=planner, kv_cache_dtype=torch.bfloat16)
    backend.RelayMetadataBuilder._warm_up_window_levels(builder, impl)
    (q, k, v, out, max_rows, keys, scale), kw = calls[0]
    assert k.shape == v.shape == (2, 16, 2, 32) and k.dtype == (fp8_dtype or torch.bfloat16)
    assert (max_rows, keys, scale, kw["softcap"]) == (40, 64, 0.17, 0.0)
    assert ("k_descale" in kw) == fp8 and kw.get("q_descale") is None
