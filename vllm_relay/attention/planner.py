"""Relay planning, once per step, into persistent tensors that every layer reads.

vLLM glue: it reads vLLM's `CommonAttentionMetadata` and the step's relay facts, and leaves the
planning math to `vllm_relay.ops` (`find_levels`, `level_rows`, `prefix_block_table`). Every device
tensor is allocated once and rewritten in place each step (one host-to-device copy, `staging.py`; none
for a decode step over the last one's rows and tree), so a CUDA graph captured over them replays any
later plan: padding requests and tokens, absent groups and steps without levels are all just values
(zero-length groups, row index -1, no front pages).

Each step gives:
* the levels: the runs of pages that several requests read, decode tokens and prompt chunks
  alike (a registered system prompt, and below it whatever the prefix cache shares: a document,
  the prompt of n samples), each read once by one grouped call for all the tokens under it (`ops.find_levels`);
* the context tables: each request's own pages past its levels, with its slot's pages in front for a
  relay request whose system prompt is no level (the prefix path; `ops.prefix_block_table`);
* on a decode step of one token a request, one call for both (the joint call, `ops/joint.py`): the
  levels in sequences of a few rows, then a sequence per token over its context table (drafts being
  verified, several tokens a request: two calls, as for prompt chunks).
The rules that decide each of these are measured, in `rules.py`.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np
import torch

from vllm_relay.attention import step as relay_step
from vllm_relay.attention.levels import LevelFinder
from vllm_relay.attention.rules import (
    GRAPH_LEVELS,
    MAX_LEVELS,
    graph_one_split,
    joint_one_split,
    joint_tokens,
)
from vllm_relay.attention.staging import Staged, StagingBuffer, same_key
from vllm_relay.attention.windows import WindowRows
from vllm_relay.config import RelayConfig
from vllm_relay.ops import SharedLevel, prefix_block_table
from vllm_relay.ops.fuse_in_place import warm_up_fuse_in_place
from vllm_relay.ops.gather_rows import warm_up_gather_rows
from vllm_relay.ops.joint import joint_capacity, joint_layout
from vllm_relay.ops.level_tree import LevelTree, level_rows, slot_front
from vllm_relay.ops.relay_attention import as_gathered
from vllm_relay.stats import add_stats

# What a planner counts (`stats`; the engine's `relay_worker_stats` sums a worker's planners').
STATS = ("planned_steps", "graph_steps", "level_graph_steps", "one_split_steps", "unsplit_graph_steps",
         "joint_steps", "prefix_requests", "shared_tokens", "level_groups", "saved_kv_tokens",
         "saved_kv_bytes",
         *(f"tokens_under_{k}_levels" for k in range(1, MAX_LEVELS + 1)), "max_level_rows")


@dataclass
class StepPlan:
    context: object  # CommonAttentionMetadata over the context tables
    level: SharedLevel  # the levels (their buffers are always written)
    run_level: bool  # whether eager code must run them (always when capturing a graph with levels)
    graph: bool  # a full-CUDA-graph step whose graph holds the levels: it reads the plan, rows or not
    one_split: bool = False  # the graph's levels run unsplit this step (`graph_one_split`)
    joint: bool = False  # the levels' call holds the context too (`SharedLevel.ctx_start`)


class RelayPlanner(LevelFinder):
    """Persistent plan tensors of one KV-cache group, and the per-step planning into them."""

    def __init__(self, vllm_config, kv_cache_spec, device, num_layers: int = 1, *, joint: bool = True,
                 joint_rows: int | None = None, graph_levels: int = GRAPH_LEVELS, one_split: bool = True,
                 chunk_levels: bool = False, query_dtype: torch.dtype | None = None, levels: bool = True,
                 window: int = 0, level_fn=None, value_size: int | None = None,
                 max_level_query_len: int | None = None) -> None:
        """The keywords are the measured rules' choices (`rules.py`), which every engine runs; tests
        set them to check the other forms, which compute the same attention:
        `joint` a decode step's levels and context in one call (else two), `joint_rows` the query rows of
        each level sequence of a joint call (None: `rules.joint_tokens`), `graph_levels` the levels a
        full graph holds besides the system prompts' (0: as many as its tokens can form), `one_split`
        a graph's levels unsplit when their rows fill the GPU (`rules.graph_one_split`; else FA3's
        split every step), `chunk_levels` a prompt chunk that fills its own query tiles reads levels too.
        `query_dtype`: the queries' dtype when the backend quantizes them (FP8), else the model's.
        `levels`: whether the layers may read levels. `window`: the layers' sliding window in tokens (0:
        none): each level row reads the level from its first visible key on (`key_start` in the level's
        call, ops/window_rows.py), with `level_fn` (`window_level_attention` or its torch twin), and no
        joint call. `value_size`: the layers' value size where it differs from the key's (MLA's latent
        cache: one vector a token, keys all of it, values its first `value_size`). `max_level_query_len`:
        a request with more tokens in a step never reads levels (an MLA backend's prefill form)."""
        if window and level_fn is None:
            raise ValueError("RelayPlanner: a sliding window's levels need level_fn (each row's first key)")
        if value_size and joint:
            raise ValueError("RelayPlanner: values narrower than keys (MLA) take two calls, not a joint one")
        cfg = RelayConfig.from_vllm(vllm_config.additional_config)
        model, sched, comp = vllm_config.model_config, vllm_config.scheduler_config, vllm_config.compilation_config
        hq = model.get_num_attention_heads(vllm_config.parallel_config)
        self.hkv = model.get_num_kv_heads(vllm_config.parallel_config)
        self.gqa = hq // self.hkv
        head_size = model.get_head_size()
        self.page_size = kv_cache_spec.block_size
        # K and V of one token in every layer this planner serves (MLA: its one vector): what a page read
        # not again saves.
        self.kv_bytes_per_token = (1 if value_size else 2) * self.hkv * head_size \
            * torch.empty((), dtype=model.dtype).element_size() * num_layers
        self.max_level_query_len = max_level_query_len
        self.num_slots, self.max_pages = relay_step.slot_shape(cfg, self.page_size)
        self._synced = (None, -1)  # the slot pages (and their version) last copied to the device
        # The step vLLM's V1 runner (the CPU's) prepared, handed over by the runner hook until the
        # step ends (hooks/runner.py); on Model Runner V2 the model state hands it to `build`.
        self.current: relay_step.RelayStep | None = None
        self.shared_path = cfg.shared_path
        self.levels = levels
        self.window = window
        self.level_fn = level_fn
        self.kv_group = 0  # the KV-cache group of its layers (set by `attention.workers.planners`)
        self.chunk_levels = chunk_levels
        self.auto_levels = cfg.auto_levels
        mode = getattr(comp, "cudagraph_mode", None)
        self.full_graphs = bool(mode is not None and mode.has_full_cudagraphs())
        self.max_graph_tokens = comp.max_cudagraph_capture_size or 0
        self.graph_levels = graph_levels or 1 << 30
        self.one_split = one_split
        self.device = torch.device(device)
        self.num_sms = torch.cuda.get_device_properties(self.device).multi_processor_count \
            if self.device.type == "cuda" else 1
        self.max_depth = MAX_LEVELS
        # Full graphs pad a decode batch up to a capture size, in requests as in tokens.
        max_reqs = max(sched.max_num_seqs, self.max_graph_tokens)
        max_tokens = max(sched.max_num_batched_tokens, max_reqs)
        self.max_reqs, self.max_tokens = max_reqs, max_tokens
        # Every level has 2 rows or more (a system prompt's, 1 with shared_path "always"), and a
        # token is in at most max_depth levels.
        self.max_groups = self.num_slots + max_reqs * self.max_depth // 2
        self.max_rows = max_reqs * self.max_depth  # level rows a graph holds (decodes: a token each)
        self.max_level_rows = max_tokens * self.max_depth  # any step's (prompt chunks: all their tokens)
        # A decode step's levels and context in one call (`joint`): its level sequences, at most.
        self.joint = joint and not window  # (the context's window and the levels' key starts: two calls)
        self.joint_rows = joint_rows
        tokens = self.max_reqs if self.joint else 0  # the joint call's rows and sequences past the levels'
        least_per = joint_tokens(1, self.gqa, self.joint_rows)  # the fewest tokens a level sequence holds
        self.max_seqs = G = max(self.max_groups, joint_capacity(self.max_rows, self.max_groups, least_per)
                                if self.joint else 0)
        self.max_call_seqs = G + tokens  # the levels' call's sequences, at most (FA3's schedule is sized by them)
        # The staging buffer's parts (int32 elements): [ctx_front | ctx_slot | ctx_skip | perm | cu |
        # lens | group row | group start | group own tokens | group front | group slot |
        # row_index (max_depth x tokens)].
        sizes = [max_reqs, max_reqs, max_reqs, self.max_level_rows + tokens, G + 1 + tokens, G, G, G, G, G, G,
                 self.max_depth * max_tokens]
        self.staging = StagingBuffer(sizes, self.device)
        (self.ctx_front, self.ctx_slot, self.ctx_skip, self.perm, self.cu, self.lens, self.group_row,
         self.group_start, self.group_own, self.group_front, self.group_slot,
         self._row_index) = self.staging.views.values()
        self.slot_pages = torch.zeros(self.num_slots, self.max_pages, dtype=torch.int32, device=self.device)
        # A gather, an attention call and the fusion: their buffers.
        self.q_buf = torch.empty(self.max_rows + tokens, hq, head_size, dtype=query_dtype or model.dtype,
                                 device=self.device)
        self.out_buf = torch.empty(*self.q_buf.shape[:2], value_size or head_size, dtype=model.dtype,
                                   device=self.device)
        # Compiled now, not by the first large steps of a loaded server (a second or more each).
        for levels in range(1, self.max_depth + 1):
            warm_up_fuse_in_place(hq, value_size or head_size, model.dtype, self.device, max_tokens, levels=levels,
                                  joint_too=self.joint)
        warm_up_gather_rows(self.perm, as_gathered(self.q_buf))
        # The level sequences' tables and lengths, then the contexts', in one tensor each: a joint call
        # reads the end of the first part and the start of the second (a step's level tables end at
        # row G). jtable: [G + max_reqs, W], W = vLLM's block-table width.
        self.jtable: torch.Tensor | None = None
        self.ctx_table: torch.Tensor | None = None
        self.level_table: torch.Tensor | None = None
        self.jlens = torch.zeros(G + max_reqs, dtype=torch.int32, device=self.device)
        self._level_lens, self.ctx_lens = self.jlens[:G], self.jlens[G:]
        self.window_rows = WindowRows(window, self.page_size, self.max_level_rows, self.device) if window else None
        self.stats = dict.fromkeys(STATS, 0)
        self._last = None  # (row facts, tree) of the last decode step, while reusable
        self._staged: Staged | None = None  # the last plan's staged part, while reusable

    def graph_capacity(self, num_tokens: int) -> tuple[int, int]:
        """(level rows, levels) a full graph of `num_tokens` decode tokens holds: each token in at
        most max_depth levels, each level with 2 rows or more except a slot's (1 with shared_path
        "always"), and at most `graph_levels` levels besides the slots'. Sized per graph, not for
        the largest: FlashAttention-3 runs a batch padded with empty groups slower, the more of
        them there are."""
        return (min(self.max_rows, num_tokens * self.max_depth),
                min(self.max_groups, self.num_slots + min(num_tokens * self.max_depth // 2, self.graph_levels)))

    def runs_unsplit(self, tree: LevelTree, num_tokens: int, tokens_per_request: int = 1) -> bool:
        """Whether a decode step of `tokens_per_request` tokens a request over `tree`'s levels, in a full
        graph of `num_tokens`, runs its levels unsplit (`_stage_plan`'s `one_split`): the joint call's
        rule (one token a request: each level's rows in sequences of `per`), else the levels' call's."""
        if self.joint and tokens_per_request == 1:
            per = joint_tokens(num_tokens, self.gqa, self.joint_rows)
            return joint_one_split(tree.size, per, self.hkv, self.num_sms)
        rows = tree.size * tokens_per_request
        return self.one_split and graph_one_split(rows, self.gqa, self.hkv, self.num_sms)

    def is_graph_step(self, cm) -> bool:
        """A uniform decode batch that vLLM runs as a full CUDA graph (FULL_AND_PIECEWISE)."""
        return self.runs_as_graph(cm.num_actual_tokens, cm.max_query_len)

    def runs_as_graph(self, num_tokens: int, max_query_len: int) -> bool:
        return self.full_graphs and max_query_len <= 1 and num_tokens <= self.max_graph_tokens

    def plan(self, cm, step: relay_step.RelayStep | None, capture: bool = False, levels: bool = False,
             graph: bool | None = None) -> StepPlan | None:
        """This step's plan, or None when plain attention over the own tables is the whole story
        (no relay facts, and not a full-graph step, whose captured launches read the plan).
        `capture`: a full CUDA graph is being captured, with the levels or not (`levels`). `graph`:
        whether the step replays a full graph (None: judged from `cm`, as vLLM's V1 runner picks)."""
        if graph is None:
            graph = self.is_graph_step(cm)
        graph = capture or graph
        if step is None and not graph:
            return None
        B, T = cm.num_reqs, cm.num_actual_tokens
        tree = None
        if step is not None and self.levels and step.level_group == self.kv_group:  # the tree is of our table
            if not step.levels_planned:
                self.levels_for(step)
            tree = step.tree
        elif step is not None and self.levels and self.window and step.levels_planned:
            tree = step.tree  # a window group's layers read the levels of another group's tables
        if not graph and tree is None and not (step.req_slot >= 0).any():
            return None  # nothing shared, nothing registered: vLLM's own tables, no work
        # Levels run eagerly when found; in a full graph, when vLLM replays the graph with them.
        if capture:
            with_level = self.rule() is not None and levels
        else:
            with_level = tree is not None and (not graph or bool(step.graph_levels))
        tree = tree if with_level else None
        if step is not None and step.pages is not None:
            self._sync_slot_pages(step.pages)
        self._make_tables(cm)
        # A decode step over the last plan's rows and tree (most decode steps) has the same tables but
        # the context lengths: the staged plan stands (`Staged`).
        key = None
        if step is not None and not capture and T == B and cm.max_query_len == 1:
            key = (step.req_slot, tree, B, graph, self._synced)
        staged = self._staged
        if staged is None or key is None or not same_key(staged.key, key):
            joint = (self.joint and with_level and T == B and cm.max_query_len <= 1  # a token per request
                     and (step is None or bool((step.q_lens == 1).all())))
            # A levels' graph holds the joint call (one token a request) or two calls (the same several
            # tokens a request: drafts verified), as captured.
            if graph and with_level and self.joint and not joint and not (
                    T % B == 0 and T > B and (step is None or bool((step.q_lens == T // B).all()))):
                raise RuntimeError(f"vllm-relay: a full-graph step with levels ({B} requests, {T} tokens) must "
                                   "hold one token per request, or as many each")
            staged = self._stage_plan(cm, step, tree, B, T, graph, key, joint)
        keys = self.window_rows.keys(cm.seq_lens, staged.rows) if self.window else None
        self._staged = staged if key is not None else None
        ctx_table, ctx_lens = self.ctx_table[:B], self.ctx_lens[:B]
        prefix_block_table(cm.block_table_tensor[:B], cm.seq_lens[:B], self.ctx_front[:B], self.ctx_slot[:B],
                           self.slot_pages, self.page_size, ctx_table, ctx_lens, start=self.ctx_skip[:B])
        max_seq_len = cm.max_seq_len + staged.max_front * self.page_size
        # The context lengths' host bound, as `prefix_block_table` makes them (MLA's prefill reads it); the
        # cache derived from the own lengths would be stale: dropped.
        context = dataclasses.replace(cm, seq_lens=ctx_lens, block_table_tensor=ctx_table, max_seq_len=max_seq_len,
                                      seq_lens_cpu_upper_bound=self._context_bound(cm, B),
                                      _num_computed_tokens_cache=None)
        if not capture:
            add_stats(self.stats, staged.counts)
            add_stats(self.stats, {"graph_steps": graph, "one_split_steps": staged.one_split,
                                   "level_graph_steps": graph and with_level,
                                   "unsplit_graph_steps": graph and with_level and step.graph_unsplit,
                                   "joint_steps": staged.joint_tokens > 0 and (graph or staged.num_rows > 0)})
        groups, rows, depth, G = staged.groups, staged.rows, staged.depth, self.max_seqs
        graph_len = self.level_table.shape[1] * self.page_size
        ctx_start = None
        if staged.joint_tokens:  # the level sequences, then a sequence per token (ops/joint.py)
            call = dict(cu_seqlens_q=self.cu[: groups + T + 1], seqused_k=self.jlens[G - groups: G + T],
                        max_seqlen_q=staged.joint_tokens,
                        max_seqlen_k=graph_len if graph else max(staged.max_group_len, max_seq_len),
                        block_table=self.jtable[G - groups: G + T])
            ctx_start, count = self.cu[groups: groups + 1], self.cu[groups + T: groups + T + 1]
        else:
            call = dict(cu_seqlens_q=self.cu[: groups + 1], seqused_k=self.lens[:groups],
                        max_seqlen_q=T if graph else staged.max_group_rows,
                        max_seqlen_k=graph_len if graph else staged.max_group_len,
                        block_table=self.level_table[G - groups: G])
            if keys is not None:  # each row reads its window's keys at most
                # (the key bound sizes the kernel's key ranges, a compiled constant: with full graphs an eager
                # step takes the graphs' bound, so that a level shorter than the window launches a variant
                # their capture compiled, not one compiled mid-run)
                bound = graph_len if self.full_graphs else call["max_seqlen_k"]
                call.update(key_start=keys, max_seqlen_k=min(bound, self.window))
            count = self.cu[groups: groups + 1]
        row_index_view = self._row_index[: depth * T].view(depth, T)
        fn = self.level_fn if self.window else None
        if rows <= self.q_buf.shape[0]:  # persistent buffers (graphs need them)
            level = SharedLevel(perm=self.perm[:rows], row_index=row_index_view, call=call,
                                q_buf=self.q_buf[:rows], out_buf=self.out_buf[:rows],
                                num_rows=count if self.device.type == "cuda" else None, ctx_start=ctx_start,
                                attn_fn=fn)
        else:  # an eager step with long prompt chunks: buffers of its own
            level = SharedLevel(perm=self.perm[:rows], row_index=row_index_view, call=call, ctx_start=ctx_start,
                                attn_fn=fn)
        run_level = (capture and with_level) or staged.num_rows > 0
        return StepPlan(context, level, run_level=run_level, graph=graph and with_level, one_split=staged.one_split,
                        joint=staged.joint_tokens > 0)

    def _make_tables(self, cm) -> None:
        if self.ctx_table is None:
            width = cm.block_table_tensor.shape[1]
            self.jtable = torch.zeros(self.jlens.shape[0], width, dtype=torch.int32, device=self.device)
            self.level_table, self.ctx_table = self.jtable[: self.max_seqs], self.jtable[self.max_seqs:]
            # Compiled now (the first plan is a profiling or capture run), not by the first step with levels.
            zero = torch.zeros(1, dtype=torch.int32, device=self.device)
            prefix_block_table(cm.block_table_tensor[:1], zero, zero, zero, self.slot_pages, self.page_size,
                               self.level_table, self._level_lens, src_row=zero, start=zero)

    def _context_bound(self, cm, B: int):
        """`cm.seq_lens_cpu_upper_bound` for the context tables: each request's own bound plus its front
        pages less its skipped ones, in tokens (None where vLLM gave none)."""
        bound = cm.seq_lens_cpu_upper_bound
        if bound is None:
            return None
        moved = self.staging.host_part("ctx_front", B) - self.staging.host_part("ctx_skip", B)
        bound = bound.clone()
        bound[:B] += torch.from_numpy(moved * self.page_size).to(bound.dtype)
        return bound

    def _stage_plan(self, cm, step, tree, B, T, graph, key, joint) -> Staged:
        """Plan what the step's rows and tree decide (all but the context lengths) into the staging
        buffer and its device twin, and each level's table (`joint`: each level sequence's of a joint
        call, ops/joint.py)."""
        root = np.full(B, -1, dtype=np.int32)
        root_pages = np.zeros(self.num_slots, dtype=np.int32)
        if step is not None:
            root[: step.num_reqs] = step.req_slot
            root_pages = self._root_pages(step)
        ctx_front = slot_front(root, root_pages).astype(np.int32)
        ctx_skip = np.zeros(B, dtype=np.int32)
        query_start = cm.query_start_loc_cpu.numpy()
        if tree is not None:
            n = step.num_reqs
            perm, cu, row_index = level_rows(tree, query_start[:n], T, step.q_lens)
            level_row = tree.row
            if self.window:
                level_row = self.window_rows.stage(step, tree, perm, cu, query_start[: n + 1], self.kv_group)
            if level_row is None:  # the window group's tables differ from the levels' (ops/window_rows.py)
                return self._stage_plan(cm, step, None, B, T, graph, key, joint)
            ctx_front[:n] = np.where(self._can_share(step), tree.row_front, ctx_front[:n])
            ctx_skip[:n] = tree.row_skip
            if not graph:  # the fusion loops over the depth this step has (a graph: over max_depth)
                row_index = row_index[: max(1, int((row_index >= 0).any(axis=1).sum()))]
        else:
            perm, cu, row_index = np.zeros(0, np.int32), np.zeros(1, np.int32), np.full((1, T), -1, np.int32)
            if self.window:
                self.window_rows.clear()
        G = tree.num_groups if tree is not None else 0
        depth = self.max_depth if graph else row_index.shape[0]
        rows, groups = self.graph_capacity(T) if graph else (perm.shape[0], G)
        if G > groups or perm.shape[0] > rows:
            raise RuntimeError(f"vllm-relay: {G} levels / {perm.shape[0]} rows exceed the graph's {groups} / {rows}")
        own = np.zeros(0, np.int32) if tree is None else ((tree.start + tree.pages) * self.page_size).astype(np.int32)
        lens = np.zeros(groups, dtype=np.int32)
        if tree is not None:
            lens[:G] = (tree.front + tree.pages) * self.page_size
        facts = None if tree is None else (level_row, tree.start, own, tree.front, tree.slot)
        group_sizes, num_rows, per = np.diff(cu), perm.shape[0], 0
        if joint:  # the levels in sequences of `per` rows, then the tokens (ops/joint.py)
            per = joint_tokens(T, self.gqa, self.joint_rows)
            chunk_group, cu = joint_layout(cu, per, T, joint_capacity(rows, groups, per) if graph else None)
            groups, rows = cu.shape[0] - 1 - T, rows + T
            lens, facts = lens[chunk_group], facts and tuple(v[chunk_group] for v in facts)
            perm = np.concatenate([perm, np.arange(T, dtype=np.int32)])
        self.staging.stage(B, T, depth, groups, ctx_front, root, ctx_skip, perm, cu, lens, facts, row_index)
        J = 0 if facts is None else facts[0].shape[0]
        if J:  # each level sequence's table: its slot's pages (if any), then its run of a member's own pages
            lo = self.max_seqs - groups  # the tables end at row max_seqs, where the contexts' start
            prefix_block_table(cm.block_table_tensor[:B], self.group_own[:J], self.group_front[:J],
                               self.group_slot[:J], self.slot_pages, self.page_size, self.level_table[lo:],
                               self._level_lens[lo:], src_row=self.group_row[:J], start=self.group_start[:J])
        one_split = bool(graph and tree is not None and self.one_split and not joint
                         and graph_one_split(group_sizes, self.gqa, self.hkv, self.num_sms))
        if joint:
            one_split = joint_one_split(group_sizes, per, self.hkv, self.num_sms)
        return Staged(key, groups, rows, depth, num_rows, int(group_sizes.max(initial=0)), int(lens.max(initial=0)),
                       int(ctx_front.max(initial=0)), one_split,
                       self._counts(tree, ctx_front, root, num_rows, row_index), per)

    def _counts(self, tree, ctx_front, root, rows, row_index) -> dict:
        """What a step of this plan adds to the stats (the graph counts aside)."""
        s = {"planned_steps": 1, "shared_tokens": rows,
             "prefix_requests": int(np.count_nonzero(ctx_front[: root.shape[0]] * (root >= 0)))}
        if tree is not None:
            saved = tree.saved_pages() * self.page_size
            if self.window and self.window_rows.saved is not None:  # each row reads its window's part
                saved = self.window_rows.saved
            s.update(level_groups=tree.num_groups, saved_kv_tokens=saved, saved_kv_bytes=saved * self.kv_bytes_per_token,
                     max_level_rows=int(tree.size.max()))
            levels = (row_index >= 0).sum(axis=0)
            for k in range(1, self.max_depth + 1):
                s[f"tokens_under_{k}_levels"] = int(np.count_nonzero(levels == k))
        return s

    def _sync_slot_pages(self, pages: relay_step.SlotPages) -> None:
        if self._synced[0] is not pages or self._synced[1] != pages.version:
            self._synced = (pages, pages.version)
            self.slot_pages.copy_(torch.from_numpy(pages.pages[self.kv_group]))
