"""Relay planning, once per step, into persistent tensors that every layer reads.

vLLM glue: it reads vLLM's `CommonAttentionMetadata` and the step's relay facts, and leaves the
planning math to `vllm_relay.ops`. Every device tensor is allocated once and rewritten in place
each step (one host-to-device copy), so a CUDA graph captured over them replays any later plan:
padding requests and tokens, absent slots and steps without relay requests are all just values
(zero-length groups, row index -1, no prefix pages).

Each step gives:
* the context tables: each request's own block table and KV length, with its slot's pages in
  front for a relay request on the prefix path (`ops.prefix_block_table`);
* the system level: the decode tokens of relay requests on the shared path, grouped by slot,
  each group reading its slot's pages once.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np
import torch

from vllm_relay import envs
from vllm_relay.attention import step as relay_step
from vllm_relay.config import RelayConfig
from vllm_relay.ops import SHARED_MAX_QUERY_LEN, SharedLevel, choose_shared, group_rows, prefix_block_table
from vllm_relay.ops.level_attention import max_tiles, plan_tiles, tile_tokens, workspace
from vllm_relay.ops.relay_fusion import warm_up_fuse_in_place

# The shared path's threshold: a slot's decode requests take it when at least this many share the
# slot in the step (else each reads the system pages itself, through the prefix path). A full CUDA
# graph captures the shared level's launches only if its (padded) batch can hold such a group:
# smaller graphs are exactly vLLM's (one FlashAttention call per layer), larger ones replay the
# level's launches also when it has no rows. Eager steps pay the level's Python launches instead.
# NOTE: measured on the H200 (benchmarks/results/layer_h200.md): with an empty level costing its
# launches in every captured step, the shared path wins from about these group sizes at S=2048.
MIN_SHARED_GROUP_GRAPH = 8
MIN_SHARED_GROUP_GRAPH_GQA = 32
MIN_SHARED_GROUP_EAGER = 16
MIN_SHARED_GROUP_EAGER_GQA = 64
NEVER = 1 << 30
# The fused level kernel splits a tile's keys into at most this many slices, so that few rows
# still give the GPU about two programs per multiprocessor.
MAX_LEVEL_SPLITS = 8


def level_splits(rows: int, gqa: int, num_kv_heads: int, num_sms: int) -> int:
    """Key slices per tile of the fused level kernel for `rows` grouped tokens (about two
    programs per multiprocessor, at most MAX_LEVEL_SPLITS)."""
    tiles = max(1, -(-rows // tile_tokens(gqa)))
    return max(1, min(MAX_LEVEL_SPLITS, -(-2 * num_sms // (tiles * num_kv_heads))))


# Every planner of this worker process, for `worker_stats`.
_planners: list[RelayPlanner] = []


def worker_stats(_worker=None) -> dict:
    """What this worker's planners did, summed: steps planned (full-graph ones too), requests that
    read their system pages through the prefix path, decode tokens on the shared path. Callable
    through `LLM.collective_rpc(worker_stats)` (the worker argument is ignored)."""
    total = {"planned_steps": 0, "graph_steps": 0, "prefix_requests": 0, "shared_tokens": 0}
    for planner in _planners:
        for key in total:
            total[key] += planner.stats[key]
    return total


@dataclass
class StepPlan:
    context: object  # CommonAttentionMetadata over the context tables
    level: SharedLevel  # the system level (its buffers are always written)
    run_level: bool  # whether eager code must run it (always when capturing a graph with a level)
    graph: bool  # a full-CUDA-graph step whose graph holds the level: it reads the plan, rows or not


class RelayPlanner:
    """Persistent plan tensors of one KV-cache group, and the per-step planning into them."""

    def __init__(self, vllm_config, kv_cache_spec, device) -> None:
        cfg = RelayConfig.from_vllm(vllm_config.additional_config)
        model, sched, comp = vllm_config.model_config, vllm_config.scheduler_config, vllm_config.compilation_config
        hq = model.get_num_attention_heads(vllm_config.parallel_config)
        self.hkv = model.get_num_kv_heads(vllm_config.parallel_config)
        self.gqa = hq // self.hkv
        self.page_size = kv_cache_spec.block_size
        self.pages = relay_step.slot_pages_for(cfg, self.page_size)
        self.num_slots, self.max_pages = self.pages.pages.shape
        self._pages_version = -1
        graph_min = MIN_SHARED_GROUP_GRAPH_GQA if self.gqa > 1 else MIN_SHARED_GROUP_GRAPH
        eager_min = MIN_SHARED_GROUP_EAGER_GQA if self.gqa > 1 else MIN_SHARED_GROUP_EAGER
        self.min_group = {"auto": (graph_min, eager_min), "always": (1, 1),
                          "never": (NEVER, NEVER)}[cfg.shared_path]
        mode = getattr(comp, "cudagraph_mode", None)
        self.full_graphs = bool(mode is not None and mode.has_full_cudagraphs())
        self.max_graph_tokens = comp.max_cudagraph_capture_size or 0
        self.device = torch.device(device)
        self.num_sms = torch.cuda.get_device_properties(self.device).multi_processor_count \
            if self.device.type == "cuda" else 1
        # NOTE: FlashAttention-3 runs the level faster once it has many rows (the fused Triton
        # kernel is not tuned yet: 268 against 184 us at n=128, S=8192 on the H200), which is where
        # relay's throughput is decided; the fused kernel is cheaper only when the level is empty.
        self.level_kernel = envs.VLLM_RELAY_LEVEL_KERNEL or "flash"
        # Full graphs pad a decode batch up to a capture size, in requests as in tokens.
        max_reqs = max(sched.max_num_seqs, self.max_graph_tokens)
        max_tokens = max(sched.max_num_batched_tokens, max_reqs)
        self.max_rows = max_reqs * SHARED_MAX_QUERY_LEN
        G = self.num_slots
        self.tile_cap = max_tiles(self.max_rows, G, self.gqa)
        # One int32 staging buffer and its device twin:
        # [req_pages | req_slot | perm | cu | lens | tiles (fused level) | row_index].
        sizes = [max_reqs, max_reqs, self.max_rows, G + 1, G, 3 * self.tile_cap, max_tokens]
        # Each view starts 128-byte aligned: Triton specializes kernels on their pointers' alignment,
        # and a view at an odd offset would make the kernels compiled at start-up miss.
        self._offsets = np.concatenate(([0], np.cumsum([-(-n // 32) * 32 for n in sizes])))
        self._host = torch.zeros(int(self._offsets[-1]), dtype=torch.int32, pin_memory=self.device.type == "cuda")
        self._host_np = self._host.numpy()
        self._dev = torch.zeros_like(self._host, device=self.device)
        views = [self._dev[a: a + n] for a, n in zip(self._offsets[:-1], sizes)]
        self.req_pages, self.req_slot, self.perm, self.cu, self.lens, tiles, self.row_index = views
        self.tiles = tiles.view(self.tile_cap, 3)
        self.slot_pages = torch.zeros(G, self.max_pages, dtype=torch.int32, device=self.device)
        self.q_buf = self.out_buf = self.ws = None
        if self.level_kernel == "flash":  # a gather, an attention call and the fusion: their buffers
            self.q_buf = torch.empty(self.max_rows, hq, model.get_head_size(), dtype=model.dtype, device=self.device)
            self.out_buf = torch.empty_like(self.q_buf)
            # Compiled now, not by the first large steps of a loaded server (a second or more each).
            warm_up_fuse_in_place(hq, model.get_head_size(), model.dtype, self.device, max_tokens)
        else:  # one fused launch: its split-K workspace, for the most tiles x slices any step uses
            cap = max(max_tiles(r, G, self.gqa) * level_splits(r, self.gqa, self.hkv, self.num_sms)
                      for r in range(1, self.max_rows + 1))
            self.ws = workspace(cap, self.hkv, 1, model.get_head_size(), self.device)
        self.ctx_table: torch.Tensor | None = None  # [max_reqs, W], W = vLLM's block-table width
        self.ctx_lens = torch.zeros(max_reqs, dtype=torch.int32, device=self.device)
        self.stats = dict.fromkeys(("planned_steps", "graph_steps", "prefix_requests", "shared_tokens"), 0)
        _planners.append(self)

    def is_graph_step(self, cm) -> bool:
        """A uniform decode batch that vLLM runs as a full CUDA graph (FULL_AND_PIECEWISE)."""
        return self.full_graphs and cm.max_query_len <= 1 and cm.num_actual_tokens <= self.max_graph_tokens

    def plan(self, cm, step: relay_step.RelayStep | None, capture: bool = False) -> StepPlan | None:
        """This step's plan, or None when plain attention over the own tables is the whole story
        (no relay request, and not a full-graph step, whose captured launches read the plan)."""
        graph = capture or self.is_graph_step(cm)
        if step is None and not graph:
            return None
        B, T, G = cm.num_reqs, cm.num_actual_tokens, self.num_slots
        min_group = self.min_group[0 if graph else 1]
        # A graph whose size cannot hold a shared group has no level (a function of T alone, so the
        # captured graph and every step replaying it agree).
        with_level = not graph or T >= min_group
        req_slot = np.full(B, -1, dtype=np.int32)
        req_shift = np.zeros(B, dtype=np.int32)
        q_lens = np.zeros(B, dtype=np.int32)
        if step is not None:
            n = step.num_reqs
            req_slot[:n], req_shift[:n], q_lens[:n] = step.req_slot, step.req_shift, step.q_lens
        shared = choose_shared(req_slot, q_lens, min_group if with_level else NEVER)
        req_pages = np.where((req_slot >= 0) & ~shared, req_shift // self.page_size, 0).astype(np.int32)
        token_group = np.full(T, -1, dtype=np.int32)
        taken = np.repeat(np.where(shared, req_slot, -1), q_lens)
        token_group[: taken.shape[0]] = taken
        perm, cu, row_index = group_rows(token_group, G)
        lens = np.zeros(G, dtype=np.int32)
        lens[req_slot[shared]] = req_shift[shared]
        rows = min(T, self.max_rows) if graph else perm.shape[0]
        if perm.shape[0] > self.max_rows:
            raise RuntimeError(f"vllm-relay: {perm.shape[0]} shared rows, more than {self.max_rows}")
        tiles = n_tiles = splits = None
        if self.level_kernel != "flash":
            n_tiles = max_tiles(rows, G, self.gqa)
            splits = level_splits(rows, self.gqa, self.hkv, self.num_sms)
            tiles = plan_tiles(cu, n_tiles, self.gqa)
        self._stage([req_pages, req_slot, perm, cu, lens, tiles, row_index], B, rows, T)
        self._sync_slot_pages()
        if self.ctx_table is None:
            self.ctx_table = torch.zeros(self.ctx_lens.shape[0], cm.block_table_tensor.shape[1],
                                         dtype=torch.int32, device=self.device)
        ctx_table, ctx_lens = self.ctx_table[:B], self.ctx_lens[:B]
        prefix_block_table(cm.block_table_tensor[:B], cm.seq_lens[:B], self.req_pages[:B], self.req_slot[:B],
                           self.slot_pages, self.page_size, ctx_table, ctx_lens)
        max_seq_len = cm.max_seq_len + int(req_pages.max(initial=0)) * self.page_size
        # Host copies and caches derived from the own lengths would be stale: drop them.
        context = dataclasses.replace(cm, seq_lens=ctx_lens, block_table_tensor=ctx_table, max_seq_len=max_seq_len,
                                      seq_lens_cpu_upper_bound=None, _seq_lens_cpu=None,
                                      _num_computed_tokens_cpu=None, _num_computed_tokens_cache=None)
        if not capture:
            self.stats["planned_steps"] += 1
            self.stats["graph_steps"] += graph
            self.stats["prefix_requests"] += int(np.count_nonzero(req_pages))
            self.stats["shared_tokens"] += perm.shape[0]
        group_sizes = np.diff(cu)
        call = dict(cu_seqlens_q=self.cu, seqused_k=self.lens,
                    max_seqlen_q=rows if graph else int(group_sizes.max(initial=0)),
                    max_seqlen_k=self.max_pages * self.page_size if graph else int(lens.max(initial=0)),
                    block_table=self.slot_pages)
        if self.level_kernel == "flash":
            level = SharedLevel(perm=self.perm[:rows], row_index=self.row_index[:T], call=call,
                                q_buf=self.q_buf[:rows], out_buf=self.out_buf[:rows])
        else:
            fused = dict(perm=self.perm[:rows], tiles=self.tiles[:n_tiles], group_pages=self.slot_pages,
                         group_lens=self.lens, ws=self.ws, num_splits=splits)
            level = SharedLevel(perm=self.perm[:rows], row_index=self.row_index[:T], call=call, fused=fused)
        run_level = (capture and with_level) or perm.shape[0] > 0
        return StepPlan(context, level, run_level=run_level, graph=graph and with_level)

    def _stage(self, arrays, B: int, rows: int, T: int) -> None:
        """Write the host arrays into the staging buffer (perm padded with token 0 up to `rows`,
        row_index with -1 up to T) and copy the used span to the device in one transfer."""
        host, off = self._host_np, self._offsets
        req_pages, req_slot, perm, cu, lens, tiles, row_index = arrays
        host[off[0]: off[0] + B] = req_pages
        host[off[1]: off[1] + B] = req_slot
        host[off[2]: off[2] + rows] = 0
        host[off[2]: off[2] + perm.shape[0]] = perm
        host[off[3]: off[3] + cu.shape[0]] = cu
        host[off[4]: off[4] + lens.shape[0]] = lens
        if tiles is not None:
            host[off[5]: off[5] + tiles.size] = tiles.reshape(-1)
        host[off[6]: off[6] + T] = row_index
        end = int(off[6]) + T
        self._dev[:end].copy_(self._host[:end], non_blocking=self.device.type == "cuda")

    def _sync_slot_pages(self) -> None:
        if self.pages.version != self._pages_version:
            self._pages_version = self.pages.version
            self.slot_pages.copy_(torch.from_numpy(self.pages.pages))
