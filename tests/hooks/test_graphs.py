"""Full CUDA graphs per decode size on Model Runner V2: vLLM's graph manager with relay's twins.

vLLM's CPU platform has no CUDA graphs, so vLLM's own `ModelCudaGraphManager` is built over capture
sizes and driven directly: every uniform-decode FULL graph gets its levels twins, captured right
beside it (the split twin first); a step without levels gets vLLM's own graph, a step with levels the
twin; what was chosen is recorded on the step for the planner; the capture tells the model state
which kind of graph each one is.
"""

import numpy as np
import pytest

from vllm_relay.attention import step as relay_step


class State:
    """What the graph manager reads of the relay model state."""

    step = None
    planner = None
    capturing = (False, False)
    multi_token_graphs = False


def manager(monkeypatch, mode_name="FULL_AND_PIECEWISE", decode_query_len=1, multi_token=False, draft=False):
    """vLLM's graph manager of the target model (`draft`: of a drafter model's first pass), relay's."""
    import vllm.v1.worker.gpu.cudagraph_utils as cu
    from vllm.config import CUDAGraphMode, VllmConfig
    from vllm.v1.worker.gpu.spec_decode.target_dependent_ar.cudagraph_utils import SpeculatorCudaGraphManager

    monkeypatch.setattr(cu, "get_pp_group", lambda: type("PP", (), {"is_first_rank": True, "is_last_rank": True}))
    monkeypatch.setattr(cu.current_platform, "get_global_graph_pool", lambda: None, raising=False)
    config = VllmConfig()
    config.compilation_config.cudagraph_capture_sizes = [1, 2, 4, 8]
    config.compilation_config.max_cudagraph_capture_size = 8
    cls = SpeculatorCudaGraphManager if draft else cu.ModelCudaGraphManager
    m = cls(config, "cpu", getattr(CUDAGraphMode, mode_name), decode_query_len=decode_query_len)
    from vllm_relay.hooks.graphs import relay_draft_graphs, relay_graphs

    state = State()
    state.multi_token_graphs = multi_token
    (relay_draft_graphs if draft else relay_graphs)(m, state)
    return m


def captured(m):
    """As if every keyed graph had been captured."""
    for descs in m._capture_descs.values():
        for d in descs:
            m.graphs[d] = object()
    m._graphs_captured = True
    return m


def step_with(tree):
    s = relay_step.RelayStep(3, 3, np.full(3, -1, np.int32), np.zeros(3, np.int32), np.ones(3, np.int32))
    s.tree, s.levels_planned = tree, True
    return s


def kind(desc):
    from vllm_relay.hooks.graphs import RelayLevelsDescriptor

    if not isinstance(desc, RelayLevelsDescriptor):
        return "plain"
    return "unsplit" if desc.relay_unsplit else "split"


def test_each_size_captures_its_twins_beside_vllms_graph_the_split_twin_first(monkeypatch):
    """vLLM estimates its FULL graphs' memory from the first few of its list (largest first): the
    largest twin is first. Piecewise graphs (no attention inside) get no twins."""
    from vllm.config import CUDAGraphMode

    monkeypatch.delenv("VLLM_RELAY_UNSPLIT_GRAPHS", raising=False)
    m = manager(monkeypatch)
    full = m._capture_descs[CUDAGraphMode.FULL]
    assert [(d.num_tokens, kind(d)) for d in full] == \
        [(n, k) for n in (8, 4, 2, 1) for k in ("split", "plain", "unsplit")]
    assert all(kind(d) == "plain" for d in m._capture_descs[CUDAGraphMode.PIECEWISE])
    monkeypatch.setenv("VLLM_RELAY_UNSPLIT_GRAPHS", "0")
    m = manager(monkeypatch)
    assert [kind(d) for d in m._capture_descs[CUDAGraphMode.FULL]] == ["split", "plain"] * 4
    m.add_level_twins()  # idempotent
    assert len(m._capture_descs[CUDAGraphMode.FULL]) == 8


def test_a_step_replays_the_twin_only_when_it_has_levels_and_the_choice_is_recorded(monkeypatch):
    from vllm.config import CUDAGraphMode

    from types import SimpleNamespace

    monkeypatch.delenv("VLLM_RELAY_UNSPLIT_GRAPHS", raising=False)
    m = captured(manager(monkeypatch))
    state = m.relay_state
    state.planner = SimpleNamespace(runs_unsplit=lambda tree, n, u=1: tree == "wide")  # the planner's rule
    state.step = step_with(None)  # nothing shared: vLLM's own graph
    desc = m.dispatch(3, 3, 1, 0, 1)
    assert desc.cg_mode == CUDAGraphMode.FULL and kind(desc) == "plain" and desc.num_tokens == 4
    assert state.step.graph_levels is False and not state.step.graph_unsplit
    state.step = step_with("narrow")  # levels the planner splits: the split twin
    desc = m.dispatch(3, 3, 1, 0, 1)
    assert kind(desc) == "split" and desc.num_tokens == 4 and state.step.graph_levels is True
    assert not state.step.graph_unsplit
    state.step = step_with("wide")  # levels the planner runs unsplit: the unsplit twin
    desc = m.dispatch(3, 3, 1, 0, 1)
    assert kind(desc) == "unsplit" and state.step.graph_levels and state.step.graph_unsplit
    monkeypatch.setenv("VLLM_RELAY_UNSPLIT_GRAPHS", "2")  # every step with levels: unsplit
    state.step = step_with("narrow")
    assert kind(m.dispatch(3, 3, 1, 0, 1)) == "unsplit"
    state.step = step_with("narrow")  # a mixed batch: piecewise, no full graph recorded
    desc = m.dispatch(3, 5, None, 0, None)
    assert desc.cg_mode == CUDAGraphMode.PIECEWISE and state.step.graph_levels is None
    state.step = None  # a dummy run: vLLM's choice, untouched
    assert kind(m.dispatch(3, 3, 1, 0, 1)) == "plain"


def test_a_twin_not_captured_is_never_chosen(monkeypatch):
    from vllm.config import CUDAGraphMode

    m = manager(monkeypatch)
    for d in m._capture_descs[CUDAGraphMode.FULL]:
        if kind(d) == "plain":
            m.graphs[d] = object()
    m._graphs_captured = True
    m.relay_state.step = step_with("narrow")
    desc = m.dispatch(3, 3, 1, 0, 1)
    assert kind(desc) == "plain" and m.relay_state.step.graph_levels is False


def test_under_cudagraph_mode_full_one_token_decodes_with_levels_replay_twins(monkeypatch):
    """`cudagraph_mode=FULL`: vLLM keys one FULL graph a size for any batch (prompt chunks too). Each
    size that can hold a one-token decode gets its twins, captured as one (`uniform_token_count` 1:
    vLLM's capture makes its dummy batch's queries that long), replayed only for a step that is such a
    decode and has levels. A step with a prompt chunk replays vLLM's graph, levels off for that step
    (recorded for the planner); one past the largest graph runs eagerly, free to run levels."""
    from types import SimpleNamespace

    from vllm.config import CUDAGraphMode

    monkeypatch.delenv("VLLM_RELAY_UNSPLIT_GRAPHS", raising=False)
    m = manager(monkeypatch, "FULL")
    assert CUDAGraphMode.PIECEWISE not in m._capture_descs
    full = m._capture_descs[CUDAGraphMode.FULL]
    assert [(d.num_tokens, d.num_reqs, kind(d)) for d in full] == \
        [(n, n, k) for n in (8, 4, 2, 1) for k in ("split", "plain", "unsplit")]
    assert all((d.uniform_token_count == 1) == (kind(d) != "plain") for d in full)
    m = captured(m)
    state = m.relay_state
    state.planner = SimpleNamespace(runs_unsplit=lambda tree, n, u=1: tree == "wide")
    state.step = step_with("narrow")  # three one-token decodes with levels
    desc = m.dispatch(3, 3, 1, 0, 1)
    assert kind(desc) == "split" and desc.num_tokens == 4 and state.step.graph_levels is True
    state.step = step_with("wide")
    assert kind(m.dispatch(3, 3, 1, 0, 1)) == "unsplit" and state.step.graph_unsplit
    state.step = step_with(None)  # nothing shared: vLLM's graph
    desc = m.dispatch(3, 3, 1, 0, 1)
    assert kind(desc) == "plain" and state.step.graph_levels is False
    state.step = step_with("narrow")  # a prompt chunk beside two decodes: vLLM's graph, no levels
    desc = m.dispatch(3, 5, None, 0, None)
    assert desc.cg_mode == CUDAGraphMode.FULL and kind(desc) == "plain" and desc.num_tokens == 8
    assert state.step.graph_levels is False and not state.step.graph_unsplit
    state.step = step_with("narrow")  # past the largest graph: eager, levels as planned
    desc = m.dispatch(3, 20, None, 0, None)
    assert desc.cg_mode == CUDAGraphMode.NONE and state.step.graph_levels is None
    # With drafts a decode is several tokens a request: no twins (none would ever replay).
    assert all(kind(d) == "plain" for d in manager(monkeypatch, "FULL", 3)._capture_descs[CUDAGraphMode.FULL])


def test_verification_decodes_get_twins_where_asked(monkeypatch):
    """With drafts of 3 tokens vLLM keys its decode graphs by 4 tokens a request. Where relay twins
    every graph over the target's tables (`multi_token`), each gets twins holding the levels, captured
    as such a decode (the levels' own call split and unsplit; the contexts are a call of their own); a
    verification step with levels replays one (the planner's rule asked for 4 tokens a request), one
    without replays vLLM's graph, a step of another count (a request without drafts) never gets a twin
    captured for 4."""
    from types import SimpleNamespace

    from vllm.config import CUDAGraphMode

    monkeypatch.delenv("VLLM_RELAY_UNSPLIT_GRAPHS", raising=False)
    plain = manager(monkeypatch, decode_query_len=4)._capture_descs[CUDAGraphMode.FULL]
    assert all(kind(d) == "plain" for d in plain)
    m = manager(monkeypatch, decode_query_len=4, multi_token=True)
    full = m._capture_descs[CUDAGraphMode.FULL]
    assert [(d.num_tokens, d.num_reqs, d.uniform_token_count, kind(d)) for d in full] == \
        [(n, n // 4, 4, k) for n in (8, 4) for k in ("split", "plain", "unsplit")]
    m = captured(m)
    state = m.relay_state
    asked = []
    state.planner = SimpleNamespace(runs_unsplit=lambda tree, n, u=1: asked.append(u) or tree == "wide")
    state.step = step_with("narrow")
    desc = m.dispatch(2, 8, 4, 0, 4)
    assert kind(desc) == "split" and desc.uniform_token_count == 4 and desc.num_tokens == 8
    assert state.step.graph_levels is True and not state.step.graph_unsplit and asked == [4]
    state.step = step_with("wide")
    assert kind(m.dispatch(2, 8, 4, 0, 4)) == "unsplit" and state.step.graph_unsplit
    state.step = step_with(None)
    assert kind(m.dispatch(2, 8, 4, 0, 4)) == "plain" and state.step.graph_levels is False
    state.step = step_with("narrow")  # one token a request: no graph of that count, none of its twins
    assert kind(m.dispatch(2, 2, 1, 0, 1)) == "plain"


def test_a_drafter_models_first_pass_replays_its_twin_exactly_when_the_target_step_did(monkeypatch):
    """EAGLE-3 / MTP: the drafter's first pass runs over the target step's tokens on the target's
    tables. Its verification graphs get twins like the target's; it replays the twin of the kind the
    target's step replayed (`graph_levels`, `graph_unsplit`: the target's dispatch), else vLLM's graph;
    with no twin captured for the size, it runs eagerly (on the target's metadata), never vLLM's graph
    over tables that leave the levels' pages out."""
    from vllm.config import CUDAGraphMode

    m = manager(monkeypatch, decode_query_len=4, draft=True)
    full = m._capture_descs[CUDAGraphMode.FULL]
    assert [(d.num_tokens, d.uniform_token_count, kind(d)) for d in full] == \
        [(n, 4, k) for n in (8, 4) for k in ("split", "plain", "unsplit")]
    m = captured(m)
    state = m.relay_state
    state.step = step_with("narrow")
    state.step.graph_levels = True  # the target replayed its split twin
    assert kind(m.dispatch(2, 8, 4, 0, 4)) == "split"
    state.step.graph_unsplit = True  # its unsplit one
    assert kind(m.dispatch(2, 8, 4, 0, 4)) == "unsplit"
    state.step.graph_unsplit = False
    state.step.graph_levels = False  # the target replayed vLLM's graph
    assert kind(m.dispatch(2, 8, 4, 0, 4)) == "plain"
    state.step.graph_levels = None  # the target ran eagerly or piecewise
    assert kind(m.dispatch(2, 8, 4, 0, 4)) == "plain"
    del m.graphs[[d for d in m.graphs if kind(d) == "split" and d.num_tokens == 8][0]]
    state.step.graph_levels = True
    desc = m.dispatch(2, 8, 4, 0, 4)
    assert desc.cg_mode == CUDAGraphMode.NONE and desc.num_tokens == 8


def test_a_drafter_capture_builds_each_twins_metadata_with_the_levels(monkeypatch):
    """The drafter's first-pass manager builds each graph's metadata through the target's builders
    (`prepare_inputs_to_capture`); relay's class sits below it, so the model state says, while each
    is built, whether that graph holds the levels."""
    import vllm.v1.worker.gpu.cudagraph_utils as cu
    import vllm.v1.worker.gpu.spec_decode.target_dependent_ar.cudagraph_utils as spec_cu
    from vllm.config import CUDAGraphMode

    m = manager(monkeypatch, decode_query_len=4, draft=True)
    seen = []

    def build(num_reqs, num_tokens, *args, **kwargs):
        seen.append((num_tokens, m.relay_state.capturing))
        return None, None

    def base_capture(self, create_forward_fn, progress_bar_desc="Capturing CUDA graphs"):
        for d in self._capture_descs[CUDAGraphMode.FULL]:
            create_forward_fn(d, warmup=False)
            assert self.relay_state.capturing == (False, False)

    monkeypatch.setattr(spec_cu, "prepare_inputs_to_capture", build)
    monkeypatch.setattr(cu.CudaGraphManager, "capture", base_capture)
    m.capture(lambda *a, **k: None, m.relay_state, None, None, [], None)
    assert seen == [(n, c) for n in (8, 4) for c in ((True, False), (False, False), (True, True))]


def test_multi_token_twins_where_relay_twins_every_graph_over_the_tables_and_planners_read_levels(monkeypatch):
    """Only with VLLM_RELAY_VERIFY_GRAPHS=1 (the default replays vLLM's graphs for verification)."""
    from types import SimpleNamespace

    from vllm.v1.worker.gpu.spec_decode.speculator import DraftModelSpeculator
    from vllm.v1.worker.gpu.spec_decode.target_dependent_ar.cudagraph_utils import SpeculatorCudaGraphManager

    from vllm_relay.hooks.graphs import multi_token_twins

    class Ngram:
        pass

    gqa, mla = SimpleNamespace(max_level_query_len=None), SimpleNamespace(max_level_query_len=1)
    runner = SimpleNamespace(speculator=Ngram(), decode_query_len=4)
    monkeypatch.delenv("VLLM_RELAY_VERIFY_GRAPHS", raising=False)
    assert not multi_token_twins(runner, [gqa])
    monkeypatch.setenv("VLLM_RELAY_VERIFY_GRAPHS", "1")
    assert multi_token_twins(runner, [gqa])
    assert not multi_token_twins(runner, [gqa, mla])  # MLA's decode form: one token a request here
    assert multi_token_twins(runner, [SimpleNamespace(max_level_query_len=4)])
    assert not multi_token_twins(SimpleNamespace(speculator=None, decode_query_len=1), [gqa])
    class Drafter(DraftModelSpeculator):
        pass

    Drafter.__abstractmethods__ = frozenset()
    drafter = Drafter.__new__(Drafter)  # EAGLE-3, MTP: their first pass's graphs get twins too
    drafter.prefill_cudagraph_manager = SpeculatorCudaGraphManager.__new__(SpeculatorCudaGraphManager)
    assert multi_token_twins(SimpleNamespace(speculator=drafter, decode_query_len=4), [gqa])
    drafter.prefill_cudagraph_manager = None  # (no graphs)
    assert multi_token_twins(SimpleNamespace(speculator=drafter, decode_query_len=4), [gqa])
    other = type("OwnGraphs", (SpeculatorCudaGraphManager,), {})  # another drafter's graphs: none
    drafter.prefill_cudagraph_manager = other.__new__(other)
    assert not multi_token_twins(SimpleNamespace(speculator=drafter, decode_query_len=4), [gqa])


def test_each_capture_tells_the_model_state_which_graph_it_is(monkeypatch):
    """vLLM's model manager hands its per-graph factory to its base class's capture; relay's class sits
    between the two, so the model state knows, while each graph's metadata is built, whether that graph
    holds the levels (and unsplit), and nothing outside a capture sees a capture's flags."""
    import vllm.v1.worker.gpu.cudagraph_utils as cu
    from vllm.config import CUDAGraphMode

    m = manager(monkeypatch)
    seen = []

    def base_capture(self, create_forward_fn, progress_bar_desc="Capturing CUDA graphs"):
        for d in self._capture_descs[CUDAGraphMode.FULL]:
            create_forward_fn(d, warmup=True)
            assert self.relay_state.capturing == (False, False)

    def model_capture(self, *args, **kwargs):  # vLLM's: builds the factory, calls its base class
        def create(desc, warmup):
            seen.append((kind(desc), self.relay_state.capturing))
        super(cu.ModelCudaGraphManager, self).capture(create)  # next in the order: relay's class

    monkeypatch.setattr(cu.CudaGraphManager, "capture", base_capture)
    monkeypatch.setattr(cu.ModelCudaGraphManager, "capture", model_capture)
    m.capture()
    assert seen[:3] == [("split", (True, False)), ("plain", (False, False)), ("unsplit", (True, True))]
    assert len(seen) == 12


def test_relay_graphs_refuses_a_manager_it_does_not_know(monkeypatch):
    import vllm.v1.worker.gpu.cudagraph_utils as cu

    from vllm_relay.hooks.graphs import relay_graphs

    class Other(cu.ModelCudaGraphManager):
        pass

    with pytest.raises(RuntimeError, match="unexpected CUDA graph manager Other"):
        relay_graphs(Other.__new__(Other), State())
