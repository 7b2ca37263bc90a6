"""System attention: every tagged token attends, non-causally, to all keys of its system-prompt slot.

System K/V live in dense per-slot buffers `k_sys`, `v_sys` of shape [num_slots, S_max, Hkv, D];
slot s holds `sys_lens[s]` valid tokens. A token's slot comes from `token_slot` (-1 = untagged).

The fast path groups the step's tagged tokens by slot on the host (`plan_system_attention`, once per
step) and runs ONE FlashAttention-compatible varlen call over the buffers viewed as pages, one
"request" per slot: each slot's K/V is read once per step for all its tokens, not once per token.
"""

from dataclasses import dataclass

import torch


@dataclass
class SystemPlan:
    """Host-built, per-step plan of the grouped system-attention call (device tensors are int32).

    Attributes:
        perm: [Tsys] token row of each grouped row, or None when the tagged tokens are already rows
            0..Tsys-1 in grouped order (then q[:Tsys] is used without a gather).
        cu_seqlens_q: [G + 1] query offsets of the G slot groups present this step.
        seqused_k: [G] system length of each group's slot.
        max_seqlen_q, max_seqlen_k: python ints (largest group, longest slot).
        block_table: [G, S_max // page_size] page ids of each group's slot in the paged view
            `k_sys.view(num_slots * S_max // page_size, page_size, Hkv, D)`.
        sys_index: [T] grouped row of each token, -1 for untagged tokens (feeds relay_fusion).
        num_tokens: Tsys, the number of tagged tokens (0: no system work this step).
        scheduler_metadata: optional FlashAttention-3 AOT schedule for this call (passed through).
    """

    perm: torch.Tensor | None
    cu_seqlens_q: torch.Tensor
    seqused_k: torch.Tensor
    max_seqlen_q: int
    max_seqlen_k: int
    block_table: torch.Tensor
    sys_index: torch.Tensor
    num_tokens: int
    scheduler_metadata: torch.Tensor | None = None


def _host_ints(x, name: str) -> torch.Tensor:
    if isinstance(x, torch.Tensor) and x.device.type != "cpu":
        raise ValueError(f"plan_system_attention: {name} must be on the host, got {x.device}")
    return torch.as_tensor(x, dtype=torch.int64, device="cpu").reshape(-1)


def plan_system_attention(token_slot_cpu, sys_lens_cpu, S_max: int, page_size: int, device) -> SystemPlan:
    """Group this step's tagged tokens by system slot (host side, once per step).

    Args:
        token_slot_cpu: [T] ints on the host (list, numpy array or CPU tensor): slot of each token,
            -1 for untagged. Tokens of a slot whose length is 0 are treated as untagged.
        sys_lens_cpu: [num_slots] ints on the host: valid system tokens per slot (<= S_max).
        S_max: capacity of a slot in tokens (k_sys.shape[1]); a multiple of `page_size`.
        page_size: tokens per page of the paged view of the system buffers.
        device: where the plan's tensors go (copied once, non-blocking from pinned memory on CUDA).

    Returns:
        A `SystemPlan`. Groups appear in increasing slot order; tokens keep their order within a
        group (stable).

    Example:
        >>> plan = plan_system_attention([0, 0, -1, 1], [100, 37], S_max=128, page_size=16,
        ...                              device="cuda")
        >>> plan.sys_index.tolist(), plan.num_tokens
        ([0, 1, -1, 2], 3)
    """
    if page_size <= 0 or S_max <= 0 or S_max % page_size != 0:
        raise ValueError(f"plan_system_attention: S_max ({S_max}) must be a positive multiple of "
                         f"page_size ({page_size})")
    slot = _host_ints(token_slot_cpu, "token_slot_cpu")
    lens = _host_ints(sys_lens_cpu, "sys_lens_cpu")
    num_slots = lens.shape[0]
    if slot.numel() and (int(slot.min()) < -1 or int(slot.max()) >= num_slots):
        raise ValueError(f"plan_system_attention: token_slot_cpu values must be in [-1, {num_slots}), got "
                         f"[{int(slot.min())}, {int(slot.max())}]")
    if lens.numel() and (int(lens.min()) < 0 or int(lens.max()) > S_max):
        raise ValueError(f"plan_system_attention: sys_lens_cpu values must be in [0, S_max={S_max}]")
    T = slot.shape[0]
    tagged = slot >= 0
    tagged[tagged.clone()] = lens[slot[tagged]] > 0
    idx = torch.nonzero(tagged).flatten()
    perm = idx[torch.argsort(slot[idx], stable=True)]
    groups, counts = torch.unique_consecutive(slot[perm], return_counts=True)
    n_sys = perm.shape[0]
    pages = S_max // page_size

    cu = torch.zeros(groups.shape[0] + 1, dtype=torch.int64)
    torch.cumsum(counts, 0, out=cu[1:])
    seqused = lens[groups]
    block_table = groups[:, None] * pages + torch.arange(pages)[None, :]
    sys_index = torch.full((T,), -1, dtype=torch.int64)
    sys_index[perm] = torch.arange(n_sys)
    need_perm = not torch.equal(perm, torch.arange(n_sys))

    # One host buffer, one copy to the device; the plan's tensors are views into it.
    parts = [perm if need_perm else perm[:0], cu, seqused, block_table.reshape(-1), sys_index]
    host = torch.cat(parts).to(torch.int32)
    device = torch.device(device)
    if device.type == "cuda":
        buf = host.pin_memory().to(device, non_blocking=True)
    else:
        buf = host.to(device)
    views = []
    offset = 0
    for p in parts:
        views.append(buf[offset: offset + p.numel()])
        offset += p.numel()
    return SystemPlan(
        perm=views[0] if need_perm else None,
        cu_seqlens_q=views[1],
        seqused_k=views[2],
        max_seqlen_q=int(counts.max()) if counts.numel() else 0,
        max_seqlen_k=int(seqused.max()) if seqused.numel() else 0,
        block_table=views[3].view(groups.shape[0], pages),
        sys_index=views[4],
        num_tokens=n_sys,
    )


def system_attention(q, k_sys, v_sys, plan: SystemPlan, softmax_scale: float, attn_fn, attn_kwargs=None):
    """Grouped system attention: one varlen call, each slot's K/V read once for all its tokens.

    Args:
        q: queries [T, Hq, D] (fp16/bf16/fp32, last dim contiguous).
        k_sys, v_sys: system buffers [num_slots, S_max, Hkv, D] each, q's dtype; dims 0 and 1 must
            be mergeable into pages (e.g. contiguous, or a slice of a bigger buffer along dim 0).
        plan: the step's `SystemPlan` (from `plan_system_attention`).
        softmax_scale: float.
        attn_fn: a FlashAttention-compatible varlen function (vLLM's `flash_attn_varlen_func`, or
            `varlen_attention_torch`); called once, by keyword, with causal=False and
            return_softmax_lse=True.
        attn_kwargs: optional extra keywords for attn_fn (e.g. fa_version, num_splits).

    Returns:
        (o, lse): o [Tsys, Hq, D] in q's dtype and natural-log lse float32 [Hq, Tsys], rows in
        grouped order; `relay_fusion(..., sys_index=plan.sys_index)` puts them back in place.

    Example:
        >>> o_sys, lse_sys = system_attention(q, k_sys, v_sys, plan, 0.088, flash_attn_varlen_func)
    """
    n = plan.num_tokens
    H, D = q.shape[1], q.shape[2]
    if n == 0:
        return q.new_empty((0, H, D)), torch.empty((H, 0), dtype=torch.float32, device=q.device)
    if k_sys.dim() != 4 or k_sys.shape != v_sys.shape:
        raise ValueError(f"system_attention: k_sys and v_sys must both be [num_slots, S_max, Hkv, D], got "
                         f"{tuple(k_sys.shape)} and {tuple(v_sys.shape)}")
    num_slots, s_max, h_kv, d_kv = k_sys.shape
    pages = plan.block_table.shape[1]
    if pages == 0 or s_max % pages != 0:
        raise ValueError(f"system_attention: S_max={s_max} does not match the plan's {pages} pages per slot")
    page_size = s_max // pages
    try:
        k_pages = k_sys.view(num_slots * pages, page_size, h_kv, d_kv)
        v_pages = v_sys.view(num_slots * pages, page_size, h_kv, d_kv)
    except RuntimeError as e:
        raise ValueError("system_attention: k_sys/v_sys cannot be viewed as pages (dims 0 and 1 must be "
                         f"mergeable), strides {tuple(k_sys.stride())}") from e
    q_g = q.index_select(0, plan.perm) if plan.perm is not None else q[:n]
    kwargs = dict(attn_kwargs or {})
    if plan.scheduler_metadata is not None:
        kwargs["scheduler_metadata"] = plan.scheduler_metadata
    o, lse = attn_fn(
        q=q_g, k=k_pages, v=v_pages,
        cu_seqlens_q=plan.cu_seqlens_q, seqused_k=plan.seqused_k,
        max_seqlen_q=plan.max_seqlen_q, max_seqlen_k=plan.max_seqlen_k,
        softmax_scale=softmax_scale, causal=False, block_table=plan.block_table,
        return_softmax_lse=True, **kwargs,
    )
    return o, lse


def system_attention_torch(q, k_sys, v_sys, sys_lens, token_slot, softmax_scale):
    """Naive reference: each tagged token against all `sys_lens[slot]` keys of its slot, in fp32.

    Args:
        q: [T, Hq, D]; k_sys, v_sys: [num_slots, S_max, Hkv, D]; sys_lens: int [num_slots];
        token_slot: int [T], -1 for untagged; softmax_scale: float.

    Returns:
        (o [T, Hq, D] in q's dtype, lse float32 [Hq, T]) in token order. Untagged tokens (and tokens
        of an empty slot) get o = 0 and lse = -inf.
    """
    T, Hq, D = q.shape
    h_kv = k_sys.shape[2]
    o = torch.zeros(T, Hq, D, dtype=torch.float32, device=q.device)
    lse = torch.full((Hq, T), float("-inf"), dtype=torch.float32, device=q.device)
    slots = token_slot.long()
    lens = sys_lens.tolist()
    for s in sorted(set(slots.tolist()) - {-1}):
        n_keys = lens[s]
        if n_keys == 0:
            continue
        rows = torch.nonzero(slots == s).flatten()
        k = k_sys[s, :n_keys].float().repeat_interleave(Hq // h_kv, dim=1)  # [K, Hq, D]
        v = v_sys[s, :n_keys].float().repeat_interleave(Hq // h_kv, dim=1)
        scores = torch.einsum("thd,khd->htk", q[rows].float(), k) * softmax_scale
        row_lse = torch.logsumexp(scores, dim=-1)  # [Hq, n]
        o[rows] = torch.einsum("htk,khd->thd", torch.softmax(scores, dim=-1), v)
        lse[:, rows] = row_lse
    return o.to(q.dtype), lse
