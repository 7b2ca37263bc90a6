"""The relay backend on CUDA: vLLM's FlashAttention backend, extended.

Subclassing keeps FlashAttention's KV-cache layout, cache writes (`reshape_and_cache_flash`),
AOT scheduling and validation consistent with the vLLM release we pin. Relay changes only what it
must: it declares the narrower feature set that relay attention computes exactly, and never lets
vLLM's own cascade attention run underneath it.
"""

from vllm.v1.attention.backends.flash_attn import (
    FlashAttentionBackend,
    FlashAttentionImpl,
    FlashAttentionMetadataBuilder,
)
from vllm.v1.attention.backend import AttentionType

from vllm_relay.attention.common import check_layer, log_active


class RelayAttentionBackend(FlashAttentionBackend):
    @staticmethod
    def get_name() -> str:
        return "CUSTOM"  # the enum member `relay` aliases; see vllm_relay.register

    @staticmethod
    def get_impl_cls() -> type["RelayAttentionImpl"]:
        return RelayAttentionImpl

    @staticmethod
    def get_builder_cls() -> type["RelayMetadataBuilder"]:
        return RelayMetadataBuilder

    @classmethod
    def supports_sliding_window(cls) -> bool:
        return False

    @classmethod
    def supports_sink(cls) -> bool:
        return False

    @classmethod
    def supports_mm_prefix(cls) -> bool:
        return False

    @classmethod
    def supports_attn_type(cls, attn_type: str) -> bool:
        return attn_type == AttentionType.DECODER

    @classmethod
    def supports_kv_cache_dtype(cls, kv_cache_dtype) -> bool:
        return kv_cache_dtype in (None, "auto", "float16", "bfloat16")


class RelayMetadataBuilder(FlashAttentionMetadataBuilder):
    def use_cascade_attention(self, *args, **kwargs) -> bool:
        return False  # relay replaces cascade attention; never stack the two


class RelayAttentionImpl(FlashAttentionImpl):
    def __init__(self, num_heads, head_size, scale, num_kv_heads, alibi_slopes, sliding_window,
                 kv_cache_dtype, logits_soft_cap=None, attn_type=AttentionType.DECODER,
                 kv_sharing_target_layer_name=None, sinks=None) -> None:
        check_layer("CUDA", alibi_slopes=alibi_slopes, sliding_window=sliding_window,
                    logits_soft_cap=logits_soft_cap, attn_type=attn_type, sinks=sinks,
                    kv_sharing_target_layer_name=kv_sharing_target_layer_name)
        super().__init__(num_heads, head_size, scale, num_kv_heads, alibi_slopes, sliding_window,
                         kv_cache_dtype, logits_soft_cap, attn_type, kv_sharing_target_layer_name,
                         sinks)
        log_active(f"cuda-flash-attn-{self.vllm_flash_attn_version} (vllm.vllm_flash_attn)")
