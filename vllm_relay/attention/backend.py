"""The relay backend on CUDA: vLLM's FlashAttention backend, extended.

Subclassing keeps FlashAttention's KV-cache layout, cache writes (`reshape_and_cache_flash`),
AOT scheduling and validation consistent with the vLLM release we pin. A step with no relay
tokens runs FlashAttention's own forward unchanged; a step with relay tokens runs
`ops.relay_attention` (context attention + grouped system attention + relay fusion) with
FlashAttention's varlen kernel; fill tokens also write their K/V into the system-prompt store.
"""

from vllm.v1.attention.backend import AttentionCGSupport, AttentionType
from vllm.v1.attention.backends import flash_attn
from vllm.v1.attention.backends.flash_attn import (
    FlashAttentionBackend,
    FlashAttentionImpl,
    FlashAttentionMetadataBuilder,
)

from vllm_relay.attention import step as relay_step
from vllm_relay.attention.common import (
    allocate_system_store,
    capture_fill,
    check_layer,
    log_active,
    relay_config,
    relay_plan,
)
from vllm_relay.ops import relay_attention


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
    # NOTE: a captured full graph would replay the plain path for relay steps; until the relay
    # path is graph-safe, attention runs eagerly between piecewise graphs.
    _cudagraph_support = AttentionCGSupport.NEVER

    def __init__(self, kv_cache_spec, layer_names, vllm_config, device):
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)
        from vllm_relay.hooks.runner import apply_worker

        apply_worker()
        self.relay_config = relay_config()

    def build(self, common_prefix_len, common_attn_metadata, fast_build: bool = False):
        meta = super().build(0, common_attn_metadata, fast_build)  # relay replaces cascade
        step = relay_step.current(common_attn_metadata.num_actual_tokens)
        meta.relay_step = step
        meta.relay_plan = None
        if step is not None and step.has_system:
            meta.relay_plan = relay_plan(common_attn_metadata, step, self.relay_config,
                                         meta.scheduler_metadata)
        return meta

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
        _, self.k_sys, self.v_sys = allocate_system_store(num_kv_heads, head_size)
        self.attn_kwargs = {"fa_version": self.vllm_flash_attn_version}
        log_active(f"cuda-flash-attn-{self.vllm_flash_attn_version} (vllm.vllm_flash_attn)")

    def forward(self, layer, query, key, value, kv_cache, attn_metadata, output,
                output_scale=None, output_block_scale=None):
        step = getattr(attn_metadata, "relay_step", None)
        if step is not None:
            capture_fill(step, key, value, self.k_sys, self.v_sys)
        plan = getattr(attn_metadata, "relay_plan", None)
        if plan is not None and (output_scale is not None or output_block_scale is not None):
            raise NotImplementedError("fused output quantization is not supported by relay")
        if plan is None:
            return super().forward(layer, query, key, value, kv_cache, attn_metadata, output,
                                   output_scale, output_block_scale)
        n = attn_metadata.num_actual_tokens
        key_cache, value_cache = kv_cache.transpose(1, 2).split(self.head_size, dim=-1)
        relay_attention(query[:n], key_cache, value_cache, self.k_sys, self.v_sys, plan, output[:n],
                        self.scale, flash_attn.flash_attn_varlen_func, self.attn_kwargs)
        return output
