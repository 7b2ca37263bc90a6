"""Relay fusion: merge the system-prompt and context parts of attention by their log-sum-exp.

Attention over the keys `[system ; context]` splits into two partial attentions, each normalized
over its own keys. With natural-log LSEs `lse_sys`, `lse_ctx` the exact result is

    a   = exp(lse_sys) / (exp(lse_sys) + exp(lse_ctx)) = 1 / (1 + exp(lse_ctx - lse_sys))
    out = a * o_sys + (1 - a) * o_ctx
    lse = logaddexp(lse_sys, lse_ctx)

computed here in fp32 in the max-subtracted form, so no exponent overflows. FlashAttention's LSE is
natural-log; FlashInfer's is base 2 (multiply it by ln 2 before passing it in).

Conventions shared by every function in this file:
  * a token with no system part (its `sys_index` is -1, or its `lse_sys` is -inf) comes out as
    exactly `o_ctx`, bit for bit; a head whose `lse_ctx` is -inf comes out as `o_sys`; both -inf
    gives `o_ctx`. No NaN is ever produced from empty rows, whatever their output rows hold.
  * FlashAttention-2 reports +inf as the LSE of a row that saw no key; +inf is read as -inf (as
    vLLM's Triton `merge_attn_states` does), and `out_lse` is written with -inf there.
"""

import torch
import triton
import triton.language as tl

from vllm_relay.ops.interpreter import kernel_for, runs_triton

_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def _norm_lse(lse: torch.Tensor) -> torch.Tensor:
    """fp32 copy of `lse` with FlashAttention-2's +inf (empty row) read as -inf."""
    lse = lse.float()
    return lse.masked_fill(lse == float("inf"), float("-inf"))


def relay_fusion_torch(o_sys, lse_sys, o_ctx, lse_ctx, out=None, out_lse=None, sys_index=None,
                       lse_layout="ht"):
    """Torch implementation of `relay_fusion` (the CPU path and the tests' twin of the kernel).

    Same arguments, semantics and aliasing rules as `relay_fusion`.
    """
    _check_args(o_sys, lse_sys, o_ctx, lse_ctx, out, out_lse, sys_index, lse_layout)
    # Work in [T, H] for LSEs.
    ls = _norm_lse(lse_sys if lse_layout == "th" else lse_sys.t())
    lc = _norm_lse(lse_ctx if lse_layout == "th" else lse_ctx.t())
    if sys_index is not None:
        idx = sys_index.long()
        has_sys = idx >= 0
        rows = idx.clamp(min=0)
        if o_sys.shape[0] == 0:  # no system rows at all: every token is untagged
            os_rows = o_ctx.new_zeros(o_ctx.shape)
            ls = torch.full_like(lc, float("-inf"))
        else:
            os_rows = o_sys.index_select(0, rows)
            ls = torch.where(has_sys[:, None], ls.index_select(0, rows), float("-inf"))
    else:
        os_rows = o_sys
    sys_empty = ls == float("-inf")
    ctx_empty = lc == float("-inf")
    m = torch.maximum(ls, lc)
    m = torch.where(m == float("-inf"), 0.0, m)  # both empty: avoid (-inf) - (-inf)
    es = torch.exp(ls - m)
    ec = torch.exp(lc - m)
    denom = es + ec
    denom = torch.where(denom > 0, denom, 1.0)  # both empty: the result is o_ctx anyway
    ws = (es / denom)[..., None]
    wc = (ec / denom)[..., None]
    fs = os_rows.float()
    fc = o_ctx.float()
    # Drop zero-weight terms instead of multiplying by 0: empty rows may hold NaN or garbage.
    blend = ws * torch.where(ws > 0, fs, 0.0) + wc * torch.where(wc > 0, fc, 0.0)
    res = torch.where(ctx_empty[..., None], fs, blend).to(o_ctx.dtype)
    res = torch.where(sys_empty[..., None], o_ctx, res)
    merged = torch.where(sys_empty, lc, m + torch.log(denom))
    if out is None:
        out = torch.empty_like(o_ctx)
    out.copy_(res)
    if out_lse is not None:
        out_lse.copy_(merged if lse_layout == "th" else merged.t())
    return out


@triton.jit
def _merge_weights(ls, lc):
    """Per row: (weight of the system part, weight of the context part, system empty, context
    empty, merged LSE), from natural-log LSEs, FlashAttention-2's +inf read as -inf."""
    lc = tl.where(lc == float("inf"), float("-inf"), lc)
    ls = tl.where(ls == float("inf"), float("-inf"), ls)
    sys_empty = ls == float("-inf")  # also every token without a system part
    ctx_empty = lc == float("-inf")
    m = tl.maximum(ls, lc)
    m = tl.where(m == float("-inf"), 0.0, m)  # both empty: avoid (-inf) - (-inf)
    es = tl.exp(ls - m)
    ec = tl.exp(lc - m)
    denom = es + ec
    denom = tl.where(denom > 0, denom, 1.0)  # both empty: the result is o_ctx anyway
    merged = tl.where(sys_empty, lc, m + tl.log(denom))
    return es / denom, ec / denom, sys_empty, ctx_empty, merged


@triton.jit
def _blend(ws, wc, sys_empty, ctx_empty, os_, oc):
    """The merged tile in o_ctx's dtype; drops zero-weight terms instead of multiplying by 0
    (empty rows may hold NaN or garbage)."""
    fs = os_.to(tl.float32)
    fc = oc.to(tl.float32)
    blend = ws[:, None] * tl.where(ws[:, None] > 0, fs, 0.0) + wc[:, None] * tl.where(wc[:, None] > 0, fc, 0.0)
    res = tl.where(ctx_empty[:, None], fs, blend).to(oc.dtype)
    return tl.where(sys_empty[:, None], oc, res)


@triton.jit
def _relay_fusion_kernel(
    out_ptr, out_lse_ptr, o_sys_ptr, lse_sys_ptr, o_ctx_ptr, lse_ctx_ptr, sys_index_ptr,
    num_rows,
    stride_out_t, stride_out_h,
    stride_os_t, stride_os_h,
    stride_oc_t, stride_oc_h,
    stride_ls_t, stride_ls_h,
    stride_lc_t, stride_lc_h,
    stride_lo_t, stride_lo_h,
    NUM_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_D: tl.constexpr,
    HAS_SYS_INDEX: tl.constexpr,
    HAS_OUT_LSE: tl.constexpr,
    OUT_IS_CTX: tl.constexpr,
):
    # A program merges BLOCK_R consecutive (token, head) rows of BLOCK_D elements. It loads all its
    # inputs before storing, so `out` may alias `o_ctx` (or `o_sys` without sys_index).
    r = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    r_mask = r < num_rows
    t = r // NUM_HEADS
    h = r % NUM_HEADS
    d = tl.arange(0, BLOCK_D)
    tile_mask = r_mask[:, None] & (d < HEAD_DIM)[None, :]

    if HAS_SYS_INDEX:
        s = tl.load(sys_index_ptr + t, mask=r_mask, other=-1).to(tl.int64)
    else:
        s = t
    lc = tl.load(lse_ctx_ptr + t * stride_lc_t + h * stride_lc_h, mask=r_mask, other=float("-inf"))
    ls = tl.load(lse_sys_ptr + s * stride_ls_t + h * stride_ls_h, mask=r_mask & (s >= 0),
                 other=float("-inf"))
    ws, wc, sys_empty, ctx_empty, merged = _merge_weights(ls, lc)

    # Rows without a system part are o_ctx already when out aliases it: neither read nor written.
    rw_mask = tile_mask & (~sys_empty)[:, None] if OUT_IS_CTX else tile_mask
    oc = tl.load(o_ctx_ptr + t[:, None] * stride_oc_t + h[:, None] * stride_oc_h + d[None, :],
                 mask=rw_mask)
    os_ = tl.load(o_sys_ptr + s[:, None] * stride_os_t + h[:, None] * stride_os_h + d[None, :],
                  mask=tile_mask & (~sys_empty)[:, None], other=0.0)
    res = _blend(ws, wc, sys_empty, ctx_empty, os_, oc)
    tl.store(out_ptr + t[:, None] * stride_out_t + h[:, None] * stride_out_h + d[None, :], res,
             mask=rw_mask)
    if HAS_OUT_LSE:
        tl.store(out_lse_ptr + t * stride_lo_t + h * stride_lo_h, merged, mask=r_mask)


def _lse_strides(lse: torch.Tensor, layout: str) -> tuple[int, int]:
    """(token stride, head stride) of an LSE tensor in `layout`."""
    return (lse.stride(1), lse.stride(0)) if layout == "ht" else (lse.stride(0), lse.stride(1))


def _launch_config(num_rows: int, head_dim: int, elem_size: int, interpret: bool):
    """(BLOCK_R, BLOCK_D, num_warps) for programs of BLOCK_R (token, head) rows.

    A tile holds up to 4096 elements (32 heads of D=128: one token of Llama-7B), moved in 16-byte
    vectors. Small batches use fewer rows per program so the grid keeps ~1k programs for 132 SMs;
    the interpreter always takes full tiles (it pays per program, not per element).
    NOTE: measured on an H200 (bf16, H=32, D=128, copy bandwidth 4.24 TB/s read+write): T=65536 in
    387 us (99% of copy bandwidth), T=8192 in 57 us (84%), T<=512 in 6-9 us (launch-bound), equal to
    or faster than vLLM's CUDA merge_attn_states; a sweep of rows {1..64} x warps {1..16} found no
    configuration more than 2% faster at any T.
    """
    block_d = triton.next_power_of_2(head_dim)
    max_rows = max(1, 4096 // block_d)
    if interpret:
        block_r = min(max_rows, triton.next_power_of_2(num_rows))
    else:
        block_r = 1
        while block_r < max_rows and num_rows // (2 * block_r) >= 1024:
            block_r *= 2
    vec = max(1, 16 // elem_size)
    num_warps = max(1, min(8, (block_r * block_d) // (vec * 64)))
    return block_r, block_d, num_warps


def relay_fusion_triton(o_sys, lse_sys, o_ctx, lse_ctx, out=None, out_lse=None, sys_index=None,
                        lse_layout="ht"):
    """Triton implementation of `relay_fusion` (CUDA tensors, or CPU ones under TRITON_INTERPRET=1).

    Same arguments, semantics and aliasing rules as `relay_fusion`.
    """
    _check_args(o_sys, lse_sys, o_ctx, lse_ctx, out, out_lse, sys_index, lse_layout)
    if not runs_triton(o_ctx):
        raise ValueError(
            f"relay_fusion_triton: tensors are on {o_ctx.device}; the Triton kernel needs CUDA "
            "tensors, or TRITON_INTERPRET=1 for CPU ones (use relay_fusion_torch instead)")
    if out is None:
        out = torch.empty_like(o_ctx)
    T, H, D = o_ctx.shape
    if T == 0 or H == 0:
        return out
    if o_sys.numel() == 0:  # every token untagged: never read, but must be a valid pointer
        o_sys, lse_sys = o_ctx, lse_ctx
    kernel = kernel_for(_relay_fusion_kernel, o_ctx)
    block_r, block_d, num_warps = _launch_config(T * H, D, o_ctx.element_size(), not o_ctx.is_cuda)
    ls_t, ls_h = _lse_strides(lse_sys, lse_layout)
    lc_t, lc_h = _lse_strides(lse_ctx, lse_layout)
    lo_t, lo_h = _lse_strides(out_lse, lse_layout) if out_lse is not None else (0, 0)
    out_is_ctx = out.data_ptr() == o_ctx.data_ptr() and out.stride() == o_ctx.stride()
    kernel[(triton.cdiv(T * H, block_r),)](
        out, out_lse if out_lse is not None else lse_ctx, o_sys, lse_sys, o_ctx, lse_ctx,
        sys_index if sys_index is not None else lse_ctx,
        T * H,
        out.stride(0), out.stride(1),
        o_sys.stride(0), o_sys.stride(1),
        o_ctx.stride(0), o_ctx.stride(1),
        ls_t, ls_h, lc_t, lc_h, lo_t, lo_h,
        NUM_HEADS=H, HEAD_DIM=D, BLOCK_R=block_r, BLOCK_D=block_d,
        HAS_SYS_INDEX=sys_index is not None, HAS_OUT_LSE=out_lse is not None,
        OUT_IS_CTX=out_is_ctx,
        num_warps=num_warps,
    )
    return out


def relay_fusion(o_sys, lse_sys, o_ctx, lse_ctx, out=None, out_lse=None, sys_index=None,
                 lse_layout="ht"):
    """Merge system and context attention outputs by their LSEs: out = a*o_sys + (1-a)*o_ctx.

    Args:
        o_sys: system-part output, shape [T, H, D] (or [Tsys, H, D] with `sys_index`), fp16, bf16
            or fp32; last dim contiguous, other strides arbitrary.
        lse_sys: natural-log LSE of `o_sys`, float32, shape [H, T] ("ht") or [T, H] ("th")
            (Tsys in place of T with `sys_index`). FlashInfer's base-2 LSE must be scaled by ln 2.
        o_ctx: context-part output, shape [T, H, D], same dtype as `o_sys`.
        lse_ctx: natural-log LSE of `o_ctx`, float32, shape [H, T] or [T, H] per `lse_layout`.
        out: optional output, shape [T, H, D], same dtype; may alias `o_ctx`, or `o_sys` when
            there is no `sys_index`. Allocated when None.
        out_lse: optional merged LSE (logaddexp), float32, same shape/layout as `lse_ctx`.
        sys_index: optional int32 [T]: the row of `o_sys`/`lse_sys` holding token t's system part,
            -1 for a token with no system part.
        lse_layout: "ht" (FlashAttention's [H, T]) or "th" ([T, H]).

    Returns:
        `out`, shape [T, H, D]. Tokens without a system part are exactly `o_ctx` (and `out_lse`
        exactly `lse_ctx`, except that an FA2 +inf is written as -inf); see the module docstring.

    Runs the Triton kernel for CUDA tensors or under TRITON_INTERPRET=1, `relay_fusion_torch`
    otherwise (the CPU backend).

    Example:
        >>> o = relay_fusion(o_sys, lse_sys, o_ctx, lse_ctx,  # doctest: +SKIP
        ...                  out=o_ctx, sys_index=plan.sys_index)
    """
    if runs_triton(o_ctx):
        return relay_fusion_triton(o_sys, lse_sys, o_ctx, lse_ctx, out, out_lse, sys_index, lse_layout)
    return relay_fusion_torch(o_sys, lse_sys, o_ctx, lse_ctx, out, out_lse, sys_index, lse_layout)


def _check_tensor(name: str, x: torch.Tensor, device: torch.device) -> None:
    if not isinstance(x, torch.Tensor):
        raise ValueError(f"relay_fusion: {name} must be a torch.Tensor, got {type(x).__name__}")
    if x.device != device:
        raise ValueError(f"relay_fusion: {name} is on {x.device}, expected {device} (o_ctx's device)")


def _check_args(o_sys, lse_sys, o_ctx, lse_ctx, out, out_lse, sys_index, lse_layout) -> None:
    """Launch checks shared by both implementations; raise ValueError naming the argument."""
    if lse_layout not in ("ht", "th"):
        raise ValueError(f"relay_fusion: lse_layout must be 'ht' or 'th', got {lse_layout!r}")
    if not isinstance(o_ctx, torch.Tensor):
        raise ValueError(f"relay_fusion: o_ctx must be a torch.Tensor, got {type(o_ctx).__name__}")
    dev = o_ctx.device
    if o_ctx.dim() != 3:
        raise ValueError(f"relay_fusion: o_ctx must be [T, H, D], got shape {tuple(o_ctx.shape)}")
    T, H, D = o_ctx.shape
    if o_ctx.dtype not in _FLOAT_DTYPES:
        raise ValueError(f"relay_fusion: o_ctx dtype must be fp16, bf16 or fp32, got {o_ctx.dtype}")
    _check_tensor("o_sys", o_sys, dev)
    if sys_index is not None:
        _check_tensor("sys_index", sys_index, dev)
        if sys_index.dtype != torch.int32 or tuple(sys_index.shape) != (T,):
            raise ValueError(f"relay_fusion: sys_index must be int32 of shape ({T},), got "
                             f"{sys_index.dtype} {tuple(sys_index.shape)}")
        if sys_index.stride(0) != 1 and T > 1:
            raise ValueError("relay_fusion: sys_index must be contiguous")
        t_sys = o_sys.shape[0] if o_sys.dim() == 3 else -1
    else:
        t_sys = T
    if o_sys.dim() != 3 or tuple(o_sys.shape) != (t_sys, H, D):
        want = f"[Tsys, {H}, {D}]" if sys_index is not None else f"[{T}, {H}, {D}]"
        raise ValueError(f"relay_fusion: o_sys must be {want}, got shape {tuple(o_sys.shape)}")
    if o_sys.dtype != o_ctx.dtype:
        raise ValueError(f"relay_fusion: o_sys dtype {o_sys.dtype} != o_ctx dtype {o_ctx.dtype}")

    def lse_shape(n):
        return (H, n) if lse_layout == "ht" else (n, H)

    for name, lse, n in (("lse_sys", lse_sys, t_sys), ("lse_ctx", lse_ctx, T), ("out_lse", out_lse, T)):
        if lse is None:
            continue
        _check_tensor(name, lse, dev)
        if lse.dtype != torch.float32:
            raise ValueError(f"relay_fusion: {name} must be float32, got {lse.dtype}")
        if tuple(lse.shape) != lse_shape(n):
            raise ValueError(f"relay_fusion: {name} must have shape {lse_shape(n)} for lse_layout="
                             f"{lse_layout!r}, got {tuple(lse.shape)}")
    if out is not None:
        _check_tensor("out", out, dev)
        if tuple(out.shape) != (T, H, D) or out.dtype != o_ctx.dtype:
            raise ValueError(f"relay_fusion: out must be {o_ctx.dtype} of shape {(T, H, D)}, got "
                             f"{out.dtype} {tuple(out.shape)}")
    for name, x in (("o_sys", o_sys), ("o_ctx", o_ctx), ("out", out)):
        if x is not None and x.numel() > 0 and x.stride(2) != 1 and D > 1:
            raise ValueError(f"relay_fusion: {name} must have a contiguous last dim, got strides "
                             f"{tuple(x.stride())}")
    if (sys_index is not None and out is not None and o_sys.numel() > 0
            and out.untyped_storage().data_ptr() == o_sys.untyped_storage().data_ptr()):
        raise ValueError("relay_fusion: out may not alias o_sys when sys_index is given "
                         "(rows are gathered, so another token's program could overwrite them)")
