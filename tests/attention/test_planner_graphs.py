"""The relay planner in full CUDA graphs: what a graph step plans (vLLM's own graph, the levels' twin,
a graph of any batch under `cudagraph_mode=FULL`), how many levels a graph holds and when they run
unsplit, and, on CUDA, a graph captured once replaying later plans exactly. The batches, caches and
references are tests/attention/test_planner.py's."""

import numpy as np
import pytest
import torch

import tests.attention.test_planner as base
from tests.attention.test_planner import (
    MAX_MODEL_LEN,
    MAX_REQS,
    TUNED,
    D,
    World,
    as_relay_plan,
    make_planner,
    padded,
    run_and_check,
)
from vllm_relay.attention import levels as levels_module
from vllm_relay.attention import step as relay_step
from vllm_relay.ops import relay_attention


def test_padded_graph_step_with_no_relay_request_still_writes_a_valid_plan(monkeypatch):
    """A full-graph decode step of plain requests (relay on, nothing shared) replays vLLM's own graph,
    which reads the context tables the plan writes: they equal vLLM's. The levels' graph captured
    for the same size holds the levels, empty here, and harmless (here its levels as their own call,
    joint=False; the joint form: test_joint_graph_is_sized_by_its_tokens)."""
    monkeypatch.setitem(TUNED, "joint", False)
    batch = [(-1, 30, 1, -1, 0), (-1, 7, 1, -1, 0), (-1, 100, 1, -1, 0)]
    world = World(batch, torch.float32, "cpu", 0)
    planner = make_planner(shared_path="always", full_graphs=True)
    cm = world.cm(pad_reqs=5, pad_tokens=5)
    captured = planner.plan(cm, None, capture=True, levels=True)
    assert captured.graph and captured.run_level
    assert captured.level.row_index.shape == (planner.max_depth, 8)  # fixed by the padded size
    assert captured.level.call["max_seqlen_q"] == 8
    # Sized for 8 decode tokens (each in up to max_depth levels of 2 rows or more, plus the slots'),
    # not for the largest graph: FlashAttention-3 runs a batch padded with empty groups slower.
    rows, groups = planner.graph_capacity(8)
    assert (rows, groups) == (8 * planner.max_depth, planner.num_slots + 8 * planner.max_depth // 2)
    assert groups < planner.max_groups and rows < planner.max_rows
    assert captured.level.perm.shape[0] == rows and captured.level.call["cu_seqlens_q"].shape[0] == groups + 1
    step = world.step()
    planner.levels_for(step)
    assert step.tree is None  # nothing shared: vLLM runs its own graph
    step.graph_levels = False
    plan = planner.plan(cm, step)
    assert plan is not None and not plan.graph and not plan.run_level
    assert torch.equal(plan.context.seq_lens, cm.seq_lens) and torch.equal(plan.context.block_table_tensor,
                                                                           cm.block_table_tensor)
    assert (captured.level.row_index == -1).all() and int(captured.level.call["cu_seqlens_q"][-1]) == 0
    run_and_check(world, plan, cm, padded(world.q, cm))
    run_and_check(world, captured, cm, padded(world.q, cm))  # the levels' graph, replayed empty


@pytest.mark.parametrize("seed", range(6))
def test_every_tree_fits_the_capacity_of_its_graph(seed):
    """A graph of T decode tokens holds fewer levels than the largest graph: every tree its rows can
    form fits (random sharing at several depths, and rows by twos, with the planner's own rule)."""
    from tests.ops.test_level_tree import random_tables
    from vllm_relay.ops.level_tree import find_levels, level_rows

    rng = np.random.default_rng(seed)
    planner = make_planner(shared_path="always", full_graphs=True)
    for T in (1, 2, 5, 8, 16):
        table, n_own, shareable, root, root_pages = random_tables(rng, T, num_slots=planner.num_slots)
        rows, groups = planner.graph_capacity(T)
        pairs = np.repeat(np.arange(1, (T + 1) // 2 + 1, dtype=np.int32), 2)[:T]  # rows by twos, a level each
        worst = np.stack([pairs * 10 + k for k in range(4)], axis=1)
        for tbl, share in ((table, shareable), (worst, np.full(T, 4))):
            tree = find_levels(tbl, share, np.where(tbl is table, root, -1), root_pages, planner.rule())
            perm, _, _ = level_rows(tree, np.arange(T), T)
            assert tree.num_groups <= groups and perm.shape[0] <= rows


def test_a_graph_holds_at_most_its_levels_the_shallowest_first(monkeypatch):
    """A full graph's levels past the slots' are capped (FlashAttention-3 combines its splits over
    every group the graph holds): a decode step that a graph runs keeps the shallowest levels and
    reads the deeper ones in its context, exact; the same requests in an eager step keep them all."""
    monkeypatch.setitem(TUNED, "graph_levels", 1)
    # A document of 4 pages under rows 0-7, three pairs of them sharing 2 pages more; another pair
    # of requests sharing 6 pages: two levels at depth 0, three at depth 1.
    batch = [(-1, 120, 1, -1, 0), (-1, 110, 1, 0, 4), (-1, 111, 1, 1, 6), (-1, 112, 1, 0, 4), (-1, 113, 1, 3, 6),
             (-1, 114, 1, 0, 4), (-1, 115, 1, 5, 6), (-1, 116, 1, 0, 4), (-1, 130, 1, -1, 0), (-1, 131, 1, 8, 6)]
    world = World(batch, torch.float32, "cpu", 8)
    graph = make_planner(shared_path="always", full_graphs=True)
    assert graph.graph_capacity(len(batch))[1] == graph.num_slots + 1
    trees = {}
    for name, planner, cm in (("graph", graph, world.cm(pad_reqs=2, pad_tokens=2)),
                              ("eager", make_planner(shared_path="always"), world.cm())):
        step = world.step()
        planner.levels_for(step)
        trees[name] = step.tree
        step.graph_levels = True
        plan = planner.plan(cm, step)
        assert plan.run_level and plan.graph == (name == "graph")
        run_and_check(world, plan, cm, padded(world.q, cm))
    full, capped = trees["eager"], trees["graph"]
    assert sorted(full.depth.tolist()) == [0, 0, 1, 1, 1] and capped.num_groups == graph.num_slots + 1
    assert sorted(capped.depth.tolist()) == [0, 0, 1, 1]  # the shallowest kept


def test_graph_levels_run_unsplit_when_their_tiles_fill_the_gpu(monkeypatch):
    """The plan asks for one split (ops.force_one_split) in graph steps whose levels' query tiles fill
    ONE_SPLIT_FILL of the multiprocessors; never eagerly, never with one_split off; exact either way."""
    from vllm_relay.attention.rules import LEVEL_TILE_ROWS, ONE_SPLIT_FILL, graph_one_split

    assert graph_one_split(np.array([3 * LEVEL_TILE_ROWS]), 1, 32, 132)  # 96 tiles of 132 SMs
    assert not graph_one_split(np.array([2 * LEVEL_TILE_ROWS]), 1, 32, 132)  # 64
    assert graph_one_split(np.array([96]), 4, 8, 132) == (3 * 8 >= ONE_SPLIT_FILL * 132)  # GQA packs 4 heads
    assert graph_one_split(np.array([1, 1]), 1, 1, 3) and not graph_one_split(np.array([1]), 1, 1, 3)
    batch = [(0, 30, 1, -1, 0), (0, 40, 1, -1, 0), (-1, 100, 1, -1, 0), (-1, 90, 1, 2, 5)]
    world = World(batch, torch.float32, "cpu", 2)
    world.record_fills()
    monkeypatch.setitem(TUNED, "joint", False)  # a joint call splits as FA3 decides (backend.py)
    for one_split, sms, graph, expected in ((True, 1, True, True), (True, 1000, True, False), (True, 1, False, False),
                                            (False, 1, True, False)):
        monkeypatch.setitem(TUNED, "one_split", one_split)
        planner = make_planner(shared_path="always", full_graphs=graph)
        planner.num_sms = sms
        cm = world.cm(pad_reqs=2, pad_tokens=2) if graph else world.cm()
        step = world.step()
        planner.levels_for(step)
        step.graph_levels = True
        plan = planner.plan(cm, step)
        assert plan.run_level and plan.one_split == expected and planner.stats["one_split_steps"] == expected
        run_and_check(world, plan, cm, padded(world.q, cm))


def test_graph_steps_run_levels_only_in_the_levels_graph(monkeypatch):
    """With levels, vLLM replays the levels' twin (the dispatcher records it) and the plan fills it;
    had vLLM replayed its own graph, the same step reads everything in its context (the prefix
    path for the system prompt): exact either way."""
    monkeypatch.setitem(levels_module.MIN_SAVED_TOKENS, ("cpu", True), 1)
    batch = [(0, 30, 1, -1, 0), (1, 7, 1, -1, 0), (-1, 100, 1, -1, 0), (0, 3, 1, -1, 0), (-1, 90, 1, 2, 5)]
    world = World(batch, torch.float32, "cpu", 1)
    world.record_fills()
    planner = make_planner(full_graphs=True)
    cm = world.cm(pad_reqs=3, pad_tokens=3)
    step = world.step()
    planner.levels_for(step)
    assert step.tree is not None
    step.graph_levels = True
    plan = planner.plan(cm, step)
    assert plan.graph and plan.run_level
    # Slot 0's two decodes share its pages; the two plain ones 5 pages; slot 1's one reads its own.
    assert planner.stats["shared_tokens"] == 4 and planner.stats["prefix_requests"] == 1
    run_and_check(world, plan, cm, padded(world.q, cm))
    step.graph_levels = False
    plan = planner.plan(cm, step)
    assert not plan.graph and not plan.run_level and planner.stats["prefix_requests"] == 1 + 3
    run_and_check(world, plan, cm, padded(world.q, cm))
    eager = make_planner()
    assert eager.plan(world.cm(), None) is None  # plain attention, vLLM's own tables


def test_a_verification_step_in_its_levels_graph_reads_levels_in_two_calls(monkeypatch):
    """Drafts being verified: 4 tokens a request, a full graph of 5 requests and 20 tokens (one padding
    request). Its levels' twin is captured as such a step and holds the levels and the contexts as two
    calls (the joint call is for one token a request); the step replaying it writes the captured
    buffers, every token of a request reading its levels, and is exact."""
    monkeypatch.setitem(levels_module.MIN_SAVED_TOKENS, ("cpu", True), 1)
    batch = [(0, 30, 4, -1, 0), (0, 41, 4, -1, 0), (-1, 100, 4, -1, 0), (-1, 90, 4, 2, 5)]
    world = World(batch, torch.float32, "cpu", 3)
    world.record_fills()
    planner = make_planner(full_graphs=True)
    assert planner.joint
    cm = world.cm(pad_reqs=1, pad_tokens=4)
    captured = planner.plan(cm, None, capture=True, levels=True)
    assert captured.graph and captured.run_level and not captured.joint
    assert captured.level.row_index.shape == (planner.max_depth, 20)
    assert captured.level.call["max_seqlen_q"] == 20
    step = world.step()
    planner.levels_for(step)
    assert step.tree is not None
    step.graph_levels = True  # what the dispatcher records when vLLM replays the twin
    plan = planner.plan(cm, step, graph=True)  # as the backend's builder asks on Model Runner V2
    assert plan.graph and plan.run_level and not plan.joint
    assert plan.level.perm.data_ptr() == captured.level.perm.data_ptr()
    assert plan.level.call["cu_seqlens_q"].shape == captured.level.call["cu_seqlens_q"].shape
    assert plan.context.block_table_tensor.data_ptr() == captured.context.block_table_tensor.data_ptr()
    # Slot 0's eight tokens read its prompt once, rows 2 and 3's eight their 5 pages.
    assert planner.stats["shared_tokens"] == 16 and planner.stats["level_graph_steps"] == 1
    run_and_check(world, plan, cm, padded(world.q, cm))


def test_prompt_chunks_in_a_full_graph_of_any_batch_read_everything_in_their_context(monkeypatch):
    """Under `cudagraph_mode=FULL` a step with prompt chunks replays vLLM's graph of its size, captured
    with no levels for a batch of any query lengths (hooks/graphs.py): the plan writes the context
    tables that graph reads (registered prompts' pages in front), levels off for the step, and the
    padded step is exact."""
    monkeypatch.setitem(levels_module.MIN_SAVED_TOKENS, ("cpu", True), 1)
    batch = [(0, 40, 12, -1, 0), (0, 5, 1, -1, 0), (-1, 100, 1, -1, 0), (-1, 60, 20, 2, 3), (1, 9, 9, -1, 0)]
    world = World(batch, torch.float32, "cpu", 2)
    world.record_fills()
    planner = make_planner(full_graphs=True)
    T = sum(row[2] for row in batch)
    cm = world.cm(pad_reqs=MAX_REQS - len(batch), pad_tokens=64 - T)  # vLLM's graph of 64 tokens, 16 requests
    captured = planner.plan(cm, None, capture=True, levels=False)
    assert captured is not None and not captured.run_level
    step = world.step()
    planner.levels_for(step)
    assert step.tree is not None  # levels there are, but this graph holds none
    step.graph_levels = False
    plan = planner.plan(cm, step, graph=True)  # as the backend's builder asks for a step in a full graph
    assert not plan.graph and not plan.run_level
    assert plan.context.block_table_tensor.data_ptr() == captured.context.block_table_tensor.data_ptr()
    assert plan.context.seq_lens.data_ptr() == captured.context.seq_lens.data_ptr()
    run_and_check(world, plan, cm, padded(world.q, cm))


@pytest.mark.gpu
@pytest.mark.parametrize("q_len", [1, 3])
@pytest.mark.parametrize("level_splits", [8, 1])
@pytest.mark.parametrize("group", [1, 4])
def test_graph_replay_equals_eager_on_cuda(group, level_splits, q_len):
    """Capture relay attention once (as vLLM captures a decode graph: plan with no relay request),
    then for random decode batches (up to three levels per token)
    write each plan into the same buffers and replay: bit-identical to running the same plan
    eagerly, and close to the fp32 reference. The levels' FlashAttention call split (up to 8) and
    unsplit (one split: no split combine over the graph's padded level); decodes of one token a
    request (the joint call) and of three (drafts verified: two calls)."""
    pytest.importorskip("vllm")
    from vllm.vllm_flash_attn import flash_attn_varlen_func

    base.H_KV, base.GROUP = 8 // group, group  # the World's heads
    try:
        rng = np.random.default_rng(0)
        B = 12  # captured batch size (all decode)
        worlds = []
        for s, n in enumerate(rng.integers(1, B + 1, size=6)):
            batch = []
            for r in range(int(n)):
                parent = int(rng.integers(0, r)) if r and rng.random() < 0.7 else -1
                slot = batch[parent][0] if parent >= 0 else int(rng.integers(-1, 2))
                batch.append((slot, int(rng.integers(q_len, 300)), q_len, parent, int(rng.integers(1, 12))))
            worlds.append(World(batch, torch.bfloat16, "cuda", s))
        planner = make_planner("cuda", shared_path="always", dtype=torch.bfloat16, full_graphs=True)
        worlds[0].record_fills()  # every world's cache is built alike: same slot pages layout per world
        kw = {"fa_version": 3}
        # One static set of inputs the graph reads: q, caches and output of the largest world.
        k_cache = torch.zeros_like(max(worlds, key=lambda w: w.k_cache.shape[0]).k_cache)
        v_cache = torch.zeros_like(k_cache)
        q_static = torch.zeros(B * q_len, base.H_KV * base.GROUP, D, dtype=torch.bfloat16, device="cuda")
        out_static = torch.zeros_like(q_static)
        capture_world = worlds[0]
        pad = B - len(capture_world.batch)
        cm_static = capture_world.cm(pad_reqs=pad, pad_tokens=pad * q_len)
        plan = planner.plan(cm_static, None, capture=True, levels=True)  # the levels' twin of the graph
        relay_plan = as_relay_plan(plan, cm_static)
        relay_plan.context["num_splits"] = 8
        relay_plan.shared[0].call["num_splits"] = level_splits
        relay_plan.context["max_seqlen_k"] = MAX_MODEL_LEN  # as vLLM captures: upper bounds
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            relay_attention(q_static, k_cache, v_cache, relay_plan, out_static, D ** -0.5, flash_attn_varlen_func, kw)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            relay_attention(q_static, k_cache, v_cache, relay_plan, out_static, D ** -0.5, flash_attn_varlen_func, kw)
        for world in worlds[1:]:
            world.record_fills()
            n, tokens = len(world.batch), len(world.batch) * q_len
            k_cache.zero_()
            v_cache.zero_()
            k_cache[: world.k_cache.shape[0]] = world.k_cache
            v_cache[: world.v_cache.shape[0]] = world.v_cache
            q_static.zero_()
            q_static[:tokens] = world.q
            cm = world.cm(pad_reqs=B - n, pad_tokens=(B - n) * q_len)
            # The runner's persistent buffers: write this step's metadata into the captured ones.
            cm_static.query_start_loc.copy_(cm.query_start_loc)
            cm_static.seq_lens.copy_(cm.seq_lens)
            cm_static.block_table_tensor.copy_(cm.block_table_tensor)
            step = world.step()
            planner.levels_for(step)
            step.graph_levels = True  # what vLLM's dispatcher records when it replays the twin
            step_plan = planner.plan(cm_static, step, graph=True)
            assert step_plan.level.perm.data_ptr() == plan.level.perm.data_ptr()
            assert step_plan.joint == plan.joint == (q_len == 1)
            graph.replay()
            replayed = out_static[:tokens].clone()
            eager_out = torch.zeros_like(out_static)
            relay_attention(q_static, k_cache, v_cache, relay_plan, eager_out, D ** -0.5, flash_attn_varlen_func, kw)
            assert torch.equal(replayed, eager_out[:tokens])
            torch.testing.assert_close(replayed.float().cpu(), world.reference(), atol=1.6e-2, rtol=1.6e-2)
            # The next decode step over the same rows (the hook's same row facts): with its tree reused,
            # nothing is staged again, and the graph replays the same attention.
            staged = planner._staged
            again = relay_step.RelayStep(step.num_reqs, step.num_tokens, step.req_slot, step.req_shift, step.q_lens,
                                         step.block_table, step.seq_lens.copy())
            planner.levels_for(again)
            again.graph_levels = True
            planner.plan(cm_static, again, graph=True)
            if q_len == 1:  # (a step of several tokens a request is staged every time)
                assert (staged is not None and planner._staged is staged) == (again.tree is step.tree)
            out_static.zero_()
            graph.replay()
            assert torch.equal(out_static[:tokens], replayed)
        assert planner.stats["shared_tokens"] > 0
        # trees: tokens under two and three levels were replayed
        assert planner.stats["tokens_under_2_levels"] > 0 and planner.stats["tokens_under_3_levels"] > 0
    finally:
        base.H_KV, base.GROUP = 2, 4
