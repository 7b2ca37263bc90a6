"""hooks/runner.py's `DraftPositions`: a drafter pass after the first gets its slots from each row's own
position and its model positions shifted; rows moved past the model's length are padded as vLLM pads
them; the drafter's relay planners get the pass's step. vLLM's own update is stood in for by the same
arithmetic (its kernel: the position plus one, clamped to 0 past `max_model_len`, the slot from the
block table, the sequence length plus one or 1), on fresh random inputs. `NgramLookup`: vLLM's n-gram
drafter's drafts for relay rows (own tokens, the system prompt's kept from its fill) equal those of
another `NgramProposer` of vLLM's over the whole token lists."""

import random
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from vllm.v1.spec_decode.llm_base_proposer import PADDING_SLOT_ID

from vllm_relay.attention import workers
from vllm_relay.hooks.runner import DraftPositions, NgramLookup

BS, MAX_LEN = 16, 96


def vllm_update(drafter, table):
    """vLLM's `_update_positions_dependent_metadata` on `drafter`'s buffers, in torch."""

    def update(positions, cm, batch_size, input_batch_size, block_size):
        p = (positions[0] if drafter.uses_mrope else positions) + 1
        past = p >= MAX_LEN
        p = torch.where(past, 0, p)
        out = drafter.mrope_positions[0, :batch_size] if drafter.uses_mrope else drafter.positions[:batch_size]
        out.copy_(p)
        block = table[torch.arange(batch_size), torch.clamp(p // block_size, max=table.shape[1] - 1)]
        drafter.slots[:batch_size] = torch.where(past, PADDING_SLOT_ID, block * block_size + p % block_size)
        cm.seq_lens.copy_(torch.where(past, 1, cm.seq_lens + 1))
        cm.slot_mapping = drafter.slots[:batch_size]
        if drafter.uses_mrope:
            drafter.mrope_positions[1:, :batch_size] = drafter.mrope_positions[0, :batch_size]
            return drafter.mrope_positions[:, :batch_size]
        return drafter.positions[:batch_size]

    return update


@pytest.mark.parametrize("mrope", [False, True])
@pytest.mark.parametrize("seed", [0, 1])
def test_later_draft_passes_place_kv_by_own_positions(monkeypatch, mrope, seed):
    rng = random.Random(seed)
    b = 7
    shift = np.array([rng.choice([0, 32, 48]) for _ in range(b)], dtype=np.int32)
    own = np.array([rng.randrange(0, MAX_LEN - 1 - s) for s in shift])
    own[0], shift[0] = MAX_LEN - 33, 32  # its next shifted position is the model's length: padded
    table = torch.randint(1, 500, (b, MAX_LEN // BS), dtype=torch.int64)
    drafter = SimpleNamespace(uses_mrope=mrope, max_model_len=MAX_LEN, num_speculative_tokens=3,
                              positions=torch.zeros(b, dtype=torch.int64), slots=torch.zeros(b, dtype=torch.int64),
                              mrope_positions=torch.zeros(3, b, dtype=torch.int64))
    drafter._update_positions_dependent_metadata = vllm_update(drafter, table)
    rows = SimpleNamespace(ids=[f"r{i}" for i in range(b)], req_shift=shift,
                           req_slot=np.where(shift > 0, 1, -1).astype(np.int32))
    runner = SimpleNamespace(drafter=drafter, _relay_rows=rows, _relay=("pages", True))
    planner = SimpleNamespace(current=None)
    monkeypatch.setattr(workers, "drafter_planners", lambda r: [planner] if r is runner else [])
    DraftPositions.attach(runner)
    assert isinstance(drafter._update_positions_dependent_metadata, DraftPositions)

    shifted = torch.from_numpy(own + shift)
    positions = torch.stack([shifted] * 3) if mrope else shifted.clone()
    cm = SimpleNamespace(seq_lens=torch.from_numpy(own + 1).to(torch.int32), slot_mapping=None)
    out = drafter._update_positions_dependent_metadata(positions, cm, b, b, BS)

    nxt = own + 1
    past = nxt + shift >= MAX_LEN
    want_pos = np.where(past, 0, nxt + shift)
    want_slot = np.where(past, PADDING_SLOT_ID, table[np.arange(b), nxt // BS].numpy() * BS + nxt % BS)
    got = out if not mrope else out[0]
    assert got.tolist() == want_pos.tolist() and past[0] and not past[1:].all()
    if mrope:
        assert (out[1] == out[0]).all() and (out[2] == out[0]).all()
    assert cm.slot_mapping.tolist() == want_slot.tolist()
    assert cm.seq_lens.tolist() == np.where(past, 1, own + 2).tolist()
    assert positions[0 if mrope else slice(None)].tolist() == (own + shift).tolist()  # the caller's, untouched
    step = planner.current
    assert (step.num_reqs, step.num_tokens, step.level_group, step.pages) == (b, b, -1, "pages")
    assert step.q_lens.tolist() == [1] * b and step.req_shift.tolist() == shift.tolist()


def test_one_draft_token_needs_no_stand_in():
    drafter = SimpleNamespace(num_speculative_tokens=1, _update_positions_dependent_metadata=lambda *a: None)
    before = drafter._update_positions_dependent_metadata
    DraftPositions.attach(SimpleNamespace(drafter=drafter))
    assert drafter._update_positions_dependent_metadata is before


def ngram_proposer(k: int, max_model_len: int):
    from vllm.v1.spec_decode.ngram_proposer import NgramProposer

    config = SimpleNamespace(
        speculative_config=SimpleNamespace(prompt_lookup_min=1, prompt_lookup_max=3,
                                           num_speculative_tokens=k),
        model_config=SimpleNamespace(max_model_len=max_model_len),
        scheduler_config=SimpleNamespace(max_num_seqs=1024),
        parallel_config=SimpleNamespace(tensor_parallel_size=1))
    return NgramProposer(config)


def test_ngram_drafts_read_the_system_tokens_in_front_of_the_own():
    rng = np.random.default_rng(11)
    k, L, B = 3, MAX_LEN, 6
    system = [rng.integers(0, 5, 32).tolist(), rng.integers(0, 5, 48).tolist()]  # two slots' prompts
    lookahead = [9, 9]
    # Row 0 a fill of slot 1 (its prompt: the system tokens and its lookahead); rows 1-5 relay requests of
    # either slot, or requests with no registered prompt (slot -1), one with nothing sampled.
    req_slot = np.array([-1, 0, 1, -1, 1, 0], dtype=np.int32)
    req_shift = np.array([0, 32, 48, 0, 48, 32], dtype=np.int32)
    own = [system[1] + lookahead] + [rng.integers(0, 5, n).tolist() for n in (7, 20, 30, 1, 12)]
    ids = [f"r{i}" for i in range(B)]
    runner = SimpleNamespace(cache_config=SimpleNamespace(block_size=BS), drafter=ngram_proposer(k, L),
                             requests={ids[0]: SimpleNamespace(prompt_token_ids=own[0]),
                                       "f0": SimpleNamespace(prompt_token_ids=system[0] + lookahead)})
    NgramLookup.attach(runner, SimpleNamespace(max_prompts=2, max_prompt_tokens=64))
    lookup = runner.drafter.propose
    assert isinstance(lookup, NgramLookup) and lookup.slot_tokens.shape == (2, 64)
    runner._relay_rows = SimpleNamespace(ids=ids, req_slot=req_slot, req_shift=req_shift, fills=[(0, 1, 3)])
    lookup.note_fills(runner._relay_rows)
    lookup.note_fills(SimpleNamespace(ids=["f0"], fills=[(0, 0, 2)]))  # slot 0's fill, an earlier step
    token_ids = np.zeros((8, L), dtype=np.int32)
    for i, t in enumerate(own):
        token_ids[i, : len(t)] = t
    num_tokens = np.array([len(t) for t in own] + [0, 0], dtype=np.int32)
    sampled = [[int(t[-1])] for t in own]
    sampled[4] = []
    got = lookup(k, sampled, num_tokens, token_ids)

    whole = [(system[req_slot[i]] if req_shift[i] else []) + own[i] for i in range(B)]
    full = np.zeros_like(token_ids)
    for i, t in enumerate(whole):
        full[i, : len(t)] = t
    lens = np.array([len(t) for t in whole] + [0, 0], dtype=np.int32)
    want = ngram_proposer(k, L).propose(k, sampled, lens, full)
    assert got == want and any(got) and not got[4]
    alone = ngram_proposer(k, L).propose(k, sampled, num_tokens, token_ids)
    assert got != alone  # (the case is one where the system tokens change some drafts)
    runner._relay_rows = SimpleNamespace(ids=ids, req_slot=req_slot, req_shift=req_shift * 0, fills=[])
    assert lookup(k, sampled, num_tokens, token_ids) == alone  # no relay row: vLLM's call as it came
