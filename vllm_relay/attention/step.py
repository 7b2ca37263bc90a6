"""This step's relay facts, gathered once per step by the runner hook, read by the builders.

The model runner knows which requests are relay or fill requests (their `RelayTag`); the
attention metadata builders only see `CommonAttentionMetadata`. The runner hook
(vllm_relay.hooks.runner) therefore records the step's per-token facts here, right after the
runner has prepared its inputs, and clears them when the step ends, so dummy and profiling runs
(which prepare no inputs) never see a stale step.
"""

from dataclasses import dataclass

import numpy as np
import torch

from vllm_relay.protocol import read_tag


@dataclass
class RelayStep:
    num_tokens: int
    token_slot: np.ndarray  # [T] int32: system slot of each token of a relay request, else -1
    slot_lens: np.ndarray  # [num_slots] int32: system length of each slot used this step
    fill_src: torch.Tensor | None  # [F] token indices of fill requests (device)
    fill_dst: torch.Tensor | None  # [F] rows of the flattened system store (slot * S_max + position)

    @property
    def has_system(self) -> bool:
        return bool((self.token_slot >= 0).any())


_current: RelayStep | None = None


def current(num_actual_tokens: int) -> RelayStep | None:
    """The step's relay facts, if the metadata being built is for the step the runner prepared."""
    step = _current
    if step is not None and step.num_tokens != num_actual_tokens:
        # Padded or split batches (full CUDA graphs, micro-batching) would silently lose the
        # system part of relay tokens; relay declares no support for them, so this is a bug.
        raise RuntimeError(f"vllm-relay: attention metadata for {num_actual_tokens} tokens, but the "
                           f"step prepared {step.num_tokens}")
    return step


def clear() -> None:
    global _current
    _current = None


def prepare(runner, num_scheduled_tokens: np.ndarray, num_slots: int, slot_capacity: int) -> None:
    """Record the step's relay facts and shift relay requests' positions by their system length.

    Called right after `GPUModelRunner._prepare_inputs`, which has already used the unshifted
    positions for the token gather and the slot mapping (the paged cache holds only a relay
    request's own tokens); the shifted positions are what the model's RoPE sees.
    """
    global _current
    batch = runner.input_batch
    num_reqs = batch.num_reqs
    tags = [read_tag(runner.requests[rid].sampling_params) for rid in batch.req_ids[:num_reqs]]
    if not any(tags):
        _current = None
        return
    counts = num_scheduled_tokens[:num_reqs]
    total = int(counts.sum())
    starts = np.concatenate(([0], np.cumsum(counts)[:-1]))
    req_slot = np.full(num_reqs, -1, dtype=np.int32)
    req_shift = np.zeros(num_reqs, dtype=np.int64)
    slot_lens = np.zeros(num_slots, dtype=np.int32)
    fill_src, fill_dst = [], []
    for i, t in enumerate(tags):
        if t is None:
            continue
        if t.fill:
            first = int(batch.num_computed_tokens_cpu[i])
            n = max(0, min(int(counts[i]), t.system_len - first))  # never past the prompt's end
            fill_src.append(np.arange(starts[i], starts[i] + n))
            fill_dst.append(t.slot * slot_capacity + np.arange(first, first + n))
        else:
            req_slot[i], req_shift[i], slot_lens[t.slot] = t.slot, t.system_len, t.system_len
    device = runner.positions.device
    if req_shift.any():
        shift = torch.from_numpy(np.repeat(req_shift, counts))
        runner.positions[:total] += shift.to(device, non_blocking=True)
    src = dst = None
    if fill_src:
        src = torch.from_numpy(np.concatenate(fill_src)).to(device, non_blocking=True)
        dst = torch.from_numpy(np.concatenate(fill_dst)).to(device, non_blocking=True)
    _current = RelayStep(total, np.repeat(req_slot, counts), slot_lens, src, dst)
