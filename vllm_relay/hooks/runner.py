"""Worker hooks on vLLM's V1 model runner, which vLLM's CPU build runs: relay requests' positions and
the step's relay facts. (On GPUs relay runs on Model Runner V2: hooks/model_runner.py.)

A drafter model proposing several tokens a step (EAGLE-3, MTP) runs its first pass on the target
step's metadata, slots and shifted positions, then one pass a further token, one token a row, moving
its positions on (`_update_positions_dependent_metadata`) and building its own metadata.
`DraftPositions` stands in for that method on the runner's drafter (an instance swap): vLLM computes
the pass's slots from each row's own position (a relay request's paged KV holds its own tokens from 0),
the model sees the shifted one, and the drafter's relay builders get the pass's step, a token a row.

vLLM's n-gram drafter (`NgramProposer`) searches each request's token ids, which for a relay request leave
its system prompt out: `NgramLookup` stands in for its `propose` (an instance swap) and hands it each relay
request's list with its slot's system tokens in front (kept from the slot's fill request), as vLLM holds
the full prompt: vLLM's drafts.
"""

import numpy as np
import torch

from vllm_relay.hooks._patch import original, patch, swap
from vllm_relay.protocol import relay_enabled


def _prepare_inputs(self, scheduler_output, num_scheduled_tokens):
    result = original(_GPUModelRunner, "_prepare_inputs")(self, scheduler_output, num_scheduled_tokens)
    if relay_enabled(self.vllm_config):
        from vllm_relay.attention import step, workers

        relay = getattr(self, "_relay", None)
        if relay is None:  # this runner's slot pages and choice, made once
            from vllm_relay.config import RelayConfig

            cfg = RelayConfig.from_vllm(self.vllm_config.additional_config)
            groups = len(self.kv_cache_config.kv_cache_groups)
            relay = (step.SlotPages.for_config(cfg, self.cache_config.block_size, groups),
                     cfg.auto_levels and cfg.shared_path != "never")
            swap(self, "_relay", relay)
            DraftPositions.attach(self)
            NgramLookup.attach(self, cfg)
        pages, auto_levels = relay
        found = workers.planners(self.attn_groups)
        level = workers.level_planner(found)
        found += workers.drafter_planners(self)
        current = step.prepare(self, num_scheduled_tokens, pages, self.cache_config.block_size,
                               -1 if level is None else level.kv_group, auto_levels)
        lookup = getattr(getattr(self, "drafter", None), "propose", None)
        if isinstance(lookup, NgramLookup):
            lookup.note_fills(self._relay_rows)
        for planner in found:  # the step, for the builders (until it ends: `_execute_model`)
            planner.current = current
        if current is not None and level is not None:
            level.levels_for(current)
    return result


class DraftPositions:
    """The drafter's `_update_positions_dependent_metadata` (vLLM's `SpecDecodeBaseProposer`) on relay."""

    def __init__(self, runner, update) -> None:
        self.runner, self.update = runner, update

    @classmethod
    def attach(cls, runner) -> None:
        drafter = getattr(runner, "drafter", None)
        update = getattr(drafter, "_update_positions_dependent_metadata", None)
        if update is not None and getattr(drafter, "num_speculative_tokens", 1) > 1:
            swap(drafter, "_update_positions_dependent_metadata", cls(runner, update))

    def __call__(self, positions, common_attn_metadata, batch_size: int, input_batch_size: int,
                 block_size: int):
        from vllm.v1.spec_decode.llm_base_proposer import PADDING_SLOT_ID

        from vllm_relay.attention import step, workers

        runner, drafter = self.runner, self.runner.drafter
        rows = getattr(runner, "_relay_rows", None)
        if rows is None or len(rows.ids) < batch_size:
            raise RuntimeError(f"vllm-relay: a drafter pass of {batch_size} rows without the step's rows")
        req_shift = rows.req_shift[:batch_size]
        shift = None
        if req_shift.any():  # vLLM's slots from the own positions
            shift = torch.from_numpy(req_shift.astype(np.int64)).to(positions.device)
            positions = positions.clone()
            (positions[0] if drafter.uses_mrope else positions).sub_(shift)
        out = self.update(positions, common_attn_metadata, batch_size, input_batch_size, block_size)
        if shift is not None:  # the model's positions shifted back; past the model's length as vLLM has them
            moved = out[0] if drafter.uses_mrope else out
            moved.add_(shift)
            past = moved >= drafter.max_model_len
            if past.any():
                moved.masked_fill_(past, 0)
                common_attn_metadata.slot_mapping.masked_fill_(past, PADDING_SLOT_ID)
                common_attn_metadata.seq_lens.masked_fill_(past, 1)
            if drafter.uses_mrope:
                out[1:] = out[0]
        draft = step.RelayStep(batch_size, batch_size, rows.req_slot[:batch_size], req_shift,
                               np.ones(batch_size, dtype=np.int32), pages=runner._relay[0], level_group=-1)
        for planner in workers.drafter_planners(runner):  # (until the step ends: `_end_step`)
            planner.current = draft
        return out


class NgramLookup:
    """vLLM's n-gram drafter's `propose` on relay: a relay request's token list is its slot's system tokens
    (`slot_tokens`, from the slot's fill request) and then its own, as vLLM's would be."""

    def __init__(self, runner, propose, slots: int, width: int) -> None:
        self.runner, self.propose = runner, propose
        self.slot_tokens = np.zeros((slots, width), dtype=np.int32)
        self.ids = None  # the token lists of a step with relay requests (vLLM's `token_ids_cpu`'s shape)

    @classmethod
    def attach(cls, runner, cfg) -> None:
        from vllm.v1.spec_decode.ngram_proposer import NgramProposer

        from vllm_relay.attention.step import slot_shape

        drafter = getattr(runner, "drafter", None)
        if type(drafter) is NgramProposer:
            page_size = runner.cache_config.block_size
            slots, pages = slot_shape(cfg, page_size)
            swap(drafter, "propose", cls(runner, drafter.propose, slots, pages * page_size))

    def note_fills(self, rows) -> None:
        """Keep the system tokens of the step's fill requests (each one's prompt begins with its slot's)."""
        for i, slot, _ in rows.fills:
            ids = self.runner.requests[rows.ids[i]].prompt_token_ids[: self.slot_tokens.shape[1]]
            self.slot_tokens[slot, : len(ids)] = ids

    def __call__(self, num_speculative_tokens, sampled_token_ids, num_tokens_no_spec, token_ids_cpu,
                 slot_mappings=None):
        rows, B = getattr(self.runner, "_relay_rows", None), len(sampled_token_ids)
        if rows is None or not rows.req_shift[:B].any():
            return self.propose(num_speculative_tokens, sampled_token_ids, num_tokens_no_spec, token_ids_cpu,
                                slot_mappings=slot_mappings)
        if len(rows.ids) < B:
            raise RuntimeError(f"vllm-relay: n-gram drafts for {B} rows of a step of {len(rows.ids)}")
        if self.ids is None:
            self.ids = np.zeros_like(token_ids_cpu)
        ids, lens = self.ids, num_tokens_no_spec.copy()
        for i in range(B):
            if not sampled_token_ids[i]:  # (vLLM drafts nothing for it)
                continue
            n, s = int(num_tokens_no_spec[i]), int(rows.req_shift[i])
            end = min(s + n, ids.shape[1])
            ids[i, :s] = self.slot_tokens[rows.req_slot[i], :s]
            ids[i, s:end] = token_ids_cpu[i, : end - s]
            lens[i] = s + n
        return self.propose(num_speculative_tokens, sampled_token_ids, lens, ids, slot_mappings=slot_mappings)


def _relay_worker_stats(self) -> dict:
    """What this worker's relay planners did (`attention.workers.worker_stats`), for the engine
    core's `collective_rpc("relay_worker_stats")`."""
    from vllm_relay.attention.workers import worker_stats

    return worker_stats(self)


def _end_step(runner) -> None:
    """Take the step back from every planner: dummy and profiling runs never see it."""
    if relay_enabled(runner.vllm_config):
        from vllm_relay.attention import workers

        for planner in workers.planners(runner.attn_groups) + workers.drafter_planners(runner):
            planner.current = None


def _execute_model(self, *args, **kwargs):
    deferred = False
    try:
        out = original(_GPUModelRunner, "execute_model")(self, *args, **kwargs)
        deferred = out is None  # sampling and the drafter's forward follow in `sample_tokens`
        return out
    finally:
        if not deferred:
            _end_step(self)


def _sample_tokens(self, *args, **kwargs):
    try:
        return original(_GPUModelRunner, "sample_tokens")(self, *args, **kwargs)
    finally:
        _end_step(self)


_GPUModelRunner = None


def apply_worker_stats() -> None:
    from vllm.v1.worker.worker_base import WorkerBase

    patch(WorkerBase, "relay_worker_stats", _relay_worker_stats)


def apply_worker() -> None:
    """Workers of vLLM's V1 runner only (the CPU's), called by the relay CPU metadata builders
    (which only workers construct), so that the front end never imports the model runner."""
    global _GPUModelRunner
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    _GPUModelRunner = GPUModelRunner
    patch(GPUModelRunner, "_prepare_inputs", _prepare_inputs)
    patch(GPUModelRunner, "execute_model", _execute_model)
    patch(GPUModelRunner, "sample_tokens", _sample_tokens)
    apply_worker_stats()
