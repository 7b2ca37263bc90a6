"""This step's relay facts, gathered once per step before the attention metadata is built.

The model runner knows which requests are relay or fill requests (their `RelayTag`); the
attention metadata builders only see `CommonAttentionMetadata`. On Model Runner V2 (GPUs) the relay
model state (`attention/model_state.py`) records the step's per-request facts in a `RelayStep` and
hands it to the builders with the metadata it asks for. On vLLM's V1 runner (the CPU's) the runner
hook (vllm_relay.hooks.runner) records them (`prepare`), right after the runner has prepared its
inputs, and hands the step to the relay planners of the runner's own metadata builders until the
step ends, so dummy and profiling runs never see a stale step.

A fill request is an ordinary request computing a system prompt into pages of the paged KV cache;
the scheduler keeps those pages (engine/pages.py keeps them when the fill finishes). Each step
records the fills' pages, per KV-cache group and slot, in the `SlotPages` of whoever prepares the
steps (the model state, or the V1 runner), and the step carries them to the planners, so relay
requests of a slot read them. A model whose sliding-window and full-attention layers vLLM keeps in
two KV-cache groups has pages of both kinds; levels are found in one group's tables (`level_group`:
the first group whose planner may run levels), and the other groups' layers read no level.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from vllm_relay.hooks._patch import swap
from vllm_relay.protocol import read_tag


@dataclass
class RelayStep:
    """Per request of the step, in the runner's batch order (first `num_reqs` rows)."""

    num_reqs: int
    num_tokens: int
    req_slot: np.ndarray  # int32 [B]: system slot of each relay request, -1 otherwise
    req_shift: np.ndarray  # int32 [B]: its system tokens (whole pages), 0 otherwise
    q_lens: np.ndarray  # int32 [B]: tokens scheduled this step
    # The host copy of vLLM's block table ([>= B, W], the runner's own buffer: read it this step
    # only) and each request's KV tokens in it after this step; None where no levels are found.
    block_table: np.ndarray | None = None
    seq_lens: np.ndarray | None = None
    # The step's shared levels (an ops.LevelTree, found by the planner before vLLM picks the CUDA
    # graph), None for none; and which full graph vLLM runs it with: True the one with the levels,
    # False vLLM's own, None no full graph (hooks/graphs.py), and whether that graph's joint call
    # was captured unsplit.
    tree: object | None = None
    levels_planned: bool = False
    graph_levels: bool | None = None
    graph_unsplit: bool = False
    # Each slot's system pages, as the step's preparer last saw their fills (None: no slot read).
    pages: SlotPages | None = None
    # The KV-cache group whose block table `block_table` is and `tree` indexes (-1: none).
    level_group: int = 0
    # Each KV-cache group's host block table, as `block_table` (a sliding-window group's planner checks
    # the levels against its own: ops/window_rows.py): the level group's and window groups' at least
    # (Model Runner V2 copies no other), None where no levels are found.
    tables: list[np.ndarray] | None = None


def slot_shape(cfg, page_size: int) -> tuple[int, int]:
    """(slots, pages per slot) of a worker's slot pages: `cfg.max_prompts` slots of up to
    `cfg.max_prompt_tokens // page_size` whole pages."""
    return cfg.max_prompts, max(1, cfg.max_prompt_tokens // page_size)


class SlotPages:
    """The pages of each slot's system prompt in each KV-cache group, as the worker last saw its fill
    (host side)."""

    def __init__(self, num_slots: int, max_pages: int, num_groups: int = 1) -> None:
        self.pages = np.zeros((num_groups, num_slots, max_pages), dtype=np.int32)
        self.version = 0

    @classmethod
    def for_config(cls, cfg, page_size: int, num_groups: int = 1) -> SlotPages:
        return cls(*slot_shape(cfg, page_size), num_groups)

    def record(self, group: int, slot: int, block_ids) -> None:
        n = min(len(block_ids), self.pages.shape[2])
        if not np.array_equal(self.pages[group, slot, :n], block_ids[:n]):
            self.pages[group, slot, :n] = block_ids[:n]
            self.version += 1


def covering(step: RelayStep | None, num_reqs: int, num_tokens: int) -> RelayStep | None:
    """`step`, if the metadata being built (`num_reqs`, `num_tokens`) covers it.

    Full CUDA graphs pad a batch (more requests and tokens than scheduled; padded requests have
    no KV and no relay part), which is fine. Fewer than scheduled means the batch was split
    (micro-batching), which relay does not plan for: that raises rather than silently dropping
    the system part of some tokens.
    """
    if step is not None and (num_reqs < step.num_reqs or num_tokens < step.num_tokens):
        raise RuntimeError(f"vllm-relay: attention metadata for {num_reqs} requests / {num_tokens} tokens, "
                           f"but the step prepared {step.num_reqs} / {step.num_tokens}")
    return step


def _tag(state):
    """A request's RelayTag, parsed once and kept on the runner's request state."""
    try:
        return state._vllm_relay_tag
    except AttributeError:
        tag = read_tag(state.sampling_params)
        try:
            swap(state, "_vllm_relay_tag", tag)
        except AttributeError:  # a slotted state: parse every step
            pass
        return tag


@dataclass
class _BatchRows:
    """The relay facts of a batch's requests, in batch order, kept while the batch holds the same
    request ids in the same rows (most decode steps): a step then reads no request's state. An id
    is one request while it lives (vLLM makes every request's id unique; a fill's names its
    prompt's registration), and a request's tag never changes."""

    ids: list
    req_slot: np.ndarray  # int32 [B], read-only: steps share it
    req_shift: np.ndarray
    fills: list  # (row, slot, system pages) of each fill request


def _batch_rows(runner, num_reqs: int, page_size: int) -> _BatchRows:
    ids = runner.input_batch.req_ids[:num_reqs]
    rows = getattr(runner, "_relay_rows", None)
    if rows is not None and rows.ids == ids:  # compares the id objects first: no string is read
        return rows
    req_slot = np.full(num_reqs, -1, dtype=np.int32)
    req_shift = np.zeros(num_reqs, dtype=np.int32)
    fills = []
    for i, t in enumerate(map(_tag, map(runner.requests.__getitem__, ids))):
        if t is None:
            continue
        if t.fill:  # its pages become the slot's; it is an ordinary request otherwise
            fills.append((i, t.slot, t.system_len // page_size))
        else:
            req_slot[i], req_shift[i] = t.slot, t.system_len
    req_slot.flags.writeable = req_shift.flags.writeable = False
    rows = _BatchRows(ids, req_slot, req_shift, fills)
    swap(runner, "_relay_rows", rows)
    return rows


def _shift_buffer(runner):
    """The runner's pinned per-token shift buffer and its device twin (vLLM's CpuGpuBuffer, made
    once). A pageable source would make the copy synchronous with the stream on CUDA for large
    steps, and async scheduling would lose its overlap; reusing the pinned buffer is safe because
    `_prepare_inputs` runs inside the runner's `synchronize_input_prep`, as vLLM's own buffers."""
    buf = getattr(runner, "_relay_shift", None)
    if buf is None:
        buf = runner._make_buffer(runner.max_num_tokens, dtype=torch.int64)
        swap(runner, "_relay_shift", buf)
    return buf


def prepare(runner, num_scheduled_tokens: np.ndarray, pages: SlotPages, page_size: int,
            level_group: int = 0, auto_levels: bool = True) -> RelayStep | None:
    """The step's relay facts (None: none), relay requests' positions shifted, fills' pages noted.

    Called right after `GPUModelRunner._prepare_inputs`, which has already used the unshifted
    positions for the token gather and the slot mapping (the paged cache holds a relay request's
    own tokens from position 0); the shifted positions are what the model's RoPE sees. With
    `auto_levels`, every step is recorded with the host block table of `level_group` (the KV-cache
    group whose planner finds the levels; -1: none), relay requests or not.
    """
    batch = runner.input_batch
    num_reqs = batch.num_reqs
    rows = _batch_rows(runner, num_reqs, page_size)
    for i, slot, n in rows.fills:  # a fill's blocks grow as it runs: read them every step
        for group, block_ids in enumerate(runner.requests[rows.ids[i]].block_ids):
            pages.record(group, slot, block_ids[:n])
    counts = num_scheduled_tokens[:num_reqs].astype(np.int32)
    tables = every = None
    if auto_levels and level_group >= 0:  # vLLM's host block table of that group
        tables = (batch.block_table.block_tables[level_group].block_table.np,
                  (batch.num_computed_tokens_cpu[:num_reqs] + counts).astype(np.int32))
        every = [table.block_table.np for table in batch.block_table.block_tables]
    elif not rows.fills and not (rows.req_slot >= 0).any():
        return None
    total = int(counts.sum())
    if rows.req_shift.any():
        shift = _shift_buffer(runner)
        shift.np[:total] = np.repeat(rows.req_shift, counts)
        moved = shift.copy_to_gpu(total)
        runner.positions[:total] += moved
        if getattr(runner, "uses_mrope", False):  # a routed request is text: (p, p, p) in M-RoPE's sections
            runner.mrope_positions.gpu[:, :total] += moved
    return RelayStep(num_reqs, total, rows.req_slot, rows.req_shift, counts, *(tables or (None, None)),
                     pages=pages, level_group=level_group, tables=every)
