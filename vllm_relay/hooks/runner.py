"""Worker hooks on vLLM's V1 model runner, which vLLM's CPU build runs: relay requests' positions and
the step's relay facts. (On GPUs relay runs on Model Runner V2: hooks/model_runner.py.)

A drafter model proposing several tokens a step (EAGLE-3, MTP) runs its first pass on the target
step's metadata, slots and shifted positions, then one pass a further token, one token a row, moving
its positions on (`_update_positions_dependent_metadata`) and building its own metadata.
`DraftPositions` stands in for that method on the runner's drafter (an instance swap): vLLM computes
the pass's slots from each row's own position (a relay request's paged KV holds its own tokens from 0),
the model sees the shifted one, and the drafter's relay builders get the pass's step, a token a row.
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
        pages, auto_levels = relay
        found = workers.planners(self.attn_groups)
        level = workers.level_planner(found)
        found += workers.drafter_planners(self)
        current = step.prepare(self, num_scheduled_tokens, pages, self.cache_config.block_size,
                               -1 if level is None else level.kv_group, auto_levels)
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
