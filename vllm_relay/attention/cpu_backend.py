"""The relay backend on vLLM's CPU platform: vLLM's CPU attention, extended.

Subclassing vLLM's CPU backend keeps its KV-cache layout ([blocks, kv_heads, block_size, 2 * head
size], K then V in each block), its cache writes and its attention kernel. Each step the planner
(the same as on CUDA) writes the context tables, each request's pages past its levels, with its
slot's pages in front on the prefix path:

* no level: vLLM's CPU kernel (`cpu_attention_with_kv_cache`) over the context tables, one call;
* otherwise `ops.relay_attention` in torch (`varlen_attention_torch`, which returns the LSE that
  vLLM's kernel does not), the levels and the fusion.

An FP8 KV cache (`--kv-cache-dtype fp8`, `fp8_e4m3`, `fp8_e5m2`; x86 with AVX-512 or AMX, as vLLM's
CPU backend requires) is read as vLLM's kernel reads it: each stored value times the layer's scale.
Logit soft-capping applies in every call; attention sinks join the context call only, whose LSE
carries them into the merge (so a model with sinks plans no joint call).
"""

import functools
from typing import ClassVar

import torch
from vllm import _custom_ops as ops
from vllm.v1.attention.backend import AttentionType
from vllm.v1.attention.backends.cpu_attn import (
    CPUAttentionBackend,
    CPUAttentionBackendImpl,
    CPUAttentionMetadataBuilder,
)

from vllm_relay.attention import step as relay_step
from vllm_relay.attention.common import (
    FP8_KV,
    any_sinks,
    window_of,
    check_engine,
    check_layer,
    layer_impls,
    log_active,
)
from vllm_relay.attention.planner import RelayPlanner
from vllm_relay.ops import RelayPlan, relay_attention, varlen_attention_torch
from vllm_relay.ops.window_level_torch import window_level_attention_torch

def torch_views(key_cache: torch.Tensor, value_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """FlashAttention-layout views [blocks, block_size, kv_heads, D] of the halves of vLLM's CPU cache
    (each [blocks, kv_heads, block_size, D] in memory), for the torch levels: its cache writes store
    V plainly and K transposed, [D, block_size] per block and head (what its kernel reads). No copy."""
    nb, h, bs, d = key_cache.shape
    k = key_cache.as_strided((nb, bs, h, d), (key_cache.stride(0), 1, key_cache.stride(1), bs))
    return k, value_cache.transpose(1, 2)


@functools.lru_cache(maxsize=None)
def torch_views_match(isa: str, dtype: torch.dtype, block_size: int, head_size: int,
                      kv_cache_dtype: str = "auto") -> bool:
    """Whether `torch_views` reads back what vLLM's cache writes store for this ISA and cache dtype
    (probed once; `dtype` is the model's). An FP8 cache is probed with scales 2 and 0.5: values
    exact on both FP8 grids, stored divided by the scale and read times it."""
    fp8 = FP8_KV.get(kv_cache_dtype)
    kv = torch.zeros(2, 2, block_size, 2 * head_size, dtype=torch.uint8 if fp8 else dtype)
    key_cache, value_cache = kv.view(2, 2, 2 * block_size, head_size).chunk(2, dim=2)
    n = 2 * block_size
    if fp8:
        key = (((torch.arange(n * 2 * head_size) * 7) % 8 - 4) / 2).reshape(n, 2, head_size).to(dtype)
    else:
        key = (torch.arange(n * 2 * head_size) % 251).reshape(n, 2, head_size).to(dtype)  # exact in 16 bits
    value = key.flip(0)
    scales = (2.0, 0.5) if fp8 else (1.0, 1.0)
    ops.cpu_attn_reshape_and_cache(key, value, key_cache, value_cache, torch.arange(n), isa,
                                   k_scale=scales[0], v_scale=scales[1], kv_cache_dtype=kv_cache_dtype)
    k, v = torch_views(key_cache, value_cache)
    if fp8:
        k, v = (x.flatten(0, 1).contiguous().view(fp8).float() * s for x, s in zip((k, v), scales))
        return torch.equal(k, key.float()) and torch.equal(v, value.float())
    return torch.equal(k.flatten(0, 1), key) and torch.equal(v.flatten(0, 1), value)


class RelayCPUBackend(CPUAttentionBackend):
    supported_kv_cache_dtypes: ClassVar[list[str]] = ["auto", "float32", "float16", "bfloat16", *FP8_KV]

    @staticmethod
    def get_name() -> str:
        return "CUSTOM"  # the enum member `relay` aliases; see vllm_relay.register

    @staticmethod
    def get_impl_cls() -> type["RelayCPUImpl"]:
        return RelayCPUImpl

    @staticmethod
    def get_builder_cls() -> type["RelayCPUMetadataBuilder"]:
        return RelayCPUMetadataBuilder

    @classmethod
    def supports_attn_type(cls, attn_type: str) -> bool:
        return attn_type == AttentionType.DECODER

    @classmethod
    def supports_sliding_window(cls) -> bool:
        return True  # window layers read each level from each row's window on (`RelayPlanner.window`)

    @classmethod
    def supports_non_causal(cls) -> bool:
        return False

    @classmethod
    def supports_sink(cls) -> bool:
        return True

    @staticmethod
    def use_cascade_attention(*args, **kwargs) -> bool:
        return False


class RelayCPUMetadataBuilder(CPUAttentionMetadataBuilder):
    def __init__(self, kv_cache_spec, layer_names, vllm_config, device) -> None:
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)
        from vllm_relay.hooks.runner import apply_worker

        apply_worker()
        impls = layer_impls(vllm_config, layer_names)
        self.planner = RelayPlanner(vllm_config, kv_cache_spec, device, num_layers=len(layer_names),
                                    joint=not any_sinks(impls), window=window_of(impls),
                                    level_fn=window_level_attention_torch)
        log_active(f"cpu (vLLM's CPU attention kernel, isa {self.isa}; the shared levels in torch)")

    def build(self, common_prefix_len, common_attn_metadata, fast_build: bool = False):
        cm = common_attn_metadata
        plan = self.planner.plan(cm, relay_step.covering(self.planner.current, cm.num_reqs, cm.num_actual_tokens))
        ctx = cm if plan is None else plan.context
        meta = super().build(0, ctx, fast_build)  # vLLM's kernel schedule over the context tables
        context = dict(cu_seqlens_q=ctx.query_start_loc, seqused_k=ctx.seq_lens, max_seqlen_q=ctx.max_query_len,
                       max_seqlen_k=ctx.max_seq_len, block_table=ctx.block_table_tensor)
        meta.relay = RelayPlan(context, [plan.level] if plan is not None and plan.run_level else [])
        return meta


class RelayCPUImpl(CPUAttentionBackendImpl):
    def __init__(self, num_heads, head_size, scale, num_kv_heads, alibi_slopes, sliding_window,
                 kv_cache_dtype, logits_soft_cap=None, attn_type=AttentionType.DECODER,
                 kv_sharing_target_layer_name=None, sinks=None) -> None:
        check_layer("CPU", alibi_slopes=alibi_slopes, attn_type=attn_type,
                    kv_sharing_target_layer_name=kv_sharing_target_layer_name)
        check_engine()
        super().__init__(num_heads, head_size, scale, num_kv_heads, alibi_slopes, sliding_window,
                         kv_cache_dtype, logits_soft_cap, attn_type, kv_sharing_target_layer_name, sinks)

    def forward(self, layer, query, key, value, kv_cache, attn_metadata, output,
                output_scale=None, output_block_scale=None) -> torch.Tensor:
        if output_scale is not None or output_block_scale is not None:
            raise NotImplementedError("fused output quantization is not supported by relay")
        if attn_metadata is None:  # profiling run
            return output
        n = attn_metadata.num_actual_tokens
        num_blocks, num_kv_heads, block_size, _ = kv_cache.shape
        key_cache, value_cache = kv_cache.view(num_blocks, num_kv_heads, 2 * block_size, -1).chunk(2, dim=2)
        plan = attn_metadata.relay
        if self.sinks is not None and self.sinks.dtype not in (torch.bfloat16, torch.float32):
            self.sinks = self.sinks.to(torch.float32)  # as vLLM's CPU backend runs them
        if not plan.shared:  # vLLM's own kernel over the context tables (the cache was written already)
            ops.cpu_attention_with_kv_cache(
                query=query[:n], key_cache=key_cache, value_cache=value_cache, output=output[:n],
                query_start_loc=attn_metadata.query_start_loc, seq_lens=attn_metadata.seq_lens, scale=self.scale,
                causal=True, alibi_slopes=None, sliding_window=self.sliding_window,
                block_table=attn_metadata.block_table,
                softcap=self.logits_soft_cap, scheduler_metadata=attn_metadata.scheduler_metadata, s_aux=self.sinks,
                k_scale=layer._k_scale_float, v_scale=layer._v_scale_float,
                kv_cache_dtype=self.kv_cache_dtype)
            return output
        if not torch_views_match(layer.isa, query.dtype, block_size, self.head_size, self.kv_cache_dtype):
            raise RuntimeError(f"vllm-relay: the shared levels cannot read vLLM's CPU KV cache with ISA "
                               f"{layer.isa!r} and cache dtype {self.kv_cache_dtype!r} (an unknown block "
                               "layout); use shared_path 'auto' or 'never' on this machine")
        k, v = torch_views(key_cache, value_cache)
        extra = {"softcap": self.logits_soft_cap}
        fp8 = FP8_KV.get(self.kv_cache_dtype)
        if fp8 is not None:
            k, v = k.view(fp8), v.view(fp8)
            extra.update(k_descale=layer._k_scale_float, v_descale=layer._v_scale_float)
        context = {} if self.sinks is None else {"s_aux": self.sinks}
        if self.sliding_window != -1:  # the context call's window (the levels': each row's key start)
            context["window_size"] = (self.sliding_window - 1, 0)
        relay_attention(query[:n], k, v, plan, output[:n], self.scale, varlen_attention_torch, extra, context)
        return output
