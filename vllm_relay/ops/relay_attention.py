"""RelayAttention: per-request context attention + shared-level attention, merged by LSE.

A token attends to the keys `[shared prefix ; its request's own]`. Softmax over a concatenation
splits exactly into partial attentions, each normalized over its own keys, merged by their LSEs:

    attn(q, [K_1; K_2]) = a * attn(q, K_1) + (1 - a) * attn(q, K_2),
    a = 1 / (1 + exp(lse_2 - lse_1)).

`relay_attention` runs the context call (every token over its request's paged KV, causal) and then
the shared levels: one grouped non-causal call in which each group's queries read the group's pages
once, merged into the output with `relay_fusion`. A group is just a run of pages shared by some
tokens (a system prompt, a document under it, the prompt of n samples); a token under several of
them (a tree of sharing) has one row in each, all in the same call, and the fusion merges all of a
token's rows at once (`SharedLevel.row_index` is [depth, T]).

Everything data-dependent sits in the plan, built once per step; the per-layer work is a fixed
sequence of launches over persistent tensors, with no host synchronization, so a CUDA graph can
capture it and later replay it for any plan written into the same tensors.

On a decode step the context call and the levels can be one call (`SharedLevel.ctx_start`, ops/joint.py):
the call's sequences are the levels' chunks and then one per token, its queries [level rows ;
tokens], and `fuse_joint` merges its output into `out`.

The levels need only the queries, the context call only its pages: with `RelayPlan.level_stream`
the levels run on that CUDA stream while the context call runs on the caller's, and the fusion
waits for both. On a decode step the context call is bound by its reads and a system level by its
FLOPs, so the two can share the GPU (captured into a graph, the fork and join are graph edges).
"""

from dataclasses import dataclass, field

import torch

from vllm_relay.ops.gather_rows import gather_rows
from vllm_relay.ops.fuse_in_place import fuse_in_place, fuse_joint
from vllm_relay.ops.varlen_attention import FP8_DTYPES


@dataclass
class SharedLevel:
    """Shared levels: groups of tokens, each group reading one run of pages (non-causal).

    Attributes:
        perm: int32 [N]: the token of each grouped row (group g owns rows cu[g]:cu[g+1] of
            `call["cu_seqlens_q"]`). Rows past the last group may point at any valid token.
        row_index: int32 [T] or [L, T]: each token's grouped row in each of its (up to L) groups,
            -1 for none.
        call: keywords of the level's attention call: cu_seqlens_q [G + 1], seqused_k [G],
            max_seqlen_q, max_seqlen_k, block_table [G, P] (each group's pages), and optionally
            scheduler_metadata / num_splits.
        q_buf, out_buf: optional persistent [N, Hq, D] buffers for the gathered queries and the
            level's output (CUDA graphs need fixed addresses); allocated per call when None.
        num_rows: optional int32 [1] on the device, the rows used this step (<= N): with q_buf,
            only they are gathered (a CUDA graph holds the whole capacity N).
        ctx_start: when set (int32 [1]), a joint level: `perm` gathers the level rows and then every
            token (from row ctx_start on), `call` also holds a sequence per token over its own
            pages (ops/joint.py), and the context call is not made: the plan's `context` is unused.
        attn_fn: the level call's function when not `relay_attention`'s: a sliding-window layer's
            levels, whose `call` holds each row's first visible key (`key_start`, ops/window_level.py).
    """

    perm: torch.Tensor
    row_index: torch.Tensor
    call: dict
    q_buf: torch.Tensor | None = None
    out_buf: torch.Tensor | None = None
    num_rows: torch.Tensor | None = None
    ctx_start: torch.Tensor | None = None
    attn_fn: object | None = None


@dataclass
class RelayPlan:
    """Per-step plan of `relay_attention` (device tensors are int32).

    Attributes:
        context: keywords of the context call: cu_seqlens_q [B + 1], seqused_k [B] (each request's
            KV tokens in `block_table`), max_seqlen_q, max_seqlen_k, block_table [B, W], and
            optionally scheduler_metadata / num_splits. A request on the prefix path has its
            shared pages in front of its own in this table; on the shared path only its own.
        shared: the shared levels, merged into the output in order; empty: one plain call.
        level_stream: optional CUDA stream on which the levels (gather and attention) run concurrently with the context call; None: all in the caller's stream.
    """

    context: dict
    shared: list[SharedLevel] = field(default_factory=list)
    level_stream: torch.cuda.Stream | None = None


def relay_attention(q, k_cache, v_cache, plan: RelayPlan, out, softmax_scale: float, attn_fn,
                    attn_kwargs=None, context_kwargs=None, descale=None):
    """Attention of every token over its shared levels' pages and its request's own, into `out`.

    Args:
        q: queries [T, Hq, D], fp16/bf16 (fp32 with a torch attn_fn), last dim contiguous.
        k_cache, v_cache: the paged caches [num_blocks, block_size, Hkv, D] (FlashAttention's
            layout; views with a contiguous last dim are fine). Shared pages live here too.
        plan: the step's `RelayPlan`.
        out: output [T, Hq, D], q's dtype; written in place and returned.
        softmax_scale: float.
        attn_fn: a FlashAttention-compatible varlen function, called by keyword (q=, k=, v=, out=,
            softmax_scale=, causal=, return_softmax_lse=, the plan's keywords and `attn_kwargs`):
            vLLM's `flash_attn_varlen_func` on CUDA, `varlen_attention_torch` on CPU.
        attn_kwargs: optional extra keywords for every attn_fn call (e.g. fa_version, softcap, the
            FP8 cache's k_descale / v_descale).
        context_kwargs: optional keywords for the context call only: attention sinks (`s_aux`), each a
            logit every query sees once, join the softmax of one partial, whose LSE then carries them
            into the merge. A joint plan (one call for the levels and the context) refuses them.
        descale: optional (q_descale, k_descale, v_descale) of an FP8 cache, each a per-tensor scale
            (a tensor of one element; q_descale None when q is not quantized): every call gets them
            expanded to [its sequences, Hkv], FlashAttention-3's shape (views: no copy, graph-safe).

    Returns:
        `out` [T, Hq, D].

    Example:
        >>> relay_attention(q, k_cache, v_cache, plan, out, 0.088,  # doctest: +SKIP
        ...                 flash_attn_varlen_func,
        ...                 attn_kwargs={"fa_version": 3})
    """
    extra = attn_kwargs or {}
    ctx_extra = {**extra, **(context_kwargs or {}), **_descales(descale, plan.context, k_cache)}
    levels = plan.shared
    if levels and levels[0].ctx_start is not None:  # one call for the levels and the context
        if context_kwargs:
            raise ValueError(f"relay_attention: a joint plan cannot take context-only keywords {list(context_kwargs)}")
        level = levels[0]
        o_all, lse_all = _level_call(q, k_cache, v_cache, level, softmax_scale, attn_fn, extra, descale)
        return fuse_joint(out, o_all, lse_all, level.ctx_start, level.row_index)
    side = plan.level_stream if levels else None
    partials = []
    if side is not None:  # fork: the levels read q, written before this call in the caller's stream
        caller = torch.cuda.current_stream(q.device)
        side.wait_stream(caller)
        with torch.cuda.stream(side):
            partials = [_level_call(q, k_cache, v_cache, level, softmax_scale, attn_fn, extra, descale)
                        for level in levels]
    result = attn_fn(q=q, k=k_cache, v=v_cache, out=out, softmax_scale=softmax_scale, causal=True,
                     return_softmax_lse=bool(levels), **plan.context, **ctx_extra)
    if not levels:
        if result is not out:
            out.copy_(result)
        return out
    o_ctx, lse = result
    if o_ctx is not out:
        out.copy_(o_ctx)
    if side is not None:  # join. The side stream's next fork waits for this call's fusion, so its
        caller.wait_stream(side)  # buffers (persistent or cached for it) are never written early
    last = len(levels) - 1
    for i, level in enumerate(levels):
        o_level, lse_level = partials[i] if partials else _level_call(q, k_cache, v_cache, level, softmax_scale,
                                                                      attn_fn, extra, descale)
        # In place: `out` holds the merged state so far; its LSE is updated for the next level.
        fuse_in_place(out, lse, o_level, lse_level, level.row_index, update_lse=i != last)
    return out


def _descales(descale, call: dict, k_cache) -> dict:
    """An FP8 call's scales, each expanded to [the call's sequences, Hkv]."""
    if descale is None:
        return {}
    n, heads = call["cu_seqlens_q"].shape[0] - 1, k_cache.shape[2]
    return {name: x.reshape(1, 1).expand(n, heads)
            for name, x in zip(("q_descale", "k_descale", "v_descale"), descale) if x is not None}


def as_gathered(x):
    """`x` as the level gathers read or write it: FP8 rows as bytes (the gathers copy rows, whatever they
    hold; the planner compiles its gather for this view)."""
    return x.view(torch.uint8) if x is not None and x.dtype in FP8_DTYPES else x


def _level_call(q, k_cache, v_cache, level: SharedLevel, softmax_scale, attn_fn, extra, descale=None):
    """One level's gather and grouped non-causal call: (output [N, Hq, D], LSE [Hq, N])."""
    src, buf = as_gathered(q), as_gathered(level.q_buf)
    if level.num_rows is not None:
        q_level = gather_rows(src, level.perm, level.num_rows, buf)
    elif buf is not None:
        q_level = torch.index_select(src, 0, level.perm, out=buf)
    else:
        q_level = src.index_select(0, level.perm)
    if src is not q:
        q_level = q_level.view(q.dtype)
    fn = level.attn_fn or attn_fn
    return fn(q=q_level, k=k_cache, v=v_cache, out=level.out_buf, softmax_scale=softmax_scale, causal=False,
              return_softmax_lse=True, **level.call, **extra, **_descales(descale, level.call, k_cache))
