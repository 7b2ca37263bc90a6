"""The planner's joint call (ops/joint.py): a decode step's levels and its tokens' own pages in one
FlashAttention call. Checked as tests/attention/test_planner.py checks every plan: run by
`relay_attention` over a paged cache, against dense fp32 attention over [system K/V ; own K/V]."""

import numpy as np
import pytest
import torch

from tests.attention.test_planner import (
    GROUP,
    TUNED,
    World,
    make_planner,
    padded,
    random_batch,
    run_and_check,
)
from vllm_relay.attention import levels as levels_module
from vllm_relay.attention.rules import joint_tokens
from vllm_relay.ops.joint import joint_capacity


def decode_only(batch):
    """The same requests, each decoding one token (its own KV unchanged)."""
    return [(slot, own, 1, parent, pages) for slot, own, _, parent, pages in batch]


@pytest.mark.parametrize("shared_path", ["auto", "always"])
@pytest.mark.parametrize("seed", range(5))
def test_joint_decode_steps_are_exact_at_any_depth(shared_path, seed, monkeypatch):
    """Random decode steps (system prompts, and plain rows sharing runs of pages at several depths):
    the levels and the contexts in one call, exact; a step with a prompt chunk keeps two calls."""
    monkeypatch.setitem(levels_module.MIN_SAVED_TOKENS, ("cpu", True), 64)
    rng = np.random.default_rng(seed)
    batch = random_batch(rng, int(rng.integers(2, 14)))
    world = World(decode_only(batch), torch.float32, "cpu", seed)
    world.record_fills()
    planner = make_planner(shared_path=shared_path)
    cm = world.cm()
    plan = planner.plan(cm, world.step())
    run_and_check(world, plan, cm)
    if plan is not None and plan.run_level:
        assert plan.joint and plan.level.ctx_start is not None and planner.stats["joint_steps"] == 1
        assert int(plan.level.ctx_start[0]) == planner.stats["shared_tokens"]  # the tokens' rows follow the levels'
    mixed = World(batch, torch.float32, "cpu", seed)
    mixed.record_fills()
    planner = make_planner(shared_path=shared_path)
    cm = mixed.cm()
    plan = planner.plan(cm, mixed.step())
    run_and_check(mixed, plan, cm)
    if any(q > 1 for _, _, q, _, _ in batch):
        assert plan is None or not plan.joint


def test_joint_graph_is_sized_by_its_tokens(monkeypatch):
    """A full graph of T decode tokens holds a joint call of fixed shape (its level sequences for as
    many rows and levels as T tokens can form, then T tokens); a later step with levels writes the
    same tensors (the graph replays them) and is exact, and so is the capture's run, with no levels."""
    batch = [(0, 30, 1, -1, 0), (0, 45, 1, -1, 0), (1, 7, 1, -1, 0), (-1, 100, 1, -1, 0), (-1, 90, 1, 3, 5)]
    world = World(batch, torch.float32, "cpu", 5)
    world.record_fills()
    planner = make_planner(shared_path="always", full_graphs=True)
    cm = world.cm(pad_reqs=3, pad_tokens=3)
    T = cm.num_actual_tokens
    captured = planner.plan(cm, None, capture=True, levels=True)
    assert captured.joint and captured.graph and captured.run_level
    rows, groups = planner.graph_capacity(T)
    per = joint_tokens(T, GROUP)
    seqs = joint_capacity(rows, groups, per)
    call = captured.level.call
    assert call["max_seqlen_q"] == per and call["cu_seqlens_q"].shape[0] == seqs + T + 1
    assert call["seqused_k"].shape[0] == call["block_table"].shape[0] == seqs + T
    assert captured.level.perm.shape[0] == captured.level.q_buf.shape[0] == rows + T
    step = world.step()
    planner.levels_for(step)
    step.graph_levels = True
    plan = planner.plan(cm, step)
    assert plan.joint and plan.graph and planner.stats["joint_steps"] == 1

    def reads(p):
        lv = p.level
        return [lv.perm, lv.row_index, lv.q_buf, lv.out_buf, lv.ctx_start,  # (num_rows: CUDA only)
                *(lv.call[k] for k in ("cu_seqlens_q", "seqused_k", "block_table"))]

    for a, b in zip(reads(captured), reads(plan)):
        assert a.data_ptr() == b.data_ptr() and a.shape == b.shape
    assert plan.level.call["max_seqlen_q"] == per and plan.level.call["max_seqlen_k"] == call["max_seqlen_k"]
    run_and_check(world, plan, cm, padded(world.q, cm))
    plain = World([(-1, 30, 1, -1, 0), (-1, 45, 1, -1, 0)], torch.float32, "cpu", 6)  # no level
    cm = plain.cm(pad_reqs=6, pad_tokens=6)
    captured = planner.plan(cm, None, capture=True, levels=True)  # the capture's own run: no level rows, every token its own row
    assert captured.joint and int(captured.level.ctx_start[0]) == 0
    run_and_check(plain, captured, cm, padded(plain.q, cm))


def test_joint_knob_off_keeps_two_calls(monkeypatch):
    """joint=False: the levels as their own call beside the context call, the same output."""
    monkeypatch.setitem(TUNED, "joint", False)
    batch = [(0, 30, 1, -1, 0), (0, 45, 1, -1, 0), (-1, 100, 1, -1, 0), (-1, 90, 1, 2, 5)]
    world = World(batch, torch.float32, "cpu", 7)
    world.record_fills()
    planner = make_planner(shared_path="always")
    cm = world.cm()
    plan = planner.plan(cm, world.step())
    assert plan.run_level and not plan.joint and plan.level.ctx_start is None and not planner.joint
    run_and_check(world, plan, cm)


def test_a_graph_step_that_cannot_be_joint_is_refused():
    """A levels' graph holds the joint call: a step vLLM would replay it for with tokens not one per
    request (padding of tokens without requests) is an error, not a plan the graph would misread."""
    batch = [(0, 30, 1, -1, 0), (0, 45, 1, -1, 0)]
    world = World(batch, torch.float32, "cpu", 8)
    world.record_fills()
    planner = make_planner(shared_path="always", full_graphs=True)
    cm = world.cm(pad_reqs=1, pad_tokens=3)  # 3 requests, 5 tokens
    step = world.step()
    planner.levels_for(step)
    step.graph_levels = True
    with pytest.raises(RuntimeError, match="one token per request"):
        planner.plan(cm, step)


@pytest.mark.parametrize("form", ["joint", "levels-call", "verification"])
@pytest.mark.parametrize("num_sms", [1, 16, 40, 132])
@pytest.mark.parametrize("seed", range(4))
def test_the_unsplit_graph_is_asked_for_exactly_when_the_plan_unsplits(num_sms, seed, form, monkeypatch):
    """`runs_unsplit`, asked before vLLM picks a step's graph (hooks/graphs.py), agrees with the
    one split the plan of that graph step then makes, on random decode steps with levels: the joint
    call's rule, and the levels' own call's (a planner without the joint call, as sinks make it; drafts
    of 2 verified, 3 tokens a request)."""
    rng = np.random.default_rng(seed)
    u = 3 if form == "verification" else 1
    batch = [(slot, max(own, u), u, parent, pages)
             for slot, own, _, parent, pages in random_batch(rng, int(rng.integers(2, 14)))]
    world = World(batch, torch.float32, "cpu", seed)
    world.record_fills()
    monkeypatch.setitem(TUNED, "joint", form == "joint")
    planner = make_planner(shared_path="always", full_graphs=True)
    planner.num_sms = num_sms
    pad = int(rng.integers(0, 3))
    cm = world.cm(pad_reqs=pad, pad_tokens=pad * u)
    step = world.step()
    planner.levels_for(step)
    if step.tree is None:
        pytest.skip("no levels in this batch")
    step.graph_levels = True
    asked = planner.runs_unsplit(step.tree, cm.num_actual_tokens, u)
    plan = planner.plan(cm, step, graph=True)
    assert plan.joint == (form == "joint") and plan.graph and plan.one_split == asked
    run_and_check(world, plan, cm, padded(world.q, cm))
