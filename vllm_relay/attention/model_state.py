"""Relay on Model Runner V2: the model state of a relay engine, vLLM's own extension point.

vLLM's Model Runner V2 (`vllm/v1/worker/gpu/`) keeps what is particular to a kind of model in a
*model state* (`DefaultModelState` for decoder-only models): it learns of each new request, prepares
the model's inputs and builds the attention metadata. Relay's model state is vLLM's default one,
plus:

* each request's `RelayTag` (`add_request`), by the runner's request index: its system slot and
  shift, or the slot a fill request computes;
* a host copy of the runner's block tables, one per KV-cache group (MRV2 keeps its tables on the GPU
  only), kept from the scheduler output, for the fills' pages and for the levels found from the tables;
* the step: `plan` (called by the runner hook right after vLLM gathers the batch, before it picks
  the CUDA graph) records the step's facts in a `RelayStep` and has the planner find its levels, so
  the graph with the levels is picked only for a step that has some (hooks/graphs.py);
* positions: a relay request carries only its own tokens, which the paged cache holds from slot 0,
  so vLLM computes their slots from unshifted positions; right after that (`preprocess_state`, before
  the forward) relay shifts them in place by the request's system length, so RoPE, and MRV2's
  seeded sampler (whose noise is keyed by the position), see what they would for the full prompt;
* the step goes to the relay metadata builders with the metadata vLLM asks them for
  (`ModelSpecificAttnMetadata.get_extra_attn_kwargs`), and a graph being captured tells them
  whether it holds the levels (`capturing`);
* a drafter proposing several tokens a step (EAGLE-3): its first pass reuses the target step's
  metadata, slot mappings and shifted positions as vLLM hands them over; its later passes, one token a
  row, build their own metadata, which reads `draft_step` (the rows' system slots), and compute their
  slots from positions that have moved on from the shifted ones: `row_shift`, each batch row's shift
  on the device, is what `hooks.drafter.OwnPositionSlots` takes off them first;
* an n-gram drafter: vLLM's searches a request's own token ids, which leave its system prompt out;
  relay's (`hooks.drafter.RelayNgramSpeculator`) reads each slot's system tokens (`slot_tokens`, from
  the slot's fill request) in front of them, by each batch row's `row_slot` and `row_shift`.
"""

from __future__ import annotations

import numpy as np
import torch
from vllm.config.compilation import CUDAGraphMode
from vllm.utils.torch_utils import async_tensor_h2d
from vllm.v1.worker.gpu.model_states.default import DefaultModelState
from vllm.v1.worker.gpu.model_states.interface import ModelSpecificAttnMetadata

from vllm_relay.attention import step as relay_step
from vllm_relay.attention import workers
from vllm_relay.config import RelayConfig
from vllm_relay.protocol import read_tag


class RelayStepMetadata(ModelSpecificAttnMetadata):
    """Hands the step to relay's metadata builders (vLLM passes these kwargs to `build`)."""

    def __init__(self, step: relay_step.RelayStep | None) -> None:
        self.step = step

    def get_extra_attn_kwargs(self, attn_metadata_builder, num_reqs: int) -> dict:
        return {"relay_step": self.step} if getattr(attn_metadata_builder, "takes_relay_step", False) else {}


class HostBlockTable:
    """A host copy of MRV2's block table of KV-cache group `group`, rows by the runner's request index,
    written as vLLM writes its own: a new request's blocks from column 0, a running request's new
    blocks after its last."""

    def __init__(self, max_num_reqs: int, max_blocks: int, group: int = 0) -> None:
        self.group = group
        self.table = np.zeros((max_num_reqs, max_blocks), dtype=np.int32)
        self.count = np.zeros(max_num_reqs, dtype=np.int32)

    def write(self, row: int, block_ids, overwrite: bool) -> None:
        start = 0 if overwrite else int(self.count[row])
        end = min(start + len(block_ids), self.table.shape[1])  # vLLM's own write raises past its width
        self.table[row, start:end] = block_ids[: end - start]
        self.count[row] = end

    def update(self, scheduler_output, index_of) -> None:
        """The blocks `scheduler_output` gives its requests (`index_of`: request id -> row)."""
        for new in scheduler_output.scheduled_new_reqs:
            self.write(index_of[new.req_id], new.block_ids[self.group], overwrite=True)
        cached = scheduler_output.scheduled_cached_reqs
        for req_id, new_block_ids in zip(cached.req_ids, cached.new_block_ids):
            if new_block_ids is not None:
                self.write(index_of[req_id], new_block_ids[self.group], overwrite=False)


class RelayModelState(DefaultModelState):
    def __init__(self, vllm_config, model, encoder_cache, device) -> None:
        super().__init__(vllm_config, model, encoder_cache, device)
        cfg = RelayConfig.from_vllm(vllm_config.additional_config)
        self.page_size = vllm_config.cache_config.block_size
        self.cfg = cfg
        self.pages: relay_step.SlotPages | None = None  # the worker's, for every step (per KV-cache group)
        self.auto_levels = cfg.auto_levels and cfg.shared_path != "never"
        n = self.max_num_reqs
        self.req_slot = np.full(n, -1, dtype=np.int32)  # by request index: its system slot, -1 none
        self.req_shift = np.zeros(n, dtype=np.int32)  # its system tokens
        self.fill_pages = np.zeros(n, dtype=np.int32)  # a fill request's system pages (0: no fill)
        self.fill_slot = np.full(n, -1, dtype=np.int32)
        self.blocks: list[HostBlockTable] = []  # per KV-cache group
        self.step: relay_step.RelayStep | None = None
        self.planner = None  # the relay planner that finds the levels (attention/workers.level_planner)
        self.capturing = (False, False)  # the full graph being captured: (with the levels, unsplit)
        self.multi_token_graphs = False  # decodes of several tokens a request get graphs with levels too
        self._rows = None  # (request indices, req_slot, req_shift) of the last step's batch
        self._shift = None  # this step's per-token shift on the device, for M-RoPE's positions
        # A drafter's passes after its first (`attach_drafter`): their step, a token per row, and each
        # batch row's shift on the device (None: no such drafter).
        self.draft_step: relay_step.RelayStep | None = None
        self.draft_passes = False  # a drafter model's later passes read `draft_step` (n-gram drafts: none)
        self.row_shift: torch.Tensor | None = None
        # An n-gram drafter's lookup (`attach_drafter(tokens=True)`): each slot's system token ids, as its
        # fill request brought them, and each batch row's slot, on the device.
        self.slot_tokens: torch.Tensor | None = None
        self.row_slot: torch.Tensor | None = None

    # ---- requests -----------------------------------------------------------------------------

    def add_request(self, req_index: int, new_req_data) -> None:
        super().add_request(req_index, new_req_data)
        tag = read_tag(new_req_data.sampling_params)
        slot, shift, fill_slot, fill_pages = -1, 0, -1, 0
        if tag is not None and tag.fill:
            fill_slot, fill_pages = tag.slot, tag.system_len // self.page_size
            if self.slot_tokens is not None:  # (its prompt begins with the tokens its relay requests skip)
                ids = new_req_data.prompt_token_ids[: self.slot_tokens.shape[1]]
                self.slot_tokens[tag.slot, : len(ids)].copy_(torch.tensor(ids, dtype=torch.int32))
        elif tag is not None:
            slot, shift = tag.slot, tag.system_len
        self.req_slot[req_index], self.req_shift[req_index] = slot, shift
        self.fill_slot[req_index], self.fill_pages[req_index] = fill_slot, fill_pages
        self._rows = None  # the index may have held another request

    def initialize_kv_cache(self, kv_cache_config, block_tables) -> None:
        super().initialize_kv_cache(kv_cache_config, block_tables)
        groups = kv_cache_config.kv_cache_groups
        sizes = {group.kv_cache_spec.block_size for group in groups}
        if sizes != {self.page_size}:
            raise ValueError(f"vllm-relay needs every KV-cache group's block size to be {self.page_size} "
                             f"(this model's groups have {sorted(sizes)})")
        self.pages = relay_step.SlotPages.for_config(self.cfg, self.page_size, len(groups))
        self.blocks = [HostBlockTable(self.max_num_reqs, table.gpu.shape[1], g)
                       for g, table in enumerate(block_tables.block_tables)]

    def attach_drafter(self, tokens: bool = False) -> None:
        """A drafter whose passes after the first build their own attention metadata and slot mappings
        (hooks/drafter.py): from now on every step also records `draft_step` and `row_shift`; `tokens`: an
        n-gram drafter instead, which has no such passes and reads `row_shift`, each slot's system tokens
        (`slot_tokens`) and each row's `row_slot`."""
        self.draft_passes = self.draft_passes or not tokens
        if self.row_shift is None:
            self.row_shift = torch.zeros(self.max_num_reqs, dtype=torch.int64, device=self.device)
        if tokens and self.slot_tokens is None:
            slots, pages = relay_step.slot_shape(self.cfg, self.page_size)
            width = pages * self.page_size
            self.slot_tokens = torch.zeros(slots, width, dtype=torch.int32, device=self.device)
            self.row_slot = torch.zeros(self.max_num_reqs, dtype=torch.int32, device=self.device)

    # ---- the step -----------------------------------------------------------------------------

    def plan(self, scheduler_output, batch, req_states, attn_groups) -> None:
        """Record the step vLLM has just gathered (`batch`: MRV2's `BatchReqState`, None for a dummy
        run) and have the planner of the runner's `attn_groups` find its levels: called before vLLM
        picks the step's CUDA graph."""
        found = workers.planners(attn_groups)
        self.planner = workers.level_planner(found)
        if scheduler_output is not None:
            for blocks in self.blocks:
                blocks.update(scheduler_output, req_states.req_id_to_index)
        if batch is None:
            self.step = self.draft_step = None
            return
        idx = batch.idx_mapping_np
        num_reqs = idx.shape[0]
        rows = self._rows
        if rows is None or not np.array_equal(rows[0], idx):  # the same rows keep the same arrays
            req_slot, req_shift = self.req_slot[idx], self.req_shift[idx]
            req_slot.flags.writeable = req_shift.flags.writeable = False
            rows = self._rows = (idx.copy(), req_slot, req_shift)
        for i in np.flatnonzero(self.fill_pages[idx]):  # a fill's pages grow as it runs
            r = idx[i]
            for blocks in self.blocks:
                n = min(int(self.fill_pages[r]), int(blocks.count[r]))
                self.pages.record(blocks.group, int(self.fill_slot[r]), blocks.table[r, :n])
        counts = batch.num_scheduled_tokens[:num_reqs].astype(np.int32)
        table = seq_lens = tables = None
        level_group = -1 if self.planner is None else self.planner.kv_group
        if self.auto_levels and level_group >= 0:  # the rows' blocks so far, in batch order: the level
            # group's, and those of window groups (checked against the levels' pages, `attention/windows.py`)
            read = {level_group} | {p.kv_group for p in found if p.window and p.levels}
            tables = [blocks.table[idx, : max(1, int(blocks.count[idx].max(initial=0)))]
                      if blocks.group in read else None for blocks in self.blocks]
            table = tables[level_group]
            seq_lens = (req_states.num_computed_tokens_np[idx] + counts).astype(np.int32)
        self.step = relay_step.RelayStep(num_reqs, int(batch.num_tokens), rows[1], rows[2], counts, table,
                                         seq_lens, pages=self.pages, level_group=level_group, tables=tables)
        if self.draft_passes:  # the drafter's later passes: a token per row, no level
            self.draft_step = relay_step.RelayStep(num_reqs, num_reqs, rows[1], rows[2],
                                                   np.ones(num_reqs, dtype=np.int32), pages=self.pages,
                                                   level_group=-1)
        if self.planner is not None:
            self.planner.levels_for(self.step)

    def preprocess_state(self, input_batch, block_tables, kv_cache_config, num_computed_tokens) -> None:
        super().preprocess_state(input_batch, block_tables, kv_cache_config, num_computed_tokens)
        step, self._shift = self.step, None
        shifted = step is not None and step.req_shift.any()
        if shifted:  # vLLM has used the own positions for the slots
            shift = np.repeat(step.req_shift.astype(np.int64), step.q_lens)
            shift = async_tensor_h2d(shift, device=self.device)
            input_batch.positions[: shift.shape[0]] += shift
            self._shift = shift
        if self.row_shift is not None:  # every step: a drafter's slots take off this step's shifts
            if shifted:
                n = step.req_shift.shape[0]
                async_tensor_h2d(step.req_shift.astype(np.int64), out=self.row_shift[:n])
                if self.row_slot is not None:  # (a row with no shift reads no slot)
                    async_tensor_h2d(step.req_slot.astype(np.int32), out=self.row_slot[:n])
                self.row_shift[n:].zero_()
            else:
                self.row_shift.zero_()

    def prepare_inputs(self, input_batch, req_states) -> dict:
        """vLLM's model inputs; an M-RoPE model's positions (made here, after `preprocess_state`) shifted
        in every section: a routed request is text, whose positions are (p, p, p)."""
        inputs = super().prepare_inputs(input_batch, req_states)
        shift, self._shift = self._shift, None
        if shift is not None and self.rope_state is not None:
            self.rope_state.positions[:, : shift.shape[0]] += shift
        return inputs

    def prepare_attn(self, input_batch, cudagraph_mode, block_tables, slot_mappings, attn_groups,
                     kv_cache_config, for_capture: bool = False, ubatch_idx: int = 0,
                     model_specific_attn_metadata=None):
        if model_specific_attn_metadata is not None:
            raise RuntimeError("vllm-relay: unexpected model-specific attention metadata")
        if for_capture:  # a graph being captured, or a full dummy run replaying vLLM's graph
            for groups in attn_groups:
                for group in groups:
                    builder = group.get_metadata_builder(ubatch_idx)
                    if getattr(builder, "takes_relay_step", False):
                        builder.capturing = self.capturing
        step = None if for_capture else self.step
        if step is not None and cudagraph_mode != CUDAGraphMode.FULL:  # (DP ranks may agree on eager)
            step.graph_levels, step.graph_unsplit = None, False
        return super().prepare_attn(input_batch, cudagraph_mode, block_tables, slot_mappings, attn_groups,
                                    kv_cache_config, for_capture=for_capture, ubatch_idx=ubatch_idx,
                                    model_specific_attn_metadata=RelayStepMetadata(step))
