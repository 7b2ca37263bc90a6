"""RelayAttention: context attention + grouped system attention + LSE relay fusion.

A token of a relay request attends to its system prompt (held once, in a per-slot system buffer)
and to its own context (the request's paged KV). Softmax over the concatenation splits exactly:

    attn(q, [K_sys; K_ctx]) = a * attn(q, K_sys) + (1 - a) * attn(q, K_ctx),
    a = 1 / (1 + exp(lse_ctx - lse_sys)),

so each step runs the context part as ordinary causal varlen attention over every request's own
KV, the system part as one grouped non-causal call that reads each slot's K/V once for all its
tokens, and merges the two with `relay_fusion`. Everything data-dependent is in the plan, built on
the host once per step; `relay_attention` itself never synchronizes with the device.
"""

from dataclasses import dataclass

import torch

from vllm_relay.ops.relay_fusion import relay_fusion
from vllm_relay.ops.system_attention import SystemPlan, system_attention


@dataclass
class RelayPlan:
    """Per-step plan of `relay_attention` (device tensors are int32).

    Attributes:
        cu_seqlens_q: [B + 1] query offsets of the B requests.
        seqused_k: [B] KV tokens of each request's OWN paged KV (for a relay request, its own
            tokens only: the system prompt is in the system buffer).
        max_seqlen_q, max_seqlen_k: python ints.
        block_table: [B, max_blocks] physical block ids of each request's own KV.
        system: the grouped system-attention plan, or None when no token has a system part.
        scheduler_metadata: optional FlashAttention-3 AOT schedule of the context call.
    """

    cu_seqlens_q: torch.Tensor
    seqused_k: torch.Tensor
    max_seqlen_q: int
    max_seqlen_k: int
    block_table: torch.Tensor
    system: SystemPlan | None = None
    scheduler_metadata: torch.Tensor | None = None


def relay_attention(q, k_cache, v_cache, k_sys, v_sys, plan: RelayPlan, out, softmax_scale: float,
                    attn_fn, attn_kwargs=None):
    """Attention of every token over [its slot's system K/V ; its request's own K/V], into `out`.

    Args:
        q: queries [T, Hq, D], fp16/bf16 (fp32 with a torch attn_fn), last dim contiguous.
        k_cache, v_cache: paged context caches [num_blocks, block_size, Hkv, D] (FlashAttention's
            layout; views with a contiguous last dim are fine).
        k_sys, v_sys: system buffers [num_slots, S_max, Hkv, D], or None when `plan.system` is None.
        plan: the step's `RelayPlan`.
        out: output [T, Hq, D], q's dtype; written in place and returned.
        softmax_scale: float.
        attn_fn: a FlashAttention-compatible varlen function, called by keyword (q=, k=, v=, out=,
            cu_seqlens_q=, seqused_k=, max_seqlen_q=, max_seqlen_k=, softmax_scale=, causal=,
            block_table=, return_softmax_lse=, plus `attn_kwargs` and the plans' scheduler_metadata):
            vLLM's FlashAttention `flash_attn_varlen_func` on CUDA, varlen_attention_torch on CPU.
        attn_kwargs: optional extra keywords for both attn_fn calls (e.g. fa_version, num_splits).

    Returns:
        `out` [T, Hq, D].

    Example:
        >>> relay_attention(q, k_cache, v_cache, k_sys, v_sys, plan, out, 0.088, flash_attn_varlen_func,
        ...                 attn_kwargs={"fa_version": 3})
    """
    kwargs = dict(attn_kwargs or {})
    ctx_kwargs = dict(kwargs)
    if plan.scheduler_metadata is not None:
        ctx_kwargs["scheduler_metadata"] = plan.scheduler_metadata
    has_system = plan.system is not None and plan.system.num_tokens > 0
    result = attn_fn(
        q=q, k=k_cache, v=v_cache, out=out,
        cu_seqlens_q=plan.cu_seqlens_q, seqused_k=plan.seqused_k,
        max_seqlen_q=plan.max_seqlen_q, max_seqlen_k=plan.max_seqlen_k,
        softmax_scale=softmax_scale, causal=True, block_table=plan.block_table,
        return_softmax_lse=has_system, **ctx_kwargs,
    )
    if not has_system:
        if result is not out:
            out.copy_(result)
        return out
    o_ctx, lse_ctx = result
    o_sys, lse_sys = system_attention(q, k_sys, v_sys, plan.system, softmax_scale, attn_fn, kwargs)
    # o_ctx is normally `out` itself: fusion reads each element before overwriting it.
    return relay_fusion(o_sys, lse_sys, o_ctx, lse_ctx, out=out, sys_index=plan.system.sys_index)
