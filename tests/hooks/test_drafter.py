"""hooks/drafter.py: a drafter's later passes on Model Runner V2 compute their slots from the own
positions, and relay's drafter builders read the model state's draft step. vLLM's slot kernel needs a
GPU: here a reference of it (a row's position p -> its block table's page p // PAGE, offset p % PAGE)
stands behind the proxy, on fresh random shifts and positions."""

from types import SimpleNamespace as NS

import pytest
import torch

from vllm_relay.hooks import drafter

PAGE = 16


class Tables:
    """vLLM's BlockTables as far as the proxy uses it: the slot of each row's one position."""

    def __init__(self, table: torch.Tensor) -> None:
        self.table, self.width, self.calls = table, table.shape[1], []

    def compute_slot_mappings(self, idx_mapping, query_start_loc, positions, num_tokens_padded, out=None):
        self.calls.append(positions.clone())
        rows = self.table[idx_mapping.long()]
        pos = positions[: idx_mapping.shape[0]].long()
        slots = torch.full((1, num_tokens_padded), -1, dtype=torch.int64)
        slots[0, : pos.shape[0]] = rows.gather(1, (pos // PAGE)[:, None])[:, 0] * PAGE + pos % PAGE
        return slots


def test_slots_come_from_the_own_positions_and_the_rest_is_the_real_tables():
    g = torch.Generator().manual_seed(0)
    n, max_reqs = 7, 9
    table = torch.randint(0, 500, (max_reqs, 6), generator=g)
    own = torch.randint(0, 6 * PAGE, (n,), generator=g)  # each row's own position (in its blocks)
    shift = torch.zeros(max_reqs, dtype=torch.int64)
    shift[:n] = torch.randint(0, 4, (n,), generator=g) * PAGE  # system lengths (whole pages), some 0
    idx = torch.randperm(max_reqs, generator=g)[:n]
    tables = Tables(table)
    proxy = drafter.OwnPositionSlots(tables, shift)
    got = proxy.compute_slot_mappings(idx, torch.arange(n + 1), own + shift[:n], n + 3)
    want = table[idx, own // PAGE] * PAGE + own % PAGE
    assert torch.equal(got[0, :n], want) and torch.equal(tables.calls[-1], own)
    assert proxy.width == 6 and proxy.table is table  # everything else: the real object's
    shift[:n] = 0  # the next step shifts nothing: the same buffer, read again
    assert torch.equal(proxy.compute_slot_mappings(idx, torch.arange(n + 1), own, n)[0], want)


def test_a_pass_of_other_than_one_token_a_row_is_refused_and_dummy_rows_stay_in_range():
    shift = torch.full((4,), 3 * PAGE, dtype=torch.int64)
    proxy = drafter.OwnPositionSlots(Tables(torch.arange(40).view(4, 10)), shift)
    with pytest.raises(RuntimeError, match="one token a request"):
        proxy.compute_slot_mappings(torch.arange(3), torch.arange(4), torch.zeros(2, dtype=torch.int64), 3)
    proxy.compute_slot_mappings(torch.arange(2), torch.arange(3), torch.zeros(2, dtype=torch.int64), 2)
    assert proxy._tables.calls[-1].tolist() == [0, 0]  # (a dummy run's positions: never below 0)


def test_attach_serves_only_a_drafter_of_several_tokens_and_marks_relays_builders(monkeypatch):
    swaps = []
    def swap(obj, name, value):
        swaps.append(name)
        setattr(obj, name, value)

    monkeypatch.setattr(drafter, "swap", swap)
    relay_builder, other = NS(takes_relay_step=True), NS()
    groups = [[NS(metadata_builders=[relay_builder]), NS(metadata_builders=[other])]]
    state = NS(row_shift=None)
    state.attach_drafter = lambda: setattr(state, "row_shift", torch.zeros(4, dtype=torch.int64))
    tables = Tables(torch.zeros(4, 4, dtype=torch.int64))
    spec = NS(num_speculative_steps=1, block_tables=tables, attn_groups=groups)
    one = NS(speculator=spec, model_state=state)
    assert not drafter.attach(one) and not drafter.attach(NS(speculator=None, model_state=state))
    assert state.row_shift is None and swaps == []
    spec = NS(num_speculative_steps=3, block_tables=tables, attn_groups=groups)
    runner = NS(speculator=spec, model_state=state)
    assert drafter.attach(runner)
    assert relay_builder.draft_of is state and not hasattr(other, "draft_of")
    proxy = runner.speculator.block_tables
    assert isinstance(proxy, drafter.OwnPositionSlots) and proxy._tables is tables
    assert swaps == ["block_tables"]
    assert proxy._row_shift is state.row_shift


def test_an_ngram_speculator_drafts_from_the_system_tokens_too(monkeypatch):
    """attach swaps vLLM's n-gram speculator's class; its drafts read the model state's slot tokens in front
    of each row's own tokens (against the plain search over the whole lists)."""
    from vllm.v1.worker.gpu.spec_decode.ngram.speculator import NgramGPUSpeculator

    from vllm_relay.ops.ngram import ngram_drafts_reference

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    g = torch.Generator().manual_seed(3)
    R, W, K, L = 5, 64, 3, 128
    req = NS(all_token_ids=NS(gpu=torch.randint(0, 3, (R, W), generator=g, dtype=torch.int32)),
             total_len=NS(gpu=torch.tensor([9, 0, 30, 17, 5], dtype=torch.int32)))
    spec = object.__new__(NgramGPUSpeculator)  # (vLLM's __init__ asks for Triton on a GPU)
    spec.__dict__.update(req_states=req, num_speculative_steps=K, min_n=1, max_n=3, max_model_len=L,
                         block_l=32, scratch=torch.zeros(R, 4, dtype=torch.int64),
                         drafts=torch.zeros(R, K, dtype=torch.int64))
    state = NS(row_shift=None, slot_tokens=None, row_slot=None)

    def attach_drafter(tokens=False):
        state.row_shift = torch.tensor([32, 0, 16, 0, 0], dtype=torch.int64)
        if tokens:
            state.slot_tokens = torch.randint(0, 3, (2, 32), generator=g, dtype=torch.int32)
            state.row_slot = torch.tensor([1, -1, 0, 1, 0], dtype=torch.int32)

    state.attach_drafter = attach_drafter
    runner = NS(speculator=spec, model_state=state)
    assert drafter.attach(runner)
    assert type(spec) is drafter.RelayNgramSpeculator and spec.relay_state is state
    idx = torch.tensor([2, 0, 4, 1])  # batch rows -> request states (rows 0..3 of row_slot / row_shift)
    num_sampled = torch.tensor([1, 1, 0, 1], dtype=torch.int32)
    last = torch.tensor([7, 8, 9, 10, 11], dtype=torch.int64)
    got = spec.propose(NS(num_reqs=4, idx_mapping=idx), None, None, None, None, num_sampled, None, last, None,
                       None, None)
    want = []
    for b, r in enumerate(idx.tolist()):
        shift = int(state.row_shift[b])
        whole = state.slot_tokens[int(state.row_slot[b]), :shift].tolist() if shift else []
        whole += req.all_token_ids.gpu[r, : int(req.total_len.gpu[r])].tolist()
        want.append(ngram_drafts_reference(whole, int(num_sampled[b]), int(last[r]), 1, 3, K))
    assert got.tolist() == want
    dummy = spec.propose(NS(num_reqs=2, idx_mapping=idx), None, None, None, None, num_sampled, None, last,
                         None, None, None, dummy_run=True)
    assert dummy.data_ptr() == spec.drafts.data_ptr() and dummy.shape == (2, K)  # (no search for a dummy run)
