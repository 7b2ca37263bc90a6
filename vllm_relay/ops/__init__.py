"""Relay attention kernels and their torch references. Imports only torch, triton and numpy.

Public API (see each function's docstring for shapes and dtypes):
  * `relay_fusion` (+ `relay_fusion_torch`, `relay_fusion_triton`): LSE merge of a shared-level
    attention output into the context attention output; `fuse_in_place` (its module) merges every
    level a token reads in one launch, as `relay_attention` does.
  * `prefix_block_table` (+ `_torch`, `_triton`): block tables of a slot's pages, then a span of a
    request's own pages.
  * `gather_rows` (+ `_torch`, `_triton`): the levels' query rows, their count read on the device.
  * `varlen_attention_torch`: paged varlen attention with FlashAttention's keyword interface.
  * `find_levels`, `level_rows`, `LevelRule`, `LevelTree`: the host-side, once-per-step planning of
    the shared levels (the prefix tree of the step's block tables).
  * `RelayPlan`, `SharedLevel`, `relay_attention`: the context call and the shared levels composed
    (on a decode step, one call for both: `joint.joint_layout`, `fuse_in_place.fuse_joint`).
  * `latent_varlen`: MLA's latent attention (keys the whole latent vector, values its first part) through
    FlashAttention's split `q_v` form, for `relay_attention` over an MLA cache.
  * `ngram_drafts` (+ `ngram_drafts_reference`): vLLM's n-gram drafts over a request's system prompt
    tokens and its own, held apart.
  * `force_one_split`: one key split for every batch of a FlashAttention-3 call captured split;
    `graph_split_cap`: the split cap a captured FA3 call can use (its workspace, nothing else).
"""

from vllm_relay.ops.gather_rows import gather_rows, gather_rows_torch, gather_rows_triton
from vllm_relay.ops.latent import latent_varlen
from vllm_relay.ops.level_tree import LevelRule, LevelTree, find_levels, level_rows
from vllm_relay.ops.prefix_table import (
    prefix_block_table,
    prefix_block_table_torch,
    prefix_block_table_triton,
)
from vllm_relay.ops.relay_attention import RelayPlan, SharedLevel, relay_attention
from vllm_relay.ops.relay_fusion import relay_fusion, relay_fusion_torch, relay_fusion_triton
from vllm_relay.ops.split_schedule import force_one_split, graph_split_cap
from vllm_relay.ops.varlen_attention import varlen_attention_torch

__all__ = [
    "LevelRule",
    "LevelTree",
    "RelayPlan",
    "SharedLevel",
    "find_levels",
    "force_one_split",
    "graph_split_cap",
    "gather_rows",
    "gather_rows_torch",
    "gather_rows_triton",
    "latent_varlen",
    "level_rows",
    "prefix_block_table",
    "prefix_block_table_torch",
    "prefix_block_table_triton",
    "relay_attention",
    "relay_fusion",
    "relay_fusion_torch",
    "relay_fusion_triton",
    "varlen_attention_torch",
]
