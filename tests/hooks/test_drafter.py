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
