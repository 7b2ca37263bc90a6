"""Two full CUDA graphs per decode size: vLLM's dispatcher with relay's twins, on vLLM's own code.

vLLM's CPU platform turns CUDA graphs off, so the dispatcher is driven directly with capture sizes:
every FULL key gets a levels twin; a step without levels gets vLLM's own graph, a step with levels
(or the capture of a twin) the twin; what was chosen is recorded for the planner. Engines without
relay are untouched.
"""

import numpy as np
import pytest

import vllm_relay
from vllm_relay.attention import step as relay_step


def dispatcher(backend):
    from vllm.config import CUDAGraphMode, VllmConfig
    from vllm.config.attention import AttentionConfig
    from vllm.v1.cudagraph_dispatcher import CudagraphDispatcher

    from vllm_relay.hooks import graphs

    vllm_relay.register()
    graphs.apply_worker()
    config = VllmConfig(attention_config=AttentionConfig(backend=backend))
    config.compilation_config.cudagraph_capture_sizes = [1, 2, 4, 8]
    config.compilation_config.max_cudagraph_capture_size = 8
    d = CudagraphDispatcher(config)
    d.initialize_cudagraph_keys(CUDAGraphMode.FULL_DECODE_ONLY)
    return d


def step_with(tree):
    s = relay_step.RelayStep(3, 3, np.full(3, -1, np.int32), np.zeros(3, np.int32), np.ones(3, np.int32))
    s.tree, s.levels_planned = tree, True
    return s


@pytest.fixture
def current():
    yield
    relay_step.clear()


def test_every_full_graph_has_a_levels_twin_chosen_only_for_steps_with_levels(current, monkeypatch):
    """With VLLM_RELAY_UNSPLIT_GRAPHS=0 (the unsplit twins are the next test's)."""
    from vllm.config import CUDAGraphMode
    from vllm.v1.attention.backends.registry import AttentionBackendEnum as E

    from vllm_relay.hooks.graphs import RelayLevelsDescriptor, levels_twin

    monkeypatch.setenv("VLLM_RELAY_UNSPLIT_GRAPHS", "0")
    d = dispatcher(E.CUSTOM)
    full = d.cudagraph_keys[CUDAGraphMode.FULL]
    plain = {k for k in full if not isinstance(k, RelayLevelsDescriptor)}
    assert len(plain) == 4 and {levels_twin(k) for k in plain} == full - plain
    assert levels_twin(next(iter(plain))) != next(iter(plain))  # never equal: two graphs

    relay_step._current = step_with(None)  # nothing shared: vLLM's own graph
    mode, desc = d.dispatch(num_tokens=3, uniform_decode=True)
    assert mode == CUDAGraphMode.FULL and type(desc) is not RelayLevelsDescriptor and desc.num_tokens == 4
    assert relay_step._current.graph_levels is False

    relay_step._current = step_with(object())  # a step with levels: the twin, recorded
    mode, desc = d.dispatch(num_tokens=3, uniform_decode=True)
    assert isinstance(desc, RelayLevelsDescriptor) and desc.num_tokens == 4
    assert relay_step._current.graph_levels is True

    mode, desc = d.dispatch(num_tokens=30, uniform_decode=True)  # too large for a graph: eager
    assert mode == CUDAGraphMode.NONE and relay_step._current.graph_levels is None

    relay_step.clear()
    with relay_step.capturing(True):  # capturing a twin (no step being run)
        assert isinstance(d.dispatch(num_tokens=8, uniform_decode=True)[1], RelayLevelsDescriptor)
    assert type(d.dispatch(num_tokens=8, uniform_decode=True)[1]) is not RelayLevelsDescriptor


def test_engines_without_relay_keep_vllms_keys(current):
    from vllm.config import CUDAGraphMode
    from vllm.v1.attention.backends.registry import AttentionBackendEnum as E

    from vllm_relay.hooks.graphs import RelayLevelsDescriptor

    d = dispatcher(E.FLASH_ATTN)
    assert len(d.cudagraph_keys[CUDAGraphMode.FULL]) == 4
    relay_step._current = step_with(object())
    assert not isinstance(d.dispatch(num_tokens=3, uniform_decode=True)[1], RelayLevelsDescriptor)


def test_each_size_captures_its_twin_first_and_plain_engines_keep_vllms_order(monkeypatch):
    """vLLM estimates its graphs' memory from a mode's first two captures: the largest twin first,
    then vLLM's graph of that size (what each further graph adds). VLLM_RELAY_UNSPLIT_GRAPHS=0; with
    the unsplit twins, the next test."""
    from vllm.config import CUDAGraphMode
    from vllm.v1.attention.backends.registry import AttentionBackendEnum as E

    from vllm_relay.hooks.graphs import RelayLevelsDescriptor

    monkeypatch.setenv("VLLM_RELAY_UNSPLIT_GRAPHS", "0")
    full = dict(dispatcher(E.CUSTOM).get_capture_descs())[CUDAGraphMode.FULL]
    assert [(d.num_tokens, isinstance(d, RelayLevelsDescriptor)) for d in full] == \
        [(n, twin) for n in (8, 4, 2, 1) for twin in (True, False)]
    plain = dict(dispatcher(E.FLASH_ATTN).get_capture_descs())[CUDAGraphMode.FULL]
    assert [d.num_tokens for d in plain] == [8, 4, 2, 1]


def test_vllm_asking_relays_graph_support_applies_the_worker_hooks_first():
    """vLLM keys its graphs (for its memory profile) before it makes any metadata builder, right
    after asking the builder class for its CUDA-graph support: the twins' hook must be in by then."""
    import torch
    from vllm.config import VllmConfig
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    from vllm_relay import hooks
    from vllm_relay.attention.backend import RelayMetadataBuilder

    hooks.revert_all()
    try:
        assert "CudagraphDispatcher.initialize_cudagraph_keys" not in hooks.applied_patches()
        spec = FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=64, dtype=torch.bfloat16)
        support = RelayMetadataBuilder.get_cudagraph_support(VllmConfig(), spec)
        names = hooks.applied_patches()
        assert {"CudagraphDispatcher.initialize_cudagraph_keys", "CudagraphDispatcher.get_capture_descs",
                "GPUModelRunner._prepare_inputs"} <= set(names)
        from vllm.v1.attention.backends.flash_attn import FlashAttentionMetadataBuilder

        assert support == FlashAttentionMetadataBuilder.get_cudagraph_support(VllmConfig(), spec)
    finally:
        vllm_relay.register()


def test_unsplit_twins_are_keyed_captured_last_and_chosen_by_the_planners_rule(current, monkeypatch):
    """By default (VLLM_RELAY_UNSPLIT_GRAPHS unset, or 1) each size also has the levels' graph with its
    joint call unsplit, captured after vLLM's own (the memory estimate's second graph stays vLLM's), and
    chosen only for steps the planner runs unsplit; 2 chooses it for every step with levels; 0 keys none."""
    from vllm.config import CUDAGraphMode
    from vllm.v1.attention.backends.registry import AttentionBackendEnum as E

    from vllm_relay.attention import workers
    from vllm_relay.hooks.graphs import RelayLevelsDescriptor, levels_twin

    asked = []
    monkeypatch.setattr(workers, "step_runs_unsplit", lambda step, n: asked.append(n) or step.tree == "wide")
    monkeypatch.setenv("VLLM_RELAY_UNSPLIT_GRAPHS", "0")
    d = dispatcher(E.CUSTOM)
    assert not any(getattr(k, "relay_unsplit", False) for k in d.cudagraph_keys[CUDAGraphMode.FULL])
    relay_step._current = step_with("wide")
    assert not d.dispatch(num_tokens=3, uniform_decode=True)[1].relay_unsplit and asked == []

    monkeypatch.delenv("VLLM_RELAY_UNSPLIT_GRAPHS")  # the default
    d = dispatcher(E.CUSTOM)
    full = d.cudagraph_keys[CUDAGraphMode.FULL]
    plain = {k for k in full if not isinstance(k, RelayLevelsDescriptor)}
    assert full == plain | {levels_twin(k) for k in plain} | {levels_twin(k, True) for k in plain}
    assert len(full) == 12 and levels_twin(next(iter(plain)), True) != levels_twin(next(iter(plain)))
    order = dict(d.get_capture_descs())[CUDAGraphMode.FULL]

    def kind(x):
        return "plain" if not isinstance(x, RelayLevelsDescriptor) else "unsplit" if x.relay_unsplit else "split"

    assert [(x.num_tokens, kind(x)) for x in order] == \
        [(n, k) for n in (8, 4, 2, 1) for k in ("split", "plain", "unsplit")]

    desc = d.dispatch(num_tokens=3, uniform_decode=True)[1]  # the planner runs this step unsplit
    assert desc.relay_unsplit and desc.num_tokens == 4 and asked == [4]
    assert relay_step._current.graph_levels and relay_step._current.graph_unsplit
    relay_step._current = step_with("narrow")  # it splits this one
    desc = d.dispatch(num_tokens=3, uniform_decode=True)[1]
    assert isinstance(desc, RelayLevelsDescriptor) and not desc.relay_unsplit
    assert relay_step._current.graph_levels and not relay_step._current.graph_unsplit
    relay_step._current = step_with(None)  # no levels: vLLM's graph, the rule not asked
    assert type(d.dispatch(num_tokens=3, uniform_decode=True)[1]) is not RelayLevelsDescriptor
    assert asked == [4, 4]
    assert not relay_step._current.graph_unsplit

    relay_step.clear()
    with relay_step.capturing(True, True):  # capturing the unsplit twin
        assert d.dispatch(num_tokens=8, uniform_decode=True)[1].relay_unsplit
    with relay_step.capturing(True):
        assert not d.dispatch(num_tokens=8, uniform_decode=True)[1].relay_unsplit

    monkeypatch.setenv("VLLM_RELAY_UNSPLIT_GRAPHS", "2")  # every step with levels
    relay_step._current = step_with("narrow")
    assert d.dispatch(num_tokens=3, uniform_decode=True)[1].relay_unsplit
