"""Finding a step's levels: when a shared run of pages becomes a level, and the search, once per step,
before vLLM picks the step's CUDA graph (`LevelFinder.levels_for`). A part of `RelayPlanner`, which
holds the measured rules' choices it reads (`planner.py`); the search itself is `ops.find_levels`."""

from __future__ import annotations

import numpy as np

from vllm_relay.attention import step as relay_step
from vllm_relay.attention.rules import MIN_SAVED_TOKENS, fills_tiles
from vllm_relay.ops.level_tree import LevelRule, LevelTree, find_levels, saved_bound


class LevelFinder:
    """`RelayPlanner`'s level search (its attributes: shared_path, levels, max_depth, max_groups,
    auto_levels, chunk_levels, max_level_query_len, gqa, page_size, num_slots, device, `_last`)."""

    def rule(self, max_groups: int | None = None) -> LevelRule | None:
        """When a shared run becomes a level (None: no levels at all), at most `max_groups` levels
        (default: as many as the plan's tables hold)."""
        if self.shared_path == "never" or not self.levels:
            return None
        max_groups = self.max_groups if max_groups is None else max_groups
        if self.shared_path == "always":
            return LevelRule(min_rows_root=1, min_rows=2, max_depth=self.max_depth, max_groups=max_groups)
        return LevelRule(min_rows_root=2, min_rows=2, min_saved_pages=1, max_depth=self.max_depth,
                         max_groups=max_groups)

    def levels_for(self, step: relay_step.RelayStep) -> None:
        """Find the step's levels into `step.tree` (None: none worth running). The runner hook calls
        this as soon as the step's inputs are prepared: vLLM then picks the CUDA graph by it. A
        decode step over the last decode step's rows (the hook's same row facts) reuses its tree
        when every level has two rows or more: a running request's pages never change and those it
        adds while decoding are its own (the prefix cache shares only full pages, found when a
        prompt is scheduled), so what two rows share stays as it is. A level of one row (a system
        prompt with `shared_path: always`) runs on over its row's pages as they fill: searched."""
        step.levels_planned = True
        decode = step.num_reqs > 0 and bool((step.q_lens == 1).all())  # a token per row
        if decode and self._last is not None and self._last[0] is step.req_slot:
            step.tree = self._last[1]
            return
        step.tree = self._find(step)
        fixed = step.tree is None or bool((step.tree.size >= 2).all())
        self._last = (step.req_slot, step.tree) if decode and fixed else None

    def _find(self, step: relay_step.RelayStep) -> LevelTree | None:
        # A decode batch that a full graph will run: as many levels as the graph holds (the
        # graph's capacity for this batch, which the padded batch's graph can only exceed).
        graph = self.runs_as_graph(step.num_tokens, int(step.q_lens.max(initial=0)))
        rule = self.rule(self.graph_capacity(step.num_tokens)[1] if graph else None)
        least = MIN_SAVED_TOKENS["cuda" if self.device.type == "cuda" else "cpu", self.gqa > 1]
        if rule is None or (self.shared_path == "auto" and least == float("inf")):
            return None
        can = self._can_share(step)
        root = np.where(can, step.req_slot, -1)
        if self.auto_levels and step.block_table is not None:
            shareable = np.where(can, (step.seq_lens - step.q_lens) // self.page_size, 0)
            table = step.block_table
        else:
            shareable, table = np.zeros(step.num_reqs, dtype=np.int32), np.zeros((step.num_reqs, 1), np.int32)
        if not (root >= 0).any() and not (shareable > 0).any():
            return None
        root_pages = self._root_pages(step)
        if self.shared_path == "auto" and saved_bound(shareable, root, root_pages) * self.page_size < least:
            return None  # no levels could pay: the search itself is skipped (most small steps)
        tree = find_levels(table, shareable, root, root_pages, rule)
        if tree.num_groups == 0:
            return None
        if self.shared_path == "auto" and tree.saved_pages() * self.page_size < least:
            return None  # too little to pay the levels' launches: every request reads its own pages
        return tree

    def _can_share(self, step) -> np.ndarray:
        """Rows that may read levels: any row, as a level's pages all precede its first query token
        (a decode token, or a prompt chunk whose shared part is cached: the n samples of a prompt,
        requests over one document). With shared_path "auto", not a chunk that fills its own query
        tiles (`fills_tiles`). Never a request of more than `max_level_query_len` tokens this step
        (None: no bound): an MLA backend computes longer chunks in another form."""
        can = step.q_lens > 0
        if self.shared_path == "auto" and not self.chunk_levels:
            can &= ~fills_tiles(step.q_lens, self.gqa)
        if self.max_level_query_len is not None:
            can &= step.q_lens <= self.max_level_query_len
        return can

    def _root_pages(self, step) -> np.ndarray:
        root_pages = np.zeros(self.num_slots, dtype=np.int32)
        relay = step.req_slot >= 0
        root_pages[step.req_slot[relay]] = step.req_shift[relay] // self.page_size
        return root_pages
