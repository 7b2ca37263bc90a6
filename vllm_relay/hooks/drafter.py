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
"""

import torch

from vllm_relay.hooks._patch import swap


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


def attach(runner) -> bool:
    """Put relay in the way of `runner`'s speculator when it drafts several tokens a step; False when
    there is none such (one draft token a step needs nothing: the first pass is the target's)."""
    spec = getattr(runner, "speculator", None)
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
