"""Relay attention kernels and their torch references. Imports only torch and triton.

Public API (see each function's docstring for shapes and dtypes):
  * `relay_fusion` (+ `relay_fusion_torch`, `relay_fusion_triton`): LSE merge of system and context
    attention outputs.
  * `varlen_attention_torch`: paged varlen attention with FlashAttention's keyword interface.
  * `SystemPlan`, `plan_system_attention`, `system_attention` (+ `system_attention_torch`): grouped
    attention of tagged tokens over their system-prompt slot.
  * `RelayPlan`, `relay_attention`: the three steps composed.
"""

from vllm_relay.ops.relay_attention import RelayPlan, relay_attention
from vllm_relay.ops.relay_fusion import relay_fusion, relay_fusion_torch, relay_fusion_triton
from vllm_relay.ops.system_attention import (
    SystemPlan,
    plan_system_attention,
    system_attention,
    system_attention_torch,
)
from vllm_relay.ops.varlen_attention import varlen_attention_torch

__all__ = [
    "RelayPlan",
    "SystemPlan",
    "plan_system_attention",
    "relay_attention",
    "relay_fusion",
    "relay_fusion_torch",
    "relay_fusion_triton",
    "system_attention",
    "system_attention_torch",
    "varlen_attention_torch",
]
