"""The runner hook's per-step facts (`step.prepare`) on a stand-in of vLLM's V1 model runner: each
request's slot and shift, positions shifted, fills' pages recorded, and the batch's facts kept only
while the batch holds the same request ids in the same rows."""

from types import SimpleNamespace

import numpy as np
import pytest
import torch
from vllm.v1.utils import CpuGpuBuffer

from vllm_relay import protocol
from vllm_relay.attention import step as relay_step

PAGE = 16


def state(slot=-1, system_len=0, fill=False, block_ids=()):
    extra = None if slot < 0 else protocol.tag(None, protocol.RelayTag(slot, system_len, fill))
    return SimpleNamespace(sampling_params=SimpleNamespace(extra_args=extra), block_ids=(list(block_ids),))


def runner(states: dict, order: list, table_width=8):
    table = np.arange(len(order) * table_width, dtype=np.int32).reshape(len(order), table_width)
    batch = SimpleNamespace(num_reqs=len(order), req_ids=list(order),
                            num_computed_tokens_cpu=np.full(len(order), 20),
                            block_table=SimpleNamespace(block_tables=[SimpleNamespace(
                                block_table=SimpleNamespace(np=table))]))
    return SimpleNamespace(
        input_batch=batch, requests=states, max_num_tokens=64, positions=torch.zeros(64, dtype=torch.int64),
        _make_buffer=lambda *size, dtype: CpuGpuBuffer(*size, dtype=dtype, device="cpu", pin_memory=False))


def facts(r, counts, pages):
    r.positions.zero_()
    step = relay_step.prepare(r, np.asarray(counts), pages, PAGE)
    assert step.pages is pages  # the step carries the preparer's slot pages to the planners
    return step


def test_prepare_records_slots_shifts_positions_and_fill_pages():
    pages = relay_step.SlotPages(num_slots=3, max_pages=4)
    states = {"a": state(0, 32), "b": state(), "c": state(2, 48),
              "f": state(1, 32, fill=True, block_ids=[7, 8, 9])}
    r = runner(states, ["a", "b", "f", "c"])
    step = facts(r, [1, 2, 3, 1], pages)
    assert step.req_slot.tolist() == [0, -1, -1, 2]  # the fill computes its prompt as an ordinary request
    assert step.req_shift.tolist() == [32, 0, 0, 48]
    assert step.q_lens.tolist() == [1, 2, 3, 1] and step.num_tokens == 7
    assert r.positions[:7].tolist() == [32, 0, 0, 0, 0, 0, 48]
    assert step.seq_lens.tolist() == [21, 22, 23, 21]
    assert pages.pages[0, 1, :2].tolist() == [7, 8]  # the fill's whole system pages
    with pytest.raises(ValueError):
        step.req_slot[0] = 5  # shared by the steps that reuse it: read-only


def test_batch_facts_follow_the_rows_request_ids():
    pages = relay_step.SlotPages(num_slots=3, max_pages=4)
    states = {"a": state(0, 32), "b": state(), "f": state(1, 48, fill=True, block_ids=[7])}
    r = runner(states, ["a", "b", "f"])
    first = facts(r, [1, 1, 1], pages)
    again = facts(r, [1, 1, 1], pages)
    assert again.req_slot is first.req_slot  # the same ids in the same rows: nothing re-read
    states["f"].block_ids[0][:] = [7, 8, 9]  # the fill's blocks grow: recorded on every step
    facts(r, [1, 1, 1], pages)
    assert pages.pages[0, 1, :3].tolist() == [7, 8, 9]

    r.input_batch.req_ids[:2] = ["b", "a"]  # rows swapped
    swapped = facts(r, [1, 1, 1], pages)
    assert swapped.req_slot.tolist() == [-1, 0, -1] and swapped.req_shift.tolist() == [0, 32, 0]

    states["n"] = state(2, 64)  # a new request in a finished one's row
    r.input_batch.req_ids[1] = "n"
    replaced = facts(r, [1, 1, 1], pages)
    assert replaced.req_slot.tolist() == [-1, 2, -1] and replaced.req_shift.tolist() == [0, 64, 0]

    r.input_batch.num_reqs = 2  # the last request finished
    fewer = facts(r, [1, 1], pages)
    assert fewer.req_slot.tolist() == [-1, 2] and fewer.num_reqs == 2


def test_two_kv_cache_groups_record_a_fills_pages_in_each_and_the_level_groups_table():
    """Sliding-window and full-attention layers in two KV-cache groups: a fill's pages are recorded
    in both, and the step carries the host block table of the group whose planner finds the levels."""
    pages = relay_step.SlotPages(num_slots=3, max_pages=4, num_groups=2)
    states = {"a": state(0, 32), "f": state(1, 32, fill=True)}
    states["f"].block_ids = ([7, 8, 9], [17, 18, 19])
    r = runner(states, ["a", "f"])
    full = np.arange(16, dtype=np.int32).reshape(2, 8) + 100
    r.input_batch.block_table.block_tables.append(SimpleNamespace(block_table=SimpleNamespace(np=full)))
    step = relay_step.prepare(r, np.asarray([1, 3]), pages, PAGE, level_group=1)
    assert step.level_group == 1 and step.block_table is full
    assert pages.pages[:, 1, :2].tolist() == [[7, 8], [17, 18]]
    assert relay_step.prepare(r, np.asarray([1, 3]), pages, PAGE, level_group=-1).block_table is None


def test_m_rope_positions_get_the_same_shift_in_every_section():
    """An M-RoPE model on the V1 runner: the model reads `mrope_positions`, each section shifted as the
    plain positions (a routed request is text: (p, p, p))."""
    pages = relay_step.SlotPages(num_slots=3, max_pages=4)
    r = runner({"a": state(0, 32), "b": state()}, ["a", "b"])
    r.uses_mrope, r.mrope_positions = True, SimpleNamespace(gpu=torch.tensor([[4, 5, 0, 1, 0]] * 3))
    facts(r, [2, 2], pages)
    assert r.mrope_positions.gpu.tolist() == [[36, 37, 0, 1, 0]] * 3
