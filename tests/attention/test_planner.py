"""The relay planner, without a model runner: vLLM's CommonAttentionMetadata of random mixed batches
(padded as full CUDA graphs pad them), the step's relay facts, and the slot pages a fill recorded.
The plan, run by `relay_attention`, must equal dense attention over [system K/V ; own K/V] for every
request, on every path; on CUDA, a graph captured once must replay later plans exactly.
"""

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from tests.ops.reference import attention_ref, make_paged_cache
from vllm_relay.attention import step as relay_step
from vllm_relay.attention.planner import RelayPlanner
from vllm_relay.config import RelayConfig
from vllm_relay.ops import RelayPlan, relay_attention, varlen_attention_torch

BLOCK, H_KV, GROUP, D = 16, 2, 4, 64
MAX_MODEL_LEN, MAX_REQS, MAX_TOKENS, CAPTURE = 1024, 16, 256, 32
SLOT_PAGES = (5, 2)  # whole pages of slots 0 and 1 (80 and 32 tokens)


def vllm_config(shared_path="auto", dtype=torch.float32, full_graphs=False):
    mode = SimpleNamespace(has_full_cudagraphs=lambda: full_graphs)
    model = SimpleNamespace(get_num_attention_heads=lambda _p: H_KV * GROUP, get_num_kv_heads=lambda _p: H_KV, get_head_size=lambda: D,
                            dtype=dtype, max_model_len=MAX_MODEL_LEN)
    return SimpleNamespace(
        additional_config={"relay": {"max_prompts": 3, "max_prompt_tokens": 128, "shared_path": shared_path}},
        model_config=model, parallel_config=None,
        scheduler_config=SimpleNamespace(max_num_seqs=MAX_REQS, max_num_batched_tokens=MAX_TOKENS),
        compilation_config=SimpleNamespace(cudagraph_mode=mode, max_cudagraph_capture_size=CAPTURE),
    )


class World:
    """A paged cache holding two filled system prompts and the requests' own KV."""

    def __init__(self, batch, dtype, device, seed):
        g = torch.Generator().manual_seed(seed)
        self.batch = batch
        own = [(torch.randn(c, H_KV, D, generator=g), torch.randn(c, H_KV, D, generator=g)) for _, c, _ in batch]
        self.sys = [(torch.randn(n * BLOCK, H_KV, D, generator=g), torch.randn(n * BLOCK, H_KV, D, generator=g))
                    for n in SLOT_PAGES]
        seqs = own + self.sys
        k_cache, v_cache, table, lens = make_paged_cache([k for k, _ in seqs], [v for _, v in seqs], BLOCK, dtype)
        self.k_cache, self.v_cache = k_cache.to(device), v_cache.to(device)
        B = len(batch)
        self.slot_table = table[B:]
        width = -(-MAX_MODEL_LEN // BLOCK)
        self.block_table = torch.zeros(MAX_REQS, width, dtype=torch.int32)
        self.block_table[:B, : table.shape[1]] = table[:B]
        self.own_lens = lens[:B]
        self.q = torch.randn(sum(q for _, _, q in batch), H_KV * GROUP, D, generator=g).to(dtype).to(device)
        self.own, self.dtype, self.device = own, dtype, device

    def record_fills(self):
        cfg = RelayConfig(max_prompts=3, max_prompt_tokens=128)
        pages = relay_step.slot_pages_for(cfg, BLOCK)
        for slot, n in enumerate(SLOT_PAGES):
            pages.record(slot, self.slot_table[slot, :n].tolist())

    def cm(self, pad_reqs=0, pad_tokens=0):
        """vLLM's metadata for the batch, padded as a full CUDA graph pads it (padding requests have
        no tokens and no KV; their block-table rows point at the null block)."""
        from vllm.v1.attention.backend import CommonAttentionMetadata

        q_lens = [q for _, _, q in self.batch] + [0] * pad_reqs
        B, T = len(q_lens), sum(q_lens) + pad_tokens
        cu = torch.zeros(B + 1, dtype=torch.int32)
        cu[1:] = torch.tensor(q_lens).cumsum(0)
        cu[-1] = T
        seq_lens = torch.cat([self.own_lens, torch.zeros(pad_reqs, dtype=torch.int32)])
        table = self.block_table.clone()
        table[len(self.batch):] = 0
        dev = self.device
        return CommonAttentionMetadata(
            query_start_loc=cu.to(dev), query_start_loc_cpu=cu, seq_lens=seq_lens.to(dev), num_reqs=B,
            num_actual_tokens=T, max_query_len=max(q_lens), max_seq_len=int(seq_lens.max()),
            block_table_tensor=table[:B].to(dev), slot_mapping=torch.zeros(T, dtype=torch.int64, device=dev))

    def step(self):
        slots = np.array([s for s, _, _ in self.batch], dtype=np.int32)
        shift = np.array([SLOT_PAGES[s] * BLOCK if s >= 0 else 0 for s, _, _ in self.batch], dtype=np.int32)
        q_lens = np.array([q for _, _, q in self.batch], dtype=np.int32)
        return relay_step.RelayStep(len(self.batch), int(q_lens.sum()), slots, shift, q_lens)

    def reference(self):
        out, row, scale = torch.zeros(self.q.shape), 0, D ** -0.5
        for (slot, _, ql), (k, v) in zip(self.batch, self.own):
            if slot >= 0:
                k, v = torch.cat([self.sys[slot][0], k]), torch.cat([self.sys[slot][1], v])
            out[row: row + ql], _ = attention_ref(self.q[row: row + ql].cpu(), k.to(self.dtype), v.to(self.dtype),
                                                  scale, causal=True)
            row += ql
        return out


def padded(q, cm):
    """Queries as the model runner passes them: padded to the step's (graph) size with garbage rows."""
    return torch.cat([q, torch.randn(cm.num_actual_tokens - q.shape[0], *q.shape[1:]).to(q)])


def as_relay_plan(plan, cm, force_level=False):
    ctx = cm if plan is None else plan.context
    context = dict(cu_seqlens_q=ctx.query_start_loc, seqused_k=ctx.seq_lens, max_seqlen_q=ctx.max_query_len,
                   max_seqlen_k=ctx.max_seq_len, block_table=ctx.block_table_tensor)
    run = plan is not None and (plan.run_level or force_level)
    return RelayPlan(context, [plan.level] if run else [])


def random_batch(rng, n):
    """(slot or -1, own KV tokens incl. this step's, query tokens): decodes and prefill chunks."""
    batch = []
    for _ in range(n):
        slot = int(rng.integers(-1, 2))
        if rng.random() < 0.7:
            own = int(rng.integers(1, 200))
            batch.append((slot, own, 1))
        else:
            q = int(rng.integers(2, 40))
            batch.append((slot, q + int(rng.integers(0, 60)), q))
    return batch


KERNELS = {  # the system level: fused launch (its torch twin, or the Triton kernel interpreted), or flash
    "fused-torch": {}, "fused-triton": {"TRITON_INTERPRET": "1"}, "flash": {"VLLM_RELAY_LEVEL_KERNEL": "flash"}}


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("shared_path", ["auto", "always", "never"])
@pytest.mark.parametrize("seed", range(4))
def test_plan_is_exact_on_random_mixed_batches(kernel, shared_path, seed, monkeypatch):
    for name, value in KERNELS[kernel].items():
        monkeypatch.setenv(name, value)
    rng = np.random.default_rng(seed)
    world = World(random_batch(rng, int(rng.integers(1, 12))), torch.float32, "cpu", seed)
    world.record_fills()
    planner = RelayPlanner(vllm_config(shared_path), SimpleNamespace(block_size=BLOCK), "cpu")
    cm = world.cm()
    plan = planner.plan(cm, world.step())
    out = torch.full_like(world.q, float("nan"))
    relay_attention(world.q, world.k_cache, world.v_cache, as_relay_plan(plan, cm), out, D ** -0.5,
                    varlen_attention_torch)
    torch.testing.assert_close(out, world.reference(), atol=2e-5, rtol=2e-5)
    decodes = sum(1 for s, _, q in world.batch if s >= 0 and q == 1)
    if shared_path == "never" or decodes == 0:
        assert planner.stats["shared_tokens"] == 0
    elif shared_path == "always":
        assert planner.stats["shared_tokens"] == decodes


def test_padded_graph_step_with_no_relay_request_still_writes_a_valid_plan():
    """A full-graph decode step of plain requests (relay on, no prompt used) must write the plan the
    captured graph reads: the context tables equal vLLM's, the level is empty, no row is fused."""
    batch = [(-1, 30, 1), (-1, 7, 1), (-1, 100, 1)]
    world = World(batch, torch.float32, "cpu", 0)
    planner = RelayPlanner(vllm_config("always", full_graphs=True), SimpleNamespace(block_size=BLOCK), "cpu")
    cm = world.cm(pad_reqs=5, pad_tokens=5)
    plan = planner.plan(cm, None)
    assert plan is not None and plan.graph and not plan.run_level
    assert torch.equal(plan.context.seq_lens, cm.seq_lens) and torch.equal(plan.context.block_table_tensor,
                                                                           cm.block_table_tensor)
    assert (plan.level.row_index == -1).all() and int(plan.level.call["cu_seqlens_q"][-1]) == 0
    assert plan.level.perm.shape[0] == 8 and plan.level.call["max_seqlen_q"] == 8  # fixed by the padded size
    q = padded(world.q, cm)
    out = torch.empty_like(q)
    relay_attention(q, world.k_cache, world.v_cache, as_relay_plan(plan, cm, force_level=True), out,
                    D ** -0.5, varlen_attention_torch)
    torch.testing.assert_close(out[:3], world.reference(), atol=2e-5, rtol=2e-5)


def test_padded_graph_step_is_exact_and_eager_step_without_relay_plans_nothing(monkeypatch):
    from vllm_relay.attention import planner as planner_module

    monkeypatch.setattr(planner_module, "MIN_SHARED_GROUP_GRAPH_GQA", 2)
    batch = [(0, 30, 1), (1, 7, 1), (-1, 100, 1), (0, 3, 1)]
    world = World(batch, torch.float32, "cpu", 1)
    world.record_fills()
    planner = RelayPlanner(vllm_config(full_graphs=True), SimpleNamespace(block_size=BLOCK), "cpu")
    cm = world.cm(pad_reqs=4, pad_tokens=4)
    plan = planner.plan(cm, world.step())
    assert plan.graph and plan.run_level
    assert planner.stats["shared_tokens"] == 2 and planner.stats["prefix_requests"] == 1  # slot 0 shares
    q = padded(world.q, cm)
    out = torch.empty_like(q)
    relay_attention(q, world.k_cache, world.v_cache, as_relay_plan(plan, cm), out, D ** -0.5,
                    varlen_attention_torch)
    assert not out.isnan().any()
    torch.testing.assert_close(out[:4], world.reference(), atol=2e-5, rtol=2e-5)
    eager = RelayPlanner(vllm_config(), SimpleNamespace(block_size=BLOCK), "cpu")
    assert eager.plan(world.cm(), None) is None  # plain attention, vLLM's own tables


def test_small_graphs_hold_no_level_and_take_the_prefix_path():
    """Under the measured rule, a graph too small for a shared group is vLLM's plain graph: no
    level launches, relay requests read their system pages through the prefix path, exactly."""
    batch = [(0, 30, 1), (0, 7, 1), (1, 100, 1), (0, 3, 1)]
    world = World(batch, torch.float32, "cpu", 2)
    world.record_fills()
    planner = RelayPlanner(vllm_config(full_graphs=True), SimpleNamespace(block_size=BLOCK), "cpu")
    for capture in (True, False):
        cm = world.cm(pad_reqs=4, pad_tokens=4)  # 8 < MIN_SHARED_GROUP_GRAPH_GQA
        plan = planner.plan(cm, None if capture else world.step(), capture=capture)
        assert not plan.run_level and not plan.graph
    assert planner.stats["shared_tokens"] == 0 and planner.stats["prefix_requests"] == 4
    q = padded(world.q, cm)
    out = torch.empty_like(q)
    relay_attention(q, world.k_cache, world.v_cache, as_relay_plan(plan, cm), out, D ** -0.5,
                    varlen_attention_torch)
    torch.testing.assert_close(out[:4], world.reference(), atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("kernel", ["flash", "triton"])
def test_plan_tensors_are_aligned_views_of_exact_length(kernel, monkeypatch):
    # Kernels compiled at start-up assume 16-byte aligned pointers (Triton specializes on it): every
    # persistent plan tensor starts 128-byte aligned in the one staging buffer, at its own length.
    monkeypatch.setenv("VLLM_RELAY_LEVEL_KERNEL", kernel)
    planner = RelayPlanner(vllm_config(full_graphs=True), SimpleNamespace(block_size=BLOCK), "cpu")
    G = planner.num_slots
    views = {"req_pages": None, "req_slot": None, "perm": planner.max_rows, "cu": G + 1, "lens": G,
             "tiles": planner.tile_cap, "row_index": None}
    for name, length in views.items():
        t = getattr(planner, name)
        assert (t.data_ptr() - planner._dev.data_ptr()) % 128 == 0, name  # CUDA buffers start 256-aligned
        if length is not None:
            assert t.shape[0] == length, (name, t.shape)


def test_step_with_fewer_requests_than_prepared_raises():
    relay_step._current = relay_step.RelayStep(3, 3, np.zeros(3, np.int32), np.zeros(3, np.int32),
                                               np.ones(3, np.int32))
    try:
        assert relay_step.current(5, 5) is relay_step._current  # padded: fine
        with pytest.raises(RuntimeError, match="prepared 3 / 3"):
            relay_step.current(2, 2)  # split (micro-batching): refused
    finally:
        relay_step.clear()


# ---------------------------------------------------------------------------------------------- GPU


@pytest.mark.gpu
@pytest.mark.parametrize("kernel", ["triton", "flash"])
@pytest.mark.parametrize("group", [1, 4])
def test_graph_replay_equals_eager_on_cuda(group, kernel, monkeypatch):
    """Capture relay attention once (as vLLM captures a decode graph: plan with no relay request),
    then for random decode batches write each plan into the same buffers and replay: bit-identical to
    running the same plan eagerly, and close to the fp32 reference."""
    pytest.importorskip("vllm")
    from vllm.vllm_flash_attn import flash_attn_varlen_func

    monkeypatch.setenv("VLLM_RELAY_LEVEL_KERNEL", kernel)
    global H_KV, GROUP
    H_KV, GROUP = 8 // group, group
    try:
        rng = np.random.default_rng(0)
        B = 12  # captured batch size (all decode)
        worlds = [World([(int(rng.integers(-1, 2)), int(rng.integers(1, 300)), 1) for _ in range(int(n))],
                        torch.bfloat16, "cuda", s) for s, n in enumerate(rng.integers(1, B + 1, size=6))]
        planner = RelayPlanner(vllm_config("always", dtype=torch.bfloat16, full_graphs=True),
                               SimpleNamespace(block_size=BLOCK), "cuda")
        worlds[0].record_fills()  # every world's cache is built alike: same slot pages layout per world
        kw = {"fa_version": 3}
        # One static set of inputs the graph reads: q, caches and output of the largest world.
        k_cache = torch.zeros_like(max(worlds, key=lambda w: w.k_cache.shape[0]).k_cache)
        v_cache = torch.zeros_like(k_cache)
        q_static = torch.zeros(B, H_KV * GROUP, D, dtype=torch.bfloat16, device="cuda")
        out_static = torch.zeros_like(q_static)
        capture_world = worlds[0]
        cm_static = capture_world.cm(pad_reqs=B - len(capture_world.batch), pad_tokens=B - len(capture_world.batch))
        plan = planner.plan(cm_static, None, capture=True)
        relay_plan = as_relay_plan(plan, cm_static)
        relay_plan.context["num_splits"] = relay_plan.shared[0].call["num_splits"] = 8
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
            n = len(world.batch)
            k_cache.zero_()
            v_cache.zero_()
            k_cache[: world.k_cache.shape[0]] = world.k_cache
            v_cache[: world.v_cache.shape[0]] = world.v_cache
            q_static.zero_()
            q_static[:n] = world.q
            cm = world.cm(pad_reqs=B - n, pad_tokens=B - n)
            # The runner's persistent buffers: write this step's metadata into the captured ones.
            cm_static.query_start_loc.copy_(cm.query_start_loc)
            cm_static.seq_lens.copy_(cm.seq_lens)
            cm_static.block_table_tensor.copy_(cm.block_table_tensor)
            step_plan = planner.plan(cm_static, world.step())
            assert step_plan.level.perm.data_ptr() == plan.level.perm.data_ptr()
            graph.replay()
            replayed = out_static[:n].clone()
            eager_out = torch.zeros_like(out_static)
            relay_attention(q_static, k_cache, v_cache, relay_plan, eager_out, D ** -0.5, flash_attn_varlen_func, kw)
            assert torch.equal(replayed, eager_out[:n])
            torch.testing.assert_close(replayed.float().cpu(), world.reference(), atol=1.6e-2, rtol=1.6e-2)
        assert planner.stats["shared_tokens"] > 0
    finally:
        H_KV, GROUP = 2, 4
