"""A drafter proposing several tokens a step on Model Runner V2 (vLLM's EAGLE-3 speculator), on relay.

vLLM's speculator runs the draft model once over the target step's tokens (its first pass, reusing
the target's attention metadata, slot mappings and positions: relay's, already shifted by each
request's system length) and then once per further draft token, one token a row. For those later
passes it computes its own slot mappings, from positions that moved on from the shifted ones, and
builds its own attention metadata through the drafter's metadata builders.

* Slots: a relay request's paged KV holds its own tokens from position 0, so a slot computed from a
  shifted position lies past the request's blocks. `OwnPositionSlots` stands in for the runner's
  block tables on the speculator (only there: the target's own slot mappings are computed before the
  shift) and takes each batch row's shift off the positions before vLLM's slot kernel reads them.
* Metadata: relay's builders of the drafter's layers read the model state's `draft_step` (each row's
  system slot), so the later passes attend to the system prompt's pages as the first does.
* vLLM's in-place update of draft metadata between passes (FlashAttention's
  `update_draft_decode_metadata`) knows nothing of relay's context tables: relay's builders say they
  do not support it (`supports_draft_decode_metadata_update`), so vLLM builds each pass's metadata.

vLLM's n-gram speculator searches each request's own token ids for its drafts; a relay request's leave its
system prompt out, so vLLM's search would miss every match there (and give other drafts than vLLM's, and
other seeded samples). `RelayNgramSpeculator` (the instance's class swapped) makes vLLM's drafts with
`ops.ngram_drafts`, which reads the slot's system tokens in front of the own ones.
"""

import torch
from vllm.v1.worker.gpu.spec_decode.ngram.speculator import NgramGPUSpeculator

from vllm_relay.hooks._patch import swap
from vllm_relay.ops.ngram import ngram_drafts


class OwnPositionSlots:
    """The runner's `BlockTables` as the speculator sees it: every attribute is the real one's, but
    `compute_slot_mappings` reads the positions less each batch row's system shift (`row_shift`, the
    model state's). The speculator calls it for its passes of one token a row."""

    def __init__(self, block_tables, row_shift: torch.Tensor) -> None:
        self._tables = block_tables
        self._row_shift = row_shift
        self._own = torch.zeros_like(row_shift)

    def __getattr__(self, name):
        return getattr(self._tables, name)

    def compute_slot_mappings(self, idx_mapping, query_start_loc, positions, num_tokens_padded, out=None):
        n = positions.shape[0]
        if n > self._own.shape[0] or n < idx_mapping.shape[0]:
            raise RuntimeError(f"vllm-relay: a drafter pass of {n} positions for {idx_mapping.shape[0]} "
                               "requests; relay shifts positions of one token a request here")
        own = self._own[:n]
        torch.sub(positions, self._row_shift[:n], out=own)
        own.clamp_(min=0)  # (dummy runs: rows without a request)
        return self._tables.compute_slot_mappings(idx_mapping, query_start_loc, own, num_tokens_padded, out)


class RelayNgramSpeculator(NgramGPUSpeculator):
    """vLLM's n-gram speculator, its drafts searched in each request's [system tokens ; own tokens]."""

    relay_state = None  # the runner's RelayModelState

    def propose(self, input_batch, attn_metadata, slot_mappings, last_hidden_states, aux_hidden_states,
                num_sampled, num_rejected, last_sampled, next_prefill_tokens, temperature, seeds,
                dp_sync_state=None, dummy_run: bool = False, skip_attn_for_dummy_run: bool = False,
                mm_inputs=None, is_profile: bool = False,
                num_speculative_tokens: int | None = None) -> torch.Tensor:
        if dummy_run:
            return self.drafts[: input_batch.num_reqs]
        state, req = self.relay_state, self.req_states
        return ngram_drafts(req.all_token_ids.gpu, input_batch.idx_mapping, req.total_len.gpu, num_sampled,
                            last_sampled, state.slot_tokens, state.row_slot, state.row_shift, self.scratch,
                            self.drafts, self.max_model_len, self.min_n, self.max_n, self.block_l)


def attach(runner) -> bool:
    """Put relay in the way of `runner`'s speculator when it drafts several tokens a step, or looks its
    drafts up in the token ids (n-gram); False when there is none such (one draft token a step of a
    drafter model needs nothing: the first pass is the target's)."""
    spec = getattr(runner, "speculator", None)
    if type(spec) is NgramGPUSpeculator:
        runner.model_state.attach_drafter(tokens=True)
        swap(spec, "__class__", RelayNgramSpeculator)
        swap(spec, "relay_state", runner.model_state)
        return True
    if spec is None or getattr(spec, "num_speculative_steps", 1) <= 1 or not hasattr(spec, "block_tables"):
        return False
    state = runner.model_state
    state.attach_drafter()
    for groups in spec.attn_groups:
        for group in groups:
            for builder in group.metadata_builders:  # (one per micro-batch)
                if getattr(builder, "takes_relay_step", False):
                    builder.draft_of = state  # relay's own builder: its later passes read `draft_step`
    swap(spec, "block_tables", OwnPositionSlots(spec.block_tables, state.row_shift))
    return True
