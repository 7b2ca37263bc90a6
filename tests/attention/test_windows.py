"""A window layer's level rows (attention/windows.py): staged once per plan, their first visible keys made
from the step's KV lengths each step; a group whose tables differ from the levels' stages nothing; a window
planner's plans exact against attention within the window."""

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from tests.attention.test_planner import (
    BLOCK,
    SLOT_PAGES,
    World,
    make_planner,
    random_batch,
    run_and_check,
    vllm_config,
)
from vllm_relay.attention import levels as levels_module
from vllm_relay.attention import step as relay_step
from vllm_relay.attention.planner import RelayPlanner
from vllm_relay.attention.windows import WindowRows
from vllm_relay.config import RelayConfig
from vllm_relay.ops.level_tree import LevelRule, find_levels, level_rows
from vllm_relay.ops.window_level_torch import window_level_attention_torch

PS = 4


def test_keys_follow_the_kv_lengths_of_each_step_and_clear_reads_request_0():
    table = np.array([[5, 6, 7, 8], [5, 6, 7, 9]], dtype=np.int32)
    tree = find_levels(table, np.array([3, 3]), np.array([-1, -1]), np.zeros(0, np.int32), LevelRule())
    query_start = np.array([0, 1, 2], dtype=np.int32)
    perm, cu, _ = level_rows(tree, query_start[:-1], 2)
    step = SimpleNamespace(req_shift=np.zeros(2, np.int32), level_group=1, tables=[table, table],
                           seq_lens=np.array([15, 13], np.int32))
    rows = WindowRows(6, PS, 8, torch.device("cpu"))
    assert rows.stage(step, tree, perm, cu, query_start, kv_group=0).tolist() == [1]  # the row furthest behind
    # the level (12 keys) seen from keys 9 and 7: 3 + 5 read per row, 5 read once: 3 saved
    assert rows.saved == 3
    order = perm.tolist()  # the level's rows: request of each
    # a decode token at own position seq_len - 1 sees keys from seq_len - 6 on (the level starts at 0)
    assert rows.keys(torch.tensor([15, 13], dtype=torch.int32), 4)[:2].tolist() == [[9, 7][r] for r in order]
    assert rows.keys(torch.tensor([16, 14], dtype=torch.int32), 2).tolist() == [[10, 8][r] for r in order]  # the next step
    assert rows.keys(torch.tensor([16, 14], dtype=torch.int32), 4)[2:].tolist() == [16, 16]  # past the rows: request 0, offset 0
    rows.clear()
    assert rows.keys(torch.tensor([16, 14], dtype=torch.int32), 2).tolist() == [16, 16]
    other = table.copy()
    other[0, 2] = 40  # inside request 0's window: its ids differ from the level's
    step.tables = [other, table]
    assert rows.stage(step, tree, perm, cu, query_start, kv_group=0) is None


@pytest.mark.parametrize("window", [5, 40, 130])
@pytest.mark.parametrize("seed", range(3))
def test_window_layers_read_each_level_from_each_rows_window_on(window, seed, monkeypatch):
    """A planner of sliding-window layers reads the step's levels (found in another group's tables) from
    each level row's first visible key on: exact against attention over [slot prompt ; own KV] within the
    window, on random batches (windows shorter than a page, inside a prompt, past most levels). Its group's
    table is checked against the levels' (`window_level_rows`): where a row's block ids inside its window
    differ from the level's, the group reads no level in the step, exactly still."""
    monkeypatch.setitem(levels_module.MIN_SAVED_TOKENS, ("cpu", True), 64)
    rng = np.random.default_rng(seed)
    world = World(random_batch(rng, int(rng.integers(4, 14))), torch.float32, "cpu", seed)
    world.pages = relay_step.SlotPages.for_config(RelayConfig(max_prompts=3, max_prompt_tokens=128), BLOCK,
                                                  num_groups=2)
    for group in (0, 1):  # both groups' pages: the same cache in this world
        for slot, n in enumerate(SLOT_PAGES):
            world.pages.record(group, slot, world.slot_table[slot, :n].tolist())
    step = world.step()
    step.tables = [step.block_table, step.block_table]
    make_planner(shared_path="always").levels_for(step)  # the level group's planner (group 0)
    planner = RelayPlanner(vllm_config(shared_path="always"), SimpleNamespace(block_size=BLOCK), "cpu",
                           window=window, level_fn=window_level_attention_torch)
    planner.kv_group = 1
    cm = world.cm()
    plan = planner.plan(cm, step)
    run_and_check(world, plan, cm, window=window)
    if step.tree is not None:
        assert plan.run_level and planner.stats["level_groups"] == step.tree.num_groups
        assert plan.level.call["max_seqlen_k"] <= window  # (the most keys a row reads: the kernel's ranges)
        # With full graphs an eager step bounds the keys as a graph does (its kernel variant compiled at the
        # capture), exactly still.
        graphs = RelayPlanner(vllm_config(shared_path="always", full_graphs=True),
                              SimpleNamespace(block_size=BLOCK), "cpu", window=window,
                              level_fn=window_level_attention_torch)
        graphs.kv_group = 1
        graph_plan = graphs.plan(cm, step)
        assert not graph_plan.graph
        graph_len = graphs.level_table.shape[1] * BLOCK
        assert graph_plan.level.call["max_seqlen_k"] == min(graph_len, window)
        run_and_check(world, graph_plan, cm, window=window)
    own = [r for r in range(step.tree.num_groups) if step.tree.pages[r]] if step.tree is not None else []
    if own:  # a block id inside the window of a row of a level of own pages, changed in group 1's table
        g = own[0]
        members = np.flatnonzero((step.tree.row_groups == g).any(axis=1))
        other = step.tables[1].copy()
        r, start = members[-1], step.tree.start[g]
        other[r, start: start + step.tree.pages[g]] += 1000  # one member's ids of the level's own pages
        step.tables = [step.block_table, other]
        planner = RelayPlanner(vllm_config(shared_path="always"), SimpleNamespace(block_size=BLOCK), "cpu",
                               window=10_000, level_fn=window_level_attention_torch)  # every page compared
        planner.kv_group = 1
        plan = planner.plan(cm, step)
        assert len(members) >= 2 and not plan.run_level and planner.stats["level_groups"] == 0
        run_and_check(world, plan, cm, window=10_000)


def test_layers_that_read_no_level_read_their_groups_slot_pages_in_front():
    """A planner of layers that read no level (`levels=False`), in a KV-cache group of their own, takes
    no level of the step's tree (found in another group's table): every relay row reads its slot's
    pages in that planner's group (`kv_group`) in front of its own, exactly."""
    batch = [(0, 50, 1, -1, 0), (0, 60, 1, 0, 2), (-1, 70, 1, -1, 0), (-1, 80, 3, 2, 4), (1, 9, 9, -1, 0)]
    world = World(batch, torch.float32, "cpu", 6)
    world.pages = relay_step.SlotPages.for_config(RelayConfig(max_prompts=3, max_prompt_tokens=128), BLOCK,
                                                  num_groups=2)
    for slot, n in enumerate(SLOT_PAGES):  # group 0's pages stay 0: not this planner's
        world.pages.record(1, slot, world.slot_table[slot, :n].tolist())
    step = world.step()
    make_planner(shared_path="always").levels_for(step)  # the level group's planner (group 0)
    assert step.tree is not None and step.level_group == 0
    planner = RelayPlanner(vllm_config(shared_path="always"), SimpleNamespace(block_size=BLOCK), "cpu", levels=False)
    planner.kv_group = 1
    cm = world.cm()
    plan = planner.plan(cm, step)
    assert not plan.run_level
    run_and_check(world, plan, cm)
    assert planner.stats["level_groups"] == 0 and planner.stats["prefix_requests"] == 3


def test_a_window_planner_without_a_level_function_is_refused():
    """Each row's first key needs a level call that takes it; the backend's own varlen call does not."""
    with pytest.raises(ValueError, match="level_fn"):
        RelayPlanner(vllm_config(shared_path="always"), SimpleNamespace(block_size=BLOCK), "cpu", window=64)
