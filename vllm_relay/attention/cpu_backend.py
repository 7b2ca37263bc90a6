"""The relay backend on vLLM's CPU platform: pure torch, over a paged KV cache it owns.

It keeps FlashAttention's cache layout (logical [blocks, kv_heads, block_size, 2 * head_size],
physically block-major), so that the CPU and CUDA backends share one plan (the same planner) and
one attention path: `relay_attention` with `varlen_attention_torch` standing in for FlashAttention.
"""

from dataclasses import dataclass
from typing import ClassVar

import torch
from vllm.v1.attention.backend import (
    AttentionBackend,
    AttentionImpl,
    AttentionMetadataBuilder,
    AttentionType,
    CommonAttentionMetadata,
)

from vllm_relay.attention import step as relay_step
from vllm_relay.attention.common import check_engine, check_layer, log_active
from vllm_relay.attention.planner import RelayPlanner
from vllm_relay.ops import RelayPlan, relay_attention, varlen_attention_torch


class RelayCPUBackend(AttentionBackend):
    supported_dtypes: ClassVar[list[torch.dtype]] = [torch.float32, torch.bfloat16, torch.float16]
    supported_kv_cache_dtypes: ClassVar[list[str]] = ["auto", "float32", "float16", "bfloat16"]
    forward_includes_kv_cache_update = False

    @staticmethod
    def get_name() -> str:
        return "CUSTOM"  # the enum member `relay` aliases; see vllm_relay.register

    @staticmethod
    def get_impl_cls() -> type["RelayCPUImpl"]:
        return RelayCPUImpl

    @staticmethod
    def get_builder_cls() -> type["RelayCPUMetadataBuilder"]:
        return RelayCPUMetadataBuilder

    @staticmethod
    def get_kv_cache_shape(num_blocks, block_size, num_kv_heads, head_size, cache_dtype_str="auto"):
        return (num_blocks, num_kv_heads, block_size, 2 * head_size)

    @staticmethod
    def get_kv_cache_stride_order(include_num_layers_dimension: bool = False) -> tuple[int, ...]:
        # Physically [blocks, block_size, kv_heads, 2 * head_size], as FlashAttention's NHD.
        return (1, 0, 3, 2, 4) if include_num_layers_dimension else (0, 2, 1, 3)

    @classmethod
    def get_supported_head_sizes(cls) -> list[int]:
        return []  # any head size: torch has no tile constraints

    @classmethod
    def supports_compute_capability(cls, capability) -> bool:
        return True

    @classmethod
    def supports_attn_type(cls, attn_type: str) -> bool:
        return attn_type == AttentionType.DECODER


@dataclass
class RelayCPUMetadata:
    num_actual_tokens: int
    slot_mapping: torch.Tensor
    plan: RelayPlan


class RelayCPUMetadataBuilder(AttentionMetadataBuilder[RelayCPUMetadata]):
    def __init__(self, kv_cache_spec, layer_names, vllm_config, device) -> None:
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)
        from vllm_relay.hooks.runner import apply_worker

        apply_worker()
        self.planner = RelayPlanner(vllm_config, kv_cache_spec, device, num_layers=len(layer_names))

    def build(self, common_prefix_len: int, common_attn_metadata: CommonAttentionMetadata,
              fast_build: bool = False) -> RelayCPUMetadata:
        cm = common_attn_metadata
        plan = self.planner.plan(cm, relay_step.current(cm.num_reqs, cm.num_actual_tokens))
        ctx = cm if plan is None else plan.context
        context = dict(cu_seqlens_q=ctx.query_start_loc, seqused_k=ctx.seq_lens, max_seqlen_q=ctx.max_query_len,
                       max_seqlen_k=ctx.max_seq_len, block_table=ctx.block_table_tensor)
        shared = [plan.level] if plan is not None and plan.run_level else []
        return RelayCPUMetadata(cm.num_actual_tokens, cm.slot_mapping, RelayPlan(context, shared))


class RelayCPUImpl(AttentionImpl):
    def __init__(self, num_heads, head_size, scale, num_kv_heads, alibi_slopes, sliding_window,
                 kv_cache_dtype, logits_soft_cap=None, attn_type=AttentionType.DECODER,
                 kv_sharing_target_layer_name=None, sinks=None) -> None:
        check_layer("CPU", alibi_slopes=alibi_slopes, sliding_window=sliding_window,
                    logits_soft_cap=logits_soft_cap, attn_type=attn_type, sinks=sinks,
                    kv_sharing_target_layer_name=kv_sharing_target_layer_name)
        self.num_heads = num_heads
        self.head_size = head_size
        self.scale = float(scale)
        self.num_kv_heads = num_kv_heads
        check_engine()
        log_active("cpu-torch (paged varlen attention in torch)")

    def _split(self, kv_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # (blocks, kv_heads, block_size, 2D) -> two (blocks, block_size, kv_heads, D) views
        return kv_cache.transpose(1, 2).split(self.head_size, dim=-1)

    def do_kv_cache_update(self, layer, key, value, kv_cache, slot_mapping) -> None:
        key_cache, value_cache = self._split(kv_cache)
        n = slot_mapping.shape[0]  # key/value may be padded past the scheduled tokens
        keep = slot_mapping >= 0
        slots = slot_mapping[keep].long()
        # .view (never a copy): the writes must land in the cache itself.
        key_cache.view(-1, *key_cache.shape[2:])[slots] = key[:n][keep].to(key_cache.dtype)
        value_cache.view(-1, *value_cache.shape[2:])[slots] = value[:n][keep].to(value_cache.dtype)

    def forward(self, layer, query, key, value, kv_cache, attn_metadata, output,
                output_scale=None, output_block_scale=None) -> torch.Tensor:
        if output_scale is not None or output_block_scale is not None:
            raise NotImplementedError("fused output quantization is not supported by relay")
        if attn_metadata is None:  # profiling run
            return output
        n = attn_metadata.num_actual_tokens
        key_cache, value_cache = self._split(kv_cache)
        relay_attention(query[:n], key_cache, value_cache, attn_metadata.plan, output[:n], self.scale,
                        attn_fn=varlen_attention_torch)
        return output
