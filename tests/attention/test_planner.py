"""The relay planner, without a model runner: vLLM's CommonAttentionMetadata of random mixed batches
(padded as full CUDA graphs pad them), the step's relay facts with vLLM's host block table, and the
slot pages a fill recorded. Requests share runs of pages as the prefix cache lays them out (the n
samples of a prompt, a document under a system prompt, plain requests over a common prefix). The
plan, run by `relay_attention`, must equal dense attention over [system K/V ; own K/V] for every
request, under every rule. Full-graph steps and graph replay on CUDA: test_planner_graphs.py.
"""

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from tests.ops.reference import attention_ref, make_paged_cache
from vllm_relay.attention import levels as levels_module
from vllm_relay.attention import step as relay_step
from vllm_relay.attention.planner import RelayPlanner
from vllm_relay.config import RelayConfig
from vllm_relay.ops import RelayPlan, relay_attention, varlen_attention_torch

BLOCK, H_KV, GROUP, D = 16, 2, 4, 64
MAX_MODEL_LEN, MAX_REQS, MAX_TOKENS, CAPTURE = 1024, 16, 256, 32
SLOT_PAGES = (5, 2)  # whole pages of slots 0 and 1 (80 and 32 tokens)


def vllm_config(shared_path="auto", dtype=torch.float32, full_graphs=False, auto_levels=True):
    mode = SimpleNamespace(has_full_cudagraphs=lambda: full_graphs)
    model = SimpleNamespace(get_num_attention_heads=lambda _p: H_KV * GROUP, get_num_kv_heads=lambda _p: H_KV,
                            get_head_size=lambda: D, dtype=dtype, max_model_len=MAX_MODEL_LEN)
    relay = {"max_prompts": 3, "max_prompt_tokens": 128, "shared_path": shared_path, "auto_levels": auto_levels}
    return SimpleNamespace(
        additional_config={"relay": relay}, model_config=model, parallel_config=None,
        scheduler_config=SimpleNamespace(max_num_seqs=MAX_REQS, max_num_batched_tokens=MAX_TOKENS),
        compilation_config=SimpleNamespace(cudagraph_mode=mode, max_cudagraph_capture_size=CAPTURE),
    )


# The planner's keyword choices (`RelayPlanner`'s tuning keywords) every planner a test makes gets;
# a test sets one with monkeypatch.setitem(TUNED, ...).
TUNED: dict = {}


def make_planner(device="cpu", **kwargs):
    return RelayPlanner(vllm_config(**kwargs), SimpleNamespace(block_size=BLOCK), device, **TUNED)


class World:
    """A paged cache holding two filled system prompts and the requests' own KV.

    `batch` rows are (slot or -1, own KV tokens incl. this step's, query tokens, parent row or -1,
    pages shared with the parent): a row with a parent holds the parent's page ids (and so its KV)
    for its first pages, at most the whole pages before either one's query tokens; its own copies
    of those pages are overwritten with garbage, so a plan that read them would be wrong.
    """

    def __init__(self, batch, dtype, device, seed):
        g = torch.Generator().manual_seed(seed)
        self.batch = batch
        own = [(torch.randn(c, H_KV, D, generator=g), torch.randn(c, H_KV, D, generator=g))
               for _, c, _, _, _ in batch]
        shared = []
        for r, (_, c, q, parent, pages) in enumerate(batch):
            n = 0
            if parent >= 0:
                n = max(0, min(pages, (c - q) // BLOCK, (batch[parent][1] - batch[parent][2]) // BLOCK))
                own[r][0][: n * BLOCK] = own[parent][0][: n * BLOCK]
                own[r][1][: n * BLOCK] = own[parent][1][: n * BLOCK]
            shared.append(n)
        self.sys = [(torch.randn(n * BLOCK, H_KV, D, generator=g), torch.randn(n * BLOCK, H_KV, D, generator=g))
                    for n in SLOT_PAGES]
        seqs = own + self.sys
        k_cache, v_cache, table, lens = make_paged_cache([k for k, _ in seqs], [v for _, v in seqs], BLOCK, dtype)
        B = len(batch)
        for r, (_, _, _, parent, _) in enumerate(batch):
            if shared[r]:
                ids = table[r, : shared[r]].long()
                k_cache[ids] = torch.randn_like(k_cache[ids])  # never read: the parent's pages are
                table[r, : shared[r]] = table[parent, : shared[r]]
        self.k_cache, self.v_cache = k_cache.to(device), v_cache.to(device)
        self.slot_table = table[B:]
        width = -(-MAX_MODEL_LEN // BLOCK)
        self.block_table = torch.zeros(MAX_REQS, width, dtype=torch.int32)
        self.block_table[:B, : table.shape[1]] = table[:B]
        self.own_lens = lens[:B]
        self.q = torch.randn(sum(row[2] for row in batch), H_KV * GROUP, D, generator=g).to(dtype).to(device)
        self.own, self.dtype, self.device = own, dtype, device
        self.pages = relay_step.SlotPages.for_config(RelayConfig(max_prompts=3, max_prompt_tokens=128), BLOCK)

    def record_fills(self):
        """The slot pages the step's preparer (model state or runner hook) records from the fills."""
        for slot, n in enumerate(SLOT_PAGES):
            self.pages.record(0, slot, self.slot_table[slot, :n].tolist())

    def cm(self, pad_reqs=0, pad_tokens=0):
        """vLLM's metadata for the batch, padded as a full CUDA graph pads it (padding requests have
        no tokens and no KV; their block-table rows point at the null block)."""
        from vllm.v1.attention.backend import CommonAttentionMetadata

        q_lens = [row[2] for row in self.batch] + [0] * pad_reqs
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
        """The relay facts the runner hook records, with vLLM's host block table and KV lengths."""
        slots = np.array([row[0] for row in self.batch], dtype=np.int32)
        shift = np.array([SLOT_PAGES[s] * BLOCK if s >= 0 else 0 for s in slots], dtype=np.int32)
        q_lens = np.array([row[2] for row in self.batch], dtype=np.int32)
        return relay_step.RelayStep(len(self.batch), int(q_lens.sum()), slots, shift, q_lens,
                                    self.block_table.numpy(), self.own_lens.numpy().copy(), pages=self.pages)

    def reference(self, window=0):
        """Each token's attention over [its slot's prompt ; its own KV], causal; with `window`, from its
        position less window - 1 on."""
        out, row, scale = torch.zeros(self.q.shape), 0, D ** -0.5
        for (slot, _, ql, _, _), (k, v) in zip(self.batch, self.own):
            if slot >= 0:
                k, v = torch.cat([self.sys[slot][0], k]), torch.cat([self.sys[slot][1], v])
            first = torch.arange(ql) + k.shape[0] - ql - (window - 1) if window else None
            out[row: row + ql], _ = attention_ref(self.q[row: row + ql].cpu(), k.to(self.dtype), v.to(self.dtype),
                                                  scale, causal=True, first=first)
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


def run_and_check(world, plan, cm, q=None, force_level=False, window=0):
    q = world.q if q is None else q
    out = torch.full_like(q, float("nan"))
    context = {"window_size": (window - 1, 0)} if window else None  # as the backends pass a window
    relay_attention(q, world.k_cache, world.v_cache, as_relay_plan(plan, cm, force_level), out, D ** -0.5,
                    varlen_attention_torch, context_kwargs=context)
    n = world.q.shape[0]
    assert not out[:n].isnan().any()
    torch.testing.assert_close(out[:n].float().cpu(), world.reference(window), atol=2e-5, rtol=2e-5)


def random_batch(rng, n):
    """Decodes and prefill chunks of relay and plain requests; most rows copy a random prefix of an
    earlier row's pages (any depth: documents, samples of a sample)."""
    batch = []
    for r in range(n):
        q = 1 if rng.random() < 0.75 else int(rng.integers(2, 40))
        own = q + int(rng.integers(0, 200))
        parent = int(rng.integers(0, r)) if r and rng.random() < 0.7 else -1
        slot = batch[parent][0] if parent >= 0 else int(rng.integers(-1, 2))
        batch.append((slot, own, q, parent, int(rng.integers(1, 13))))
    return batch


@pytest.mark.parametrize("shared_path", ["auto", "always", "never"])
@pytest.mark.parametrize("seed", range(4))
def test_plan_is_exact_on_random_mixed_batches(shared_path, seed, monkeypatch):
    monkeypatch.setitem(levels_module.MIN_SAVED_TOKENS, ("cpu", True), 64)  # small batches do share
    rng = np.random.default_rng(seed)
    world = World(random_batch(rng, int(rng.integers(1, 14))), torch.float32, "cpu", seed)
    world.record_fills()
    planner = make_planner(shared_path=shared_path)
    cm = world.cm()
    run_and_check(world, planner.plan(cm, world.step()), cm)
    relay_decodes = sum(1 for s, _, q, _, _ in world.batch if s >= 0 and q == 1)
    if shared_path == "never":
        assert planner.stats["shared_tokens"] == 0
    elif shared_path == "always":
        assert planner.stats["tokens_under_1_levels"] + planner.stats["tokens_under_2_levels"] \
            + planner.stats["tokens_under_3_levels"] + planner.stats["tokens_under_4_levels"] >= relay_decodes


def test_levels_of_every_depth_with_nothing_registered():
    """Plain requests: 9 over one 96-token prefix (a document), 4 of them (a prompt and its samples)
    sharing 3 pages more, 2 of those a further page; and 2 unrelated requests (one a prefill). Each
    shared run is read once per step."""
    batch = [(-1, 200, 1, -1, 0)] + [(-1, 150 + i, 1, 0, 6) for i in range(5)]
    batch += [(-1, 190, 1, 1, 9), (-1, 180, 1, 1, 9), (-1, 170, 1, 6, 10), (-1, 40, 1, -1, 0), (-1, 33, 5, -1, 0)]
    world = World(batch, torch.float32, "cpu", 3)
    planner = make_planner(shared_path="always")
    cm = world.cm()
    plan = planner.plan(cm, world.step())
    run_and_check(world, plan, cm)
    s = planner.stats
    assert s["tokens_under_1_levels"] == 5 and s["tokens_under_2_levels"] == 2 and s["tokens_under_3_levels"] == 2
    assert s["level_groups"] == 3 and s["shared_tokens"] == 9 + 4 + 2
    # Saved reads: 9 rows share 6 pages, 4 rows 3 pages more, 2 rows one page more.
    assert s["saved_kv_tokens"] == (8 * 6 + 3 * 3 + 1 * 1) * BLOCK
    assert s["saved_kv_bytes"] == s["saved_kv_tokens"] * 2 * H_KV * D * 4


def test_prompt_chunks_over_a_cached_prefix_read_it_as_a_level():
    """The step in which n samples of a prompt start (vLLM recomputes each one's last page of the
    prompt over its cached pages), and requests over a cached document starting: every token of
    their chunks reads the shared pages as one level, exact."""
    batch = [(-1, 177, 1, -1, 0)] + [(-1, 176, 16, 0, 10) for _ in range(6)]  # 10 cached pages each
    batch += [(-1, 90, 7, 0, 5), (1, 60, 20, -1, 0), (1, 70, 9, 8, 2)]  # a document; slot 1's chunks
    world = World(batch, torch.float32, "cpu", 6)
    world.record_fills()
    planner = make_planner(shared_path="always")
    cm = world.cm()
    plan = planner.plan(cm, world.step())
    run_and_check(world, plan, cm)
    levels = (plan.level.row_index >= 0).sum(dim=0)
    first = np.cumsum([0] + [q for _, _, q, _, _ in batch])
    assert (levels[first[1]: first[7]] == 2).all()  # the 6 samples: the prompt, then their own part
    assert (levels[first[7]: first[8]] == 1).all() and (levels[first[8]: first[10]] >= 1).all()
    assert planner.stats["shared_tokens"] == int((plan.level.row_index >= 0).sum())


def test_prompt_chunks_that_fill_their_query_tiles_read_the_prompt_in_their_context(monkeypatch):
    """Under the measured rule a chunk that fills its query tiles (32 rows x 4 query heads: one tile)
    reads its system prompt in its context, where a level would save it no reads; one of 33 rows (two
    tiles, 52% full) and the decodes read it as a level. A plain row's full chunk over another's
    pages reads them in its context too. Exact either way."""
    monkeypatch.setitem(levels_module.MIN_SAVED_TOKENS, ("cpu", True), 1)
    batch = [(0, 40, 32, -1, 0), (0, 50, 33, -1, 0)] + [(0, 60 + i, 1, -1, 0) for i in range(6)]
    batch += [(-1, 90, 1, -1, 0), (-1, 100, 32, 8, 3), (-1, 110, 1, 8, 3)]
    world = World(batch, torch.float32, "cpu", 7)
    world.record_fills()
    planner = make_planner()
    cm = world.cm()
    plan = planner.plan(cm, world.step())
    run_and_check(world, plan, cm)
    first = np.cumsum([0] + [q for _, _, q, _, _ in batch])
    levels = (plan.level.row_index >= 0).sum(dim=0)
    assert (levels[first[0]: first[1]] == 0).all() and (levels[first[1]: first[8]] == 1).all()
    assert (levels[first[9]: first[10]] == 0).all() and levels[first[10]] == 1
    ctx_lens = plan.context.seq_lens.cpu().tolist()
    assert ctx_lens[0] == SLOT_PAGES[0] * BLOCK + 40 and ctx_lens[1] == 50  # the prompt in the context, or not
    assert ctx_lens[9] == 100 and ctx_lens[10] == 110 - 3 * BLOCK
    assert planner.stats["prefix_requests"] == 1
    monkeypatch.setitem(TUNED, "chunk_levels", True)  # the other form: every chunk reads levels
    planner = make_planner()
    plan = planner.plan(cm, world.step())
    run_and_check(world, plan, cm)
    assert ((plan.level.row_index >= 0).sum(dim=0)[first[0]: first[8]] == 1).all()
    assert planner.stats["prefix_requests"] == 0


def test_decode_steps_with_the_same_rows_reuse_their_tree():
    """The runner hook hands over the same row facts while a batch keeps its rows. A decode step
    then gets the last decode step's tree when each level has two rows or more (registered prompts,
    samples sharing pages below them): the rows' pages stay, and what they add while decoding is
    their own. A level of one row grows with its row's pages: searched again. Every tree equals a
    fresh planner's, also after each row has written a page more; other rows search again."""

    def tree_of(planner, step):
        planner.levels_for(step)
        return step.tree

    def same(a, b):
        fields = ("row", "front", "size", "row_groups", "row_skip", "row_front")
        return all(np.array_equal(getattr(a, f), getattr(b, f)) for f in fields)

    def later(step, rows=None, tokens=1):  # a later decode step: `tokens` more KV tokens per request
        rows = step.req_slot if rows is None else rows
        table, seq = step.block_table.copy(), step.seq_lens + tokens
        fresh = iter(range(int(table.max()) + 1, 1 << 30))
        for r in range(step.num_reqs):  # the pages it starts are its own (new page ids)
            for page in range(-(-int(step.seq_lens[r]) // BLOCK), -(-int(seq[r]) // BLOCK)):
                table[r, page] = next(fresh)
        return relay_step.RelayStep(step.num_reqs, step.num_tokens, rows, step.req_shift, step.q_lens,
                                    table, seq, pages=step.pages)

    registered = World([(0, 50, 1, -1, 0), (0, 60, 1, -1, 0), (1, 70, 1, -1, 0), (1, 80, 1, -1, 0),
                        (-1, 90, 1, -1, 0)], torch.float32, "cpu", 7)
    samples = World([(0, 50, 1, -1, 0), (0, 66, 1, 0, 3), (-1, 70, 1, -1, 0), (-1, 75, 1, 2, 4),
                     (-1, 90, 1, 2, 4)], torch.float32, "cpu", 8)
    alone = World([(0, 50, 1, -1, 0), (0, 60, 1, -1, 0), (1, 70, 1, -1, 0)], torch.float32, "cpu", 9)
    for world, groups, reused in ((registered, 2, True), (samples, 2, True), (alone, 2, False)):
        world.record_fills()
        planner = make_planner(shared_path="always")
        first = world.step()
        tree = tree_of(planner, first)
        assert tree.num_groups == groups
        for tokens in (1, BLOCK + 3):
            step = later(first, tokens=tokens)
            assert (tree_of(planner, step) is tree) == reused
            assert same(step.tree, tree_of(make_planner(shared_path="always"), later(first, tokens=tokens)))
        if not reused:
            assert not same(step.tree, tree)  # slot 1's one row: its level ran on over its new page
            continue
        other = later(first, rows=first.req_slot.copy())  # the batch's rows changed
        assert tree_of(planner, other) is not tree and same(other.tree, tree)
        prompt = relay_step.RelayStep(first.num_reqs, first.num_tokens + 1, first.req_slot, first.req_shift,
                                      first.q_lens + np.eye(first.num_reqs, dtype=np.int32)[0],
                                      first.block_table, first.seq_lens + 1, pages=first.pages)
        assert tree_of(planner, prompt) is not tree  # not a decode step: searched


def test_decode_steps_over_the_same_rows_stage_their_plan_once(monkeypatch):
    """A decode step over the last plan's rows and tree (the hook's same row facts, the tree reused)
    has the same level and context tables but for the context lengths: it stages, copies and
    launches nothing of them again, its plan is exact, and every tensor it reads equals a fresh
    planner's for the step, the lengths included; so for a step with no levels. Other rows, or a
    capture, stage again."""
    import dataclasses

    monkeypatch.setitem(levels_module.MIN_SAVED_TOKENS, ("cpu", True), 1)
    batch = [(0, 30, 1, -1, 0), (0, 45, 1, -1, 0), (1, 7, 1, -1, 0), (-1, 100, 1, -1, 0), (-1, 90, 1, 3, 5)]
    world = World(batch, torch.float32, "cpu", 3)
    world.record_fills()
    planner = make_planner(full_graphs=True)
    cm = world.cm(pad_reqs=3, pad_tokens=3)

    def planned(planner, cm, step):
        planner.levels_for(step)
        step.graph_levels = True
        return planner.plan(cm, step)

    def reads(plan):
        call = plan.level.call
        return [plan.context.seq_lens, plan.context.block_table_tensor, plan.level.perm, plan.level.row_index,
                call["cu_seqlens_q"], call["seqused_k"], call["block_table"]]

    first = world.step()
    plan = planned(planner, cm, first)
    staged = planner._staged
    assert plan.run_level and staged is not None
    run_and_check(world, plan, cm, padded(world.q, cm))
    again = relay_step.RelayStep(first.num_reqs, first.num_tokens, first.req_slot, first.req_shift, first.q_lens,
                                 first.block_table, first.seq_lens.copy(), pages=first.pages)
    plan = planned(planner, cm, again)
    assert planner._staged is staged and again.tree is first.tree
    run_and_check(world, plan, cm, padded(world.q, cm))
    # One more KV token per request (no row starts a page): the staged part stays, the lengths follow.
    grown = (cm.seq_lens > 0).to(torch.int32)
    later_cm = dataclasses.replace(cm, seq_lens=cm.seq_lens + grown, max_seq_len=cm.max_seq_len + 1)
    later = relay_step.RelayStep(first.num_reqs, first.num_tokens, first.req_slot, first.req_shift, first.q_lens,
                                 first.block_table, first.seq_lens + 1, pages=first.pages)
    plan = planned(planner, later_cm, later)
    assert planner._staged is staged
    fresh_planner = make_planner(full_graphs=True)
    fresh = planned(fresh_planner, later_cm, relay_step.RelayStep(
        first.num_reqs, first.num_tokens, first.req_slot.copy(), first.req_shift, first.q_lens, first.block_table,
        first.seq_lens + 1, pages=first.pages))
    for a, b in zip(reads(plan), reads(fresh)):
        assert torch.equal(a, b)
    assert plan.context.max_seq_len == fresh.context.max_seq_len and plan.one_split == fresh.one_split
    assert fresh_planner.stats["shared_tokens"] == 4  # each step: slot 0's two rows, the plain pair's two
    assert planner.stats == {k: v if k.startswith("max_") else 3 * v for k, v in fresh_planner.stats.items()}
    other = relay_step.RelayStep(first.num_reqs, first.num_tokens, first.req_slot.copy(), first.req_shift,
                                 first.q_lens, first.block_table, first.seq_lens.copy(), pages=first.pages)
    planned(planner, cm, other)  # the batch's rows changed: staged again
    assert planner._staged is not staged and planner._staged is not None
    planner.plan(cm, None, capture=True, levels=True)
    assert planner._staged is None
    plain = World([(-1, 30, 1, -1, 0), (-1, 45, 1, -1, 0)], torch.float32, "cpu", 4)  # nothing shared
    cm, step = plain.cm(pad_reqs=2, pad_tokens=2), plain.step()
    plan = planned(planner, cm, step)
    staged = planner._staged
    assert step.tree is None and not plan.run_level and staged is not None
    plan = planned(planner, cm, relay_step.RelayStep(step.num_reqs, step.num_tokens, step.req_slot, step.req_shift,
                                                     step.q_lens, step.block_table, step.seq_lens.copy(),
                                                     pages=step.pages))
    assert planner._staged is staged
    run_and_check(plain, plan, cm, padded(plain.q, cm))


def test_auto_levels_off_reads_only_registered_prompts_as_levels():
    batch = [(0, 50, 1, -1, 0), (0, 60, 1, 0, 2), (-1, 70, 1, -1, 0), (-1, 80, 1, 2, 4)]
    world = World(batch, torch.float32, "cpu", 4)
    world.record_fills()
    planner = make_planner(shared_path="always", auto_levels=False)
    cm = world.cm()
    run_and_check(world, planner.plan(cm, world.step()), cm)
    assert planner.stats["level_groups"] == 1 and planner.stats["shared_tokens"] == 2  # slot 0 alone


def test_eager_steps_with_little_sharing_plan_no_levels():
    """Under the measured rule an eager step runs levels only when they save enough KV reads."""
    batch = [(-1, 40, 1, -1, 0), (-1, 41, 1, 0, 2), (-1, 45, 1, 0, 2)]  # 2 rows share 2 pages with a third
    world = World(batch, torch.float32, "cpu", 5)
    planner = make_planner()
    cm = world.cm()
    plan = planner.plan(cm, world.step())
    assert plan is None and planner.stats["level_groups"] == 0  # vLLM's own call over its own tables
    run_and_check(world, plan, cm)


def test_steps_that_could_not_save_enough_are_not_searched(monkeypatch):
    """The search is skipped when even `saved_bound` (every row's pages shared by all the others)
    stays below the rule's KV reads: the step plans no levels, as the search would have found none.
    At the threshold of what the tree saves, the same step is searched and runs its levels."""
    batch = [(0, 50, 1, -1, 0), (0, 60, 1, 0, 2), (0, 70, 1, 0, 2), (-1, 90, 1, -1, 0), (-1, 33, 5, 3, 2)]
    world = World(batch, torch.float32, "cpu", 8)
    world.record_fills()
    cm = world.cm()
    bounds, searched = [], []
    bound, search = levels_module.saved_bound, levels_module.find_levels
    monkeypatch.setattr(levels_module, "saved_bound", lambda *a: bounds.append(bound(*a)) or bounds[-1])
    monkeypatch.setattr(levels_module, "find_levels", lambda *a: searched.append(search(*a)) or searched[-1])
    monkeypatch.setitem(levels_module.MIN_SAVED_TOKENS, ("cpu", True), 1)
    planner = make_planner()
    run_and_check(world, planner.plan(cm, world.step()), cm)
    saved = searched[-1].saved_pages()
    assert 0 < saved <= bounds[-1] and planner.stats["level_groups"] == searched[-1].num_groups > 0
    monkeypatch.setitem(levels_module.MIN_SAVED_TOKENS, ("cpu", True), bounds[-1] * BLOCK + 1)
    planner = make_planner()
    plan = planner.plan(cm, world.step())
    assert len(searched) == 1 and len(bounds) == 2  # not searched
    assert planner.stats.get("level_groups", 0) == 0
    run_and_check(world, plan, cm)
    monkeypatch.setitem(levels_module.MIN_SAVED_TOKENS, ("cpu", True), saved * BLOCK)
    planner = make_planner()
    run_and_check(world, planner.plan(cm, world.step()), cm)
    assert len(searched) == 2 and planner.stats["level_groups"] == searched[-1].num_groups


@pytest.mark.parametrize("joint", [True, False])
def test_plan_tensors_are_aligned_views_of_exact_length(joint, monkeypatch):
    # Kernels compiled at start-up assume 16-byte aligned pointers (Triton specializes on it): every
    # persistent plan tensor starts 128-byte aligned in the one staging buffer, at its own length.
    monkeypatch.setitem(TUNED, "joint", joint)
    planner = make_planner(full_graphs=True)
    G, tokens = planner.max_seqs, planner.max_reqs if joint else 0  # a joint call's tokens
    assert planner.joint == joint and G >= planner.max_groups
    views = {"ctx_front": None, "ctx_slot": None, "ctx_skip": None, "perm": planner.max_level_rows + tokens,
             "cu": G + 1 + tokens,
             "lens": G, "group_row": G, "group_start": G, "group_own": G, "group_front": G, "group_slot": G,
             "_row_index": planner.max_depth * planner.max_tokens}
    for name, length in views.items():
        t = getattr(planner, name)
        assert (t.data_ptr() - planner.staging.dev.data_ptr()) % 128 == 0, name  # CUDA buffers start 256-aligned
        if length is not None:
            assert t.shape[0] == length, (name, t.shape)


def test_step_with_fewer_requests_than_prepared_raises():
    step = relay_step.RelayStep(3, 3, np.zeros(3, np.int32), np.zeros(3, np.int32), np.ones(3, np.int32))
    assert relay_step.covering(step, 5, 5) is step  # padded: fine
    with pytest.raises(RuntimeError, match="prepared 3 / 3"):
        relay_step.covering(step, 2, 2)  # split (micro-batching): refused


# ---------------------------------------------------------------------------------------------- GPU
