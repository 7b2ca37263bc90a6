"""Relay attention kernels and their torch references. Imports only torch, triton and numpy.

Public API (see each function's docstring for shapes and dtypes):
  * `relay_fusion` (+ `relay_fusion_torch`, `relay_fusion_triton`): LSE merge of a shared-level
    attention output into the context attention output.
  * `prefix_block_table` (+ `_torch`, `_triton`): block tables with a shared prefix's pages in front.
  * `varlen_attention_torch`: paged varlen attention with FlashAttention's keyword interface.
  * `choose_shared`, `group_rows`: the host-side, once-per-step planning of the shared level.
  * `RelayPlan`, `SharedLevel`, `relay_attention`: the context call and the shared levels composed.
"""

from vllm_relay.ops.prefix_table import (
    prefix_block_table,
    prefix_block_table_torch,
    prefix_block_table_triton,
)
from vllm_relay.ops.relay_attention import RelayPlan, SharedLevel, relay_attention
from vllm_relay.ops.relay_fusion import relay_fusion, relay_fusion_torch, relay_fusion_triton
from vllm_relay.ops.relay_plan import SHARED_MAX_QUERY_LEN, choose_shared, group_rows
from vllm_relay.ops.varlen_attention import varlen_attention_torch

__all__ = [
    "SHARED_MAX_QUERY_LEN",
    "RelayPlan",
    "SharedLevel",
    "choose_shared",
    "group_rows",
    "prefix_block_table",
    "prefix_block_table_torch",
    "prefix_block_table_triton",
    "relay_attention",
    "relay_fusion",
    "relay_fusion_torch",
    "relay_fusion_triton",
    "varlen_attention_torch",
]
