"""The relay backend for MLA (DeepSeek's multi-head latent attention) on CUDA: vLLM's FLASH_ATTN_MLA
backend (FlashAttention-3, Hopper), extended.

vLLM runs an MLA layer in two forms. A step's requests of up to `reorder_batch_threshold` (512) tokens
read the latent cache as MQA (`forward_mqa`): each query head absorbed into the latent space, one KV
head whose key is the whole vector (512 latent and 64 rotary values) and whose value its latent part;
longer ones up-project their context and run as MHA (`forward_mha`). Relay changes the first form only:
the levels a step's MQA rows share are read once for all of them (`ops/latent.py`: a level in
`relay_attention`'s terms, merged in the latent space before the up-projection), each request's own
pages in the context call. The MHA form reads its whole context from the context tables as vLLM
builds it (a registered prompt's pages in front: the prefix path; the planner never gives such a
request levels, `max_level_query_len`).

As relay's FlashAttention backend (backend.py): the planner plans once per step, a full-graph decode
step with levels captures the levels' call over persistent plan tensors and runs it on the level
stream; the levels and the context are two calls (keys and values of different sizes: no joint call).
"""

import dataclasses

import torch
from vllm.v1.attention.backend import AttentionType
from vllm.v1.attention.backends.fa_utils import flash_attn_varlen_func, get_scheduler_metadata
from vllm.v1.attention.backends.mla.flashattn_mla import (
    FlashAttnMLABackend,
    FlashAttnMLAImpl,
    FlashAttnMLAMetadataBuilder,
)

from vllm_relay.attention.backend import RelayBuilder, check_runner
from vllm_relay.attention.common import check_engine, check_layer, log_active
from vllm_relay.attention.planner import RelayPlanner
from vllm_relay.attention.rules import mla_one_split
from vllm_relay.ops import latent_varlen, relay_attention


class RelayMLABackend(FlashAttnMLABackend):
    @staticmethod
    def get_name() -> str:
        return "CUSTOM"  # the enum member `relay` aliases (vllm_relay.register; hooks/platform.py routes MLA here)

    @staticmethod
    def get_builder_cls() -> type["RelayMLAMetadataBuilder"]:
        return RelayMLAMetadataBuilder

    @staticmethod
    def get_impl_cls() -> type["RelayMLAImpl"]:
        return RelayMLAImpl

    @classmethod
    def supports_attn_type(cls, attn_type: str) -> bool:
        return attn_type == AttentionType.DECODER


class RelayMLAMetadataBuilder(RelayBuilder, FlashAttnMLAMetadataBuilder):
    def __init__(self, kv_cache_spec, layer_names, vllm_config, device):
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)
        self.rank = self.mla_dims.kv_lora_rank
        self._relay_state(RelayPlanner(vllm_config, kv_cache_spec, device, num_layers=len(layer_names), joint=False,
                                       value_size=self.rank, max_level_query_len=self.reorder_batch_threshold),
                          device, self.fa_aot_schedule)

    def _build(self, cm, fast_build: bool, step, capture: bool = False):
        plan, _, _ = self._plan(cm, step, capture)
        if plan is None:
            meta = self._vllm_build(cm, fast_build)
            meta.relay = None
            return meta
        meta = self._vllm_build(plan.context, fast_build)  # vLLM's two forms over the context tables
        decode = meta.decode
        if decode is None:  # no MQA rows this step: no levels (the planner gives MHA rows none)
            meta.relay = None
            return meta
        level = plan.level
        level.call["num_splits"] = decode.max_num_splits
        if plan.run_level or plan.graph:
            self._use_schedule(plan, decode.max_num_splits,
                               self._schedule_level(level.call, decode.max_num_splits, fast_build))
        num_mqa = meta.num_decode_tokens
        if plan.run_level and num_mqa < cm.num_actual_tokens:
            if plan.graph:  # (a full graph runs uniform decode batches: every token is an MQA row)
                raise RuntimeError(f"vllm-relay: a full-graph MLA step with {cm.num_actual_tokens - num_mqa} "
                                   "tokens in the MHA form")
            # forward_mqa's output holds the MQA rows only (vLLM orders them first): the fusion's row index too
            level = dataclasses.replace(level, row_index=level.row_index[..., :num_mqa].contiguous())
        context = dict(cu_seqlens_q=decode.query_start_loc, seqused_k=decode.seq_lens,
                       max_seqlen_q=max(decode.max_query_len, 1), max_seqlen_k=decode.max_seq_len,
                       block_table=decode.block_table, scheduler_metadata=decode.scheduler_metadata,
                       num_splits=decode.max_num_splits)
        meta.relay = self._relay_plan(plan, context, level)
        return meta

    def _build_decode(self, **kwargs):
        """vLLM's MQA metadata; a step whose MQA rows fill the multiprocessors unsplit runs unsplit, its
        context call and its levels' (`rules.mla_one_split`: FA3's split buffers would exceed vLLM's
        memory profile). vLLM splits only the graphs' decode batches, up to its cap; the rest FA3 chooses."""
        meta = super()._build_decode(**kwargs)
        rows = kwargs["num_decode_tokens"]
        graph = self.use_full_cuda_graph and rows <= (self.max_cudagraph_size or 0)  # (vLLM's split, captured)
        if meta.max_num_splits == 0 and not graph and mla_one_split(rows, self.num_heads, self.planner.num_sms):
            schedule = self._schedule_decode(num_reqs=meta.seq_lens.shape[0], cu_query_lens=meta.query_start_loc,
                                             max_query_len=meta.max_query_len, seqlens=meta.seq_lens,
                                             max_seq_len=meta.max_seq_len, causal=True, max_num_splits=1)
            meta = dataclasses.replace(meta, scheduler_metadata=schedule, max_num_splits=1)
        return meta

    def _schedule_level(self, call: dict, num_splits: int, fast_build: bool):
        """FlashAttention-3's ahead-of-time schedule of the levels' call, as the MLA builder makes its
        decode call's (`_schedule_decode`, non-causal), into a persistent buffer with full graphs."""
        if not self.fa_aot_schedule or fast_build or call["max_seqlen_q"] == 0:
            return None
        return self._kept(get_scheduler_metadata(
            batch_size=call["seqused_k"].shape[0], max_seqlen_q=call["max_seqlen_q"],
            max_seqlen_k=call["max_seqlen_k"], num_heads_q=self.num_heads, num_heads_kv=1,
            headdim=self.mla_dims.qk_rope_head_dim, cache_seqlens=call["seqused_k"],
            qkv_dtype=self.kv_cache_spec.dtype, headdim_v=self.rank, page_size=self.page_size,
            cu_seqlens_q=call["cu_seqlens_q"], causal=False, num_splits=num_splits,
        ))


class RelayMLAImpl(FlashAttnMLAImpl):
    def __init__(self, num_heads, head_size, scale, num_kv_heads, alibi_slopes, sliding_window, kv_cache_dtype,
                 logits_soft_cap, attn_type, kv_sharing_target_layer_name, **mla_args) -> None:
        check_layer("CUDA", alibi_slopes=alibi_slopes, attn_type=attn_type,
                    kv_sharing_target_layer_name=kv_sharing_target_layer_name)
        check_engine()
        check_runner()
        super().__init__(num_heads, head_size, scale, num_kv_heads, alibi_slopes, sliding_window, kv_cache_dtype,
                         logits_soft_cap, attn_type, kv_sharing_target_layer_name, **mla_args)
        if self.dcp_world_size > 1:
            raise NotImplementedError("The relay attention backend does not support decode context parallelism "
                                      "with MLA (its levels are whole on every rank)")
        self.latent_fn = latent_varlen(flash_attn_varlen_func, self.kv_lora_rank)
        log_active("cuda-flash-attn-3-mla (vllm.vllm_flash_attn)")

    def forward_mqa(self, q, kv_c_and_k_pe_cache, attn_metadata, layer):
        plan = getattr(attn_metadata, "relay", None)
        if plan is None or not plan.shared:  # over the context tables, or vLLM's own: FLASH_ATTN_MLA's call
            return super().forward_mqa(q, kv_c_and_k_pe_cache, attn_metadata, layer)
        q = torch.cat(q, dim=-1) if isinstance(q, tuple) else q  # [T, H, rank + rope]
        cache = kv_c_and_k_pe_cache.unsqueeze(-2)  # [blocks, page, 1, rank + rope]
        out = q.new_empty(q.shape[0], q.shape[1], self.kv_lora_rank)
        relay_attention(q, cache, cache[..., : self.kv_lora_rank], plan, out, self.scale, self.latent_fn,
                        {"fa_version": 3})
        return out, None
