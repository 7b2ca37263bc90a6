"""Relay's model state on Model Runner V2 (attention/model_state.py), on vLLM's own classes.

MRV2 needs Triton on a GPU, so the state is driven directly with what the runner hands it: new
requests (their tags), scheduler outputs (their blocks), gathered batches. Checked against references
written here: the step's facts in batch order, the host block table against a list-of-blocks model,
the fills' pages, the shifted positions (every token of a relay request by its system length), the
metadata vLLM hands the builders.
"""

from types import SimpleNamespace as NS

import numpy as np
import pytest
import torch

from vllm_relay.protocol import RelayTag, tag

PAGE = 32
MAX_REQS = 6
WIDTH = 5
GROUPS = [[]]  # the runner's attention groups (what the model state finds its planner in)


def make_state(monkeypatch, num_groups=1, level_group=0, windows=None):
    """A relay model state over `num_groups` KV-cache groups; the runner's planners: one per group,
    the levels found by `level_group`'s (the others' layers have sliding windows of 64 tokens, or
    `windows[g]`, 0 for none)."""
    from vllm.v1.worker.gpu.model_states.default import DefaultModelState

    from vllm_relay.attention import model_state

    def base_init(self, vllm_config, model, encoder_cache, device):
        self.vllm_config, self.device, self.max_num_reqs = vllm_config, device, MAX_REQS
        self.rope_state = self.prompt_embeds_state = None

    monkeypatch.setattr(DefaultModelState, "__init__", base_init)
    levels = []  # the steps the runner's relay planner was asked to find levels in
    windows = windows or [0 if g == level_group else 64 for g in range(num_groups)]
    planners = [NS(levels_for=levels.append, levels=True, window=windows[g], kv_group=g) for g in range(num_groups)]
    monkeypatch.setattr(model_state.workers, "planners",
                        lambda attn_groups: planners if attn_groups is GROUPS else [])
    config = NS(additional_config={"relay": {"max_prompts": 3, "max_prompt_tokens": 4 * PAGE}},
                cache_config=NS(block_size=PAGE))
    s = model_state.RelayModelState(config, None, None, torch.device("cpu"))
    kv = NS(kv_cache_groups=[NS(kv_cache_spec=NS(block_size=PAGE))] * num_groups)
    tables = [NS(gpu=torch.zeros(MAX_REQS, WIDTH, dtype=torch.int32)) for _ in range(num_groups)]
    s.initialize_kv_cache(kv, NS(block_tables=tables))
    s.levels_asked = levels
    return s


@pytest.fixture
def state(monkeypatch):
    return make_state(monkeypatch)


def new_req(req_id, blocks, t=None, prompt=None):
    params = NS(extra_args=tag(None, t) if t is not None else None)
    return NS(req_id=req_id, sampling_params=params, block_ids=(blocks,), mm_features=[], prefill_token_ids=[1],
              prompt_token_ids=prompt)


def output(new=(), cached=()):
    return NS(scheduled_new_reqs=list(new),
              scheduled_cached_reqs=NS(req_ids=[c[0] for c in cached], new_block_ids=[c[1] for c in cached]))


def batch(idx, counts):
    idx, counts = np.asarray(idx, np.intp), np.asarray(counts, np.int32)
    return NS(idx_mapping_np=idx, num_scheduled_tokens=counts, num_tokens=int(counts.sum()))


def test_the_step_holds_each_rows_tag_blocks_and_lengths_in_batch_order(state):
    index = {"plain": 4, "relay": 1, "fill": 2}
    reqs = [new_req("plain", [7, 8]), new_req("relay", [3], RelayTag(slot=2, system_len=2 * PAGE)),
            new_req("fill", [10, 11, 12], RelayTag(slot=1, system_len=2 * PAGE, fill=True))]
    for r in reqs:
        state.add_request(index[r.req_id], r)
    computed = np.zeros(MAX_REQS, np.int32)
    computed[[4, 1, 2]] = [40, 5, 0]
    req_states = NS(req_id_to_index=index, num_computed_tokens_np=computed)
    state.plan(output(new=reqs), batch([1, 4, 2], [1, 1, 70]), req_states, GROUPS)
    step = state.step
    assert step.num_reqs == 3 and step.num_tokens == 72
    assert step.req_slot.tolist() == [2, -1, -1] and step.req_shift.tolist() == [2 * PAGE, 0, 0]
    assert step.q_lens.tolist() == [1, 1, 70] and step.seq_lens.tolist() == [6, 41, 70]
    assert step.block_table[:, :3].tolist() == [[3, 0, 0], [7, 8, 0], [10, 11, 12]]
    assert state.pages.pages[0, 1, :2].tolist() == [10, 11]  # the fill's system pages (2 of its 3 blocks)
    assert state.levels_asked == [step]  # the levels are found before vLLM picks the graph
    assert step.pages is state.pages  # the model state's slot pages go to the planner with the step

    # Next step: running requests get blocks appended, a new one takes a free index.
    reqs2 = [new_req("relay2", [20], RelayTag(slot=0, system_len=PAGE))]
    index["relay2"] = 0
    computed[[4, 1, 2, 0]] = [41, 6, 70, 0]
    state.add_request(0, reqs2[0])
    state.plan(output(new=reqs2, cached=[("relay", ([9],)), ("plain", None)]), batch([1, 4, 0], [1, 1, 3]),
               req_states, GROUPS)
    assert state.step.block_table[:, :2].tolist() == [[3, 9], [7, 8], [20, 0]]
    assert state.step.req_shift.tolist() == [2 * PAGE, 0, PAGE]


def test_a_batch_of_the_same_rows_keeps_its_arrays_and_a_reused_index_does_not(state):
    state.add_request(0, new_req("a", [1], RelayTag(slot=0, system_len=PAGE)))
    req_states = NS(req_id_to_index={"a": 0}, num_computed_tokens_np=np.zeros(MAX_REQS, np.int32))
    state.plan(output(new=[new_req("a", [1])]), batch([0], [4]), req_states, GROUPS)
    first = state.step.req_slot
    state.plan(output(), batch([0], [1]), req_states, GROUPS)
    assert state.step.req_slot is first and not first.flags.writeable  # the planner's tree cache key
    state.add_request(0, new_req("b", [2]))  # another request at index 0
    state.plan(output(new=[new_req("b", [2])]), batch([0], [4]), NS(req_id_to_index={"b": 0},
                                                                  num_computed_tokens_np=np.zeros(MAX_REQS, np.int32)),
               GROUPS)
    assert state.step.req_slot is not first and state.step.req_slot.tolist() == [-1]


def test_two_kv_cache_groups_each_fill_pages_and_the_levels_from_one_groups_table(monkeypatch):
    """A model with sliding-window layers (group 0 here) and full-attention ones (group 1): a fill's
    pages are recorded in both groups, the step's table is the level group's, and it holds both."""
    state = make_state(monkeypatch, num_groups=2, level_group=1)
    index = {"plain": 0, "fill": 1}
    reqs = [new_req("plain", [7, 8]), new_req("fill", [10, 11, 12], RelayTag(1, 2 * PAGE, fill=True))]
    reqs[0].block_ids, reqs[1].block_ids = ([7, 8], [27, 28]), ([10, 11, 12], [30, 31, 32])
    for r in reqs:
        state.add_request(index[r.req_id], r)
    req_states = NS(req_id_to_index=index, num_computed_tokens_np=np.zeros(MAX_REQS, np.int32))
    state.plan(output(new=reqs), batch([0, 1], [40, 70]), req_states, GROUPS)
    step = state.step
    assert step.level_group == 1 and state.levels_asked == [step]
    assert step.block_table[:, :3].tolist() == [[27, 28, 0], [30, 31, 32]]
    # every group's table too (the window group's planner checks the levels against its own)
    assert [t[:, :3].tolist() for t in step.tables] == [[[7, 8, 0], [10, 11, 12]], [[27, 28, 0], [30, 31, 32]]]
    assert state.pages.pages[:, 1, :2].tolist() == [[10, 11], [30, 31]]


def test_only_the_level_groups_and_window_groups_tables_are_copied(monkeypatch):
    """Group 0 full attention (the levels'), group 1 full attention too (no window: it reads the levels'
    pages through its own tables, nothing to check), group 2 sliding windows: group 1's host table is
    not copied for the step."""
    state = make_state(monkeypatch, num_groups=3, level_group=0, windows=[0, 0, 64])
    reqs = [new_req("a", [7, 8])]
    reqs[0].block_ids = ([7, 8], [17, 18], [27, 28])
    state.add_request(0, reqs[0])
    req_states = NS(req_id_to_index={"a": 0}, num_computed_tokens_np=np.zeros(MAX_REQS, np.int32))
    state.plan(output(new=reqs), batch([0], [40]), req_states, GROUPS)
    tables = state.step.tables
    assert tables[1] is None and tables[0][:, :2].tolist() == [[7, 8]] and tables[2][:, :2].tolist() == [[27, 28]]


def test_a_dummy_run_has_no_step(state):
    state.step = object()
    state.plan(None, None, None, GROUPS)
    assert state.step is None


def test_host_block_table_matches_a_list_of_blocks_model():
    from vllm_relay.attention.model_state import HostBlockTable

    rng = np.random.default_rng(7)
    table, model = HostBlockTable(4, 9), [[] for _ in range(4)]
    for _ in range(200):
        row, overwrite = int(rng.integers(4)), bool(rng.random() < 0.2)
        ids = rng.integers(1, 100, size=int(rng.integers(0, 4))).tolist()
        if not overwrite and len(model[row]) + len(ids) > 9:
            continue
        table.write(row, ids, overwrite)
        model[row] = ids if overwrite else model[row] + ids
        for r in range(4):
            assert table.table[r, : len(model[r])].tolist() == model[r] and table.count[r] == len(model[r])


def test_relay_positions_are_shifted_after_vllm_used_them_and_before_the_forward(state):
    state.add_request(0, new_req("a", [1], RelayTag(slot=0, system_len=3 * PAGE)))
    state.add_request(1, new_req("b", [2]))
    state.add_request(2, new_req("c", [3], RelayTag(slot=1, system_len=PAGE)))
    req_states = NS(req_id_to_index={"a": 0, "b": 1, "c": 2}, num_computed_tokens_np=np.zeros(MAX_REQS, np.int32))
    state.plan(output(), batch([2, 1, 0], [2, 3, 1]), req_states, GROUPS)
    own = torch.tensor([5, 6, 0, 1, 2, 9, 0, 0])  # the step's positions, then padding
    positions = own.clone()
    state.preprocess_state(NS(positions=positions), None, None, None)
    assert positions.tolist() == [5 + PAGE, 6 + PAGE, 0, 1, 2, 9 + 3 * PAGE, 0, 0]
    state.plan(output(), batch([1], [3]), req_states, GROUPS)  # no relay row: untouched
    positions = own.clone()
    state.preprocess_state(NS(positions=positions), None, None, None)
    assert torch.equal(positions, own)


def test_m_rope_positions_are_shifted_in_every_section_once_a_step(state, monkeypatch):
    """An M-RoPE model's positions, which vLLM makes after `preprocess_state` (`prepare_inputs`), get
    each token's shift in every section, once a step."""
    from vllm.v1.worker.gpu.model_states.default import DefaultModelState

    monkeypatch.setattr(DefaultModelState, "prepare_inputs",
                        lambda self, input_batch, req_states: {"positions": self.rope_state.positions[:, :6]})
    state.add_request(0, new_req("a", [1], RelayTag(slot=0, system_len=3 * PAGE)))
    state.add_request(1, new_req("b", [2]))
    state.add_request(2, new_req("c", [3], RelayTag(slot=1, system_len=PAGE)))
    req_states = NS(req_id_to_index={"a": 0, "b": 1, "c": 2}, num_computed_tokens_np=np.zeros(MAX_REQS, np.int32))
    state.plan(output(), batch([2, 1, 0], [2, 3, 1]), req_states, GROUPS)
    state.rope_state = NS(positions=torch.tensor([[5, 6, 0, 1, 2, 9, 0]] * 3))  # text: (p, p, p)
    state.preprocess_state(NS(positions=torch.zeros(8, dtype=torch.int64)), None, None, None)
    shifted = [[5 + PAGE, 6 + PAGE, 0, 1, 2, 9 + 3 * PAGE]] * 3
    assert state.prepare_inputs(None, None)["positions"].tolist() == shifted
    assert state.prepare_inputs(None, None)["positions"].tolist() == shifted  # not shifted twice


def test_the_builders_get_the_step_and_a_capture_its_kind(state, monkeypatch):
    from vllm.v1.worker.gpu.model_states.default import DefaultModelState

    asked = []
    monkeypatch.setattr(DefaultModelState, "prepare_attn",
                        lambda self, *a, **kw: asked.append(kw["model_specific_attn_metadata"]) or {})
    relay_builder = NS(takes_relay_step=True, capturing=None)
    other_builder = NS()
    groups = [[NS(get_metadata_builder=lambda i=0: relay_builder), NS(get_metadata_builder=lambda i=0: other_builder)]]
    from vllm.config.compilation import CUDAGraphMode

    state.step = step = NS(graph_levels=True, graph_unsplit=True)  # the twin, as the graph manager chose
    state.prepare_attn(None, CUDAGraphMode.FULL, None, None, groups, None)
    assert asked[-1].get_extra_attn_kwargs(relay_builder, 3) == {"relay_step": step}
    assert asked[-1].get_extra_attn_kwargs(other_builder, 3) == {}
    assert relay_builder.capturing is None and step.graph_levels  # a real step: no capture flags written
    state.prepare_attn(None, CUDAGraphMode.NONE, None, None, groups, None)  # DP ranks agreed on eager after all
    assert step.graph_levels is None and not step.graph_unsplit
    state.capturing = (True, True)
    state.prepare_attn(None, None, None, None, groups, None, for_capture=True)
    assert relay_builder.capturing == (True, True) and not hasattr(other_builder, "capturing")
    assert asked[-1].get_extra_attn_kwargs(relay_builder, 3) == {"relay_step": None}


def test_only_relay_engines_get_relays_model_state_and_only_where_vllm_picks_its_default(monkeypatch):
    import vllm.v1.worker.gpu.model_states as states
    from vllm.v1.worker.gpu.model_states.default import DefaultModelState

    from vllm_relay.attention.model_state import RelayModelState
    from vllm_relay.hooks import model_runner

    picked = [DefaultModelState]
    import types

    fake = types.ModuleType("states")
    fake.resolve_model_state_cls = lambda c, m: picked[0]
    monkeypatch.setattr(model_runner, "_states", fake)
    monkeypatch.setattr(model_runner, "relay_enabled", lambda c: c == "relay")
    assert model_runner._resolve_model_state_cls("relay", None) is RelayModelState
    assert model_runner._resolve_model_state_cls("plain", None) is DefaultModelState
    picked[0] = states.interface.ModelState
    with pytest.raises(ValueError, match="decoder-only attention models; this model runs vLLM's ModelState"):
        model_runner._resolve_model_state_cls("relay", None)
    assert model_runner._resolve_model_state_cls("plain", None) is states.interface.ModelState


def test_a_drafters_later_passes_get_a_token_per_row_and_each_rows_shift(state):
    """With a drafter of several tokens a step attached, every step also records the drafter's step (a
    token per row, the rows' slots and shifts, no level) and each batch row's shift on the device, zero
    past the batch and in a step that shifts nothing; a dummy run has no drafter step."""
    assert state.draft_step is None and state.row_shift is None
    state.attach_drafter()
    state.add_request(0, new_req("a", [1], RelayTag(slot=0, system_len=3 * PAGE)))
    state.add_request(1, new_req("b", [2]))
    state.add_request(2, new_req("c", [3], RelayTag(slot=1, system_len=PAGE)))
    req_states = NS(req_id_to_index={"a": 0, "b": 1, "c": 2}, num_computed_tokens_np=np.zeros(MAX_REQS, np.int32))
    state.row_shift.fill_(7)  # stale values of an earlier step
    state.plan(output(), batch([2, 1, 0], [2, 3, 1]), req_states, GROUPS)
    d = state.draft_step
    assert (d.num_reqs, d.num_tokens, d.level_group, d.pages) == (3, 3, -1, state.pages)
    assert d.req_slot.tolist() == [1, -1, 0] and d.req_shift.tolist() == [PAGE, 0, 3 * PAGE]
    assert d.q_lens.tolist() == [1, 1, 1] and d.block_table is None and d.tree is None
    state.preprocess_state(NS(positions=torch.zeros(8, dtype=torch.int64)), None, None, None)
    assert state.row_shift.tolist() == [PAGE, 0, 3 * PAGE] + [0] * (MAX_REQS - 3)
    state.plan(output(), batch([1], [3]), req_states, GROUPS)  # no relay row
    state.row_shift.fill_(7)
    state.preprocess_state(NS(positions=torch.zeros(8, dtype=torch.int64)), None, None, None)
    assert state.row_shift.tolist() == [0] * MAX_REQS and state.draft_step.req_shift.tolist() == [0]
    state.plan(None, None, req_states, GROUPS)
    assert state.step is None and state.draft_step is None


def test_an_ngram_drafter_gets_each_slots_tokens_from_its_fill_and_each_rows_slot(state):
    """With an n-gram drafter attached, a fill request's prompt (its slot's system tokens, then its
    lookahead) is kept as the slot's tokens, and every step that shifts writes each batch row's slot
    beside its shift."""
    state.attach_drafter(tokens=True)
    assert state.slot_tokens.shape == (3, 4 * PAGE) and state.row_slot.shape == (MAX_REQS,)
    system = list(range(100, 100 + 2 * PAGE + 3))
    state.add_request(3, new_req("fill", [5, 6, 7], RelayTag(slot=1, system_len=2 * PAGE + 3, fill=True),
                                 prompt=system))
    assert state.slot_tokens[1, : len(system)].tolist() == system and not state.slot_tokens[[0, 2]].any()
    state.add_request(0, new_req("a", [1], RelayTag(slot=1, system_len=2 * PAGE)))
    state.add_request(1, new_req("b", [2]))
    req_states = NS(req_id_to_index={"a": 0, "b": 1}, num_computed_tokens_np=np.zeros(MAX_REQS, np.int32))
    state.plan(output(), batch([1, 0], [1, 1]), req_states, GROUPS)
    state.row_slot.fill_(7)
    state.preprocess_state(NS(positions=torch.zeros(8, dtype=torch.int64)), None, None, None)
    assert state.row_slot[:2].tolist() == [-1, 1] and state.row_shift[:2].tolist() == [0, 2 * PAGE]
    assert state.draft_step is None  # (no drafter passes to plan for)
