"""The levels' merge into the running output, as `relay_attention` runs it once per layer.

`fuse_in_place` is `relay_fusion` (this package's relay_fusion.py: the LSE merge, its conventions,
its torch reference) applied once per level a token reads, `relay_fusion(o_level, lse_level, out,
lse, out=out, out_lse=lse, sys_index=row_index[k])` for k = 0, 1, ..., with every layout fixed
(contiguous [T, H, D] outputs, FlashAttention's [H, T] LSEs) so that one launch with two counts
does it: the running state stays in fp32 registers across a token's levels and is stored once.
Any other layout, and the CPU, take `relay_fusion` level by level (the reference it is tested
against).
"""

import torch
import triton
import triton.language as tl

from vllm_relay.ops.interpreter import kernel_for, runs_triton
from vllm_relay.ops.relay_fusion import _blend, _launch_config, _merge_weights, relay_fusion


@triton.jit(do_not_specialize=["num_tokens", "lse_stride", "lse_lvl_stride"])
def _fuse_in_place_kernel(
    out_ptr, lse_ptr, o_lvl_ptr, lse_lvl_ptr, row_ptr, num_tokens, lse_stride, lse_lvl_stride, ctx_ptr, ctx_start_ptr,
    NUM_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_D: tl.constexpr,
    UPDATE_LSE: tl.constexpr,
    LEVELS: tl.constexpr,
    JOINT: tl.constexpr,
):
    # `relay_attention`'s merge of the shared levels into the running output, with every layout
    # fixed (contiguous [T, H, D] outputs, FlashAttention's [H, T] LSEs, head strides `lse_stride` and
    # `lse_lvl_stride`), so the launch passes pointers and counts only: it runs once per layer, often
    # outside any CUDA graph. A token has up to LEVELS level rows (row_ptr is [LEVELS, T]); the
    # running state stays in fp32 registers across them and is stored once. JOINT: the context's
    # output and LSE are read from `ctx_ptr` and `lse_ptr` at row *ctx_start_ptr + t (one call's
    # output of the levels and the context, `fuse_joint`) and every token is stored; else from `out_ptr`
    # and `lse_ptr` at row t, and only tokens with a level row are stored (the others hold it already).
    r = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    r_mask = r < num_tokens * NUM_HEADS
    t = r // NUM_HEADS
    h = r % NUM_HEADS
    d = tl.arange(0, BLOCK_D)
    d_mask = (d < HEAD_DIM)[None, :]
    row_off = (t * NUM_HEADS + h)[:, None] * HEAD_DIM + d[None, :]
    if JOINT:
        tc = t + tl.load(ctx_start_ptr).to(tl.int64)
        src_ptr = ctx_ptr
    else:
        tc = t
        src_ptr = out_ptr
    src_off = (tc * NUM_HEADS + h)[:, None] * HEAD_DIM + d[None, :]
    if JOINT:
        any_row = r_mask
    else:  # whether a token has any level row (a max of the rows, not an OR of masks: Triton 3.6
        # fails to compile i1 masks OR-ed across an unrolled loop at some tile shapes)
        last = tl.load(row_ptr + t, mask=r_mask, other=-1)
        for k in tl.static_range(1, LEVELS):
            last = tl.maximum(last, tl.load(row_ptr + k * num_tokens + t, mask=r_mask, other=-1))
        any_row = last >= 0
    lc = tl.load(lse_ptr + h * lse_stride + tc, mask=any_row, other=float("-inf"))
    oc_raw = tl.load(src_ptr + src_off, mask=any_row[:, None] & d_mask)
    oc = oc_raw.to(tl.float32)
    touched = r < 0  # no row merged yet
    for k in tl.static_range(LEVELS):
        s = tl.load(row_ptr + k * num_tokens + t, mask=r_mask, other=-1).to(tl.int64)
        has = s >= 0
        ls = tl.load(lse_lvl_ptr + h * lse_lvl_stride + s, mask=has, other=float("-inf"))
        ws, wc, sys_empty, ctx_empty, merged = _merge_weights(ls, lc)
        os_ = tl.load(o_lvl_ptr + (s * NUM_HEADS + h)[:, None] * HEAD_DIM + d[None, :],
                      mask=(has & ~sys_empty)[:, None] & d_mask, other=0.0)
        oc = _blend(ws, wc, sys_empty, ctx_empty, os_, oc)
        lc = merged
        touched = touched | (has & ~sys_empty)
    if JOINT:
        touched = r_mask
    tl.store(out_ptr + row_off, oc.to(oc_raw.dtype), mask=touched[:, None] & d_mask)
    if UPDATE_LSE:
        tl.store(lse_ptr + h * lse_stride + tc, lc, mask=any_row)


def fuse_in_place(out, lse, o_level, lse_level, row_index, update_lse: bool) -> torch.Tensor:
    """Merge shared levels into `out` in place: for each k, `relay_fusion(o_level, lse_level, out,
    lse, out=out, out_lse=lse, sys_index=row_index[k])`, for `relay_attention`'s layouts, in one
    launch with little host work (it runs once per layer). Falls back to `relay_fusion` for any
    other layout, and on the CPU.

    Args:
        out: [T, H, D] running output (contiguous), fp16/bf16/fp32; lse: its LSE, float32 [H, T]
            (contiguous), updated in place when `update_lse`.
        o_level: [N, H, D] (contiguous) levels' output; lse_level: float32 [H, N] (contiguous).
        row_index: int32 [T] or [L, T] (contiguous): each token's row in each level, -1 for none.
    """
    T, H, D = out.shape
    N = o_level.shape[0]
    rows = row_index.view(-1, T) if row_index.dim() == 1 else row_index
    if not (runs_triton(out) and out.is_contiguous() and o_level.is_contiguous() and lse.is_contiguous()
            and lse_level.is_contiguous() and lse.shape == (H, T) and lse_level.shape == (H, N)
            and o_level.shape[1:] == out.shape[1:] and rows.shape[1] == T and rows.is_contiguous()):
        levels = rows.shape[0]
        for k in range(levels):
            relay_fusion(o_level, lse_level, out, lse, out=out,
                         out_lse=lse if update_lse or k < levels - 1 else None, sys_index=rows[k])
        return out
    if T == 0:
        return out
    block_r, block_d, num_warps = _launch_config(T * H, D, out.element_size(), not out.is_cuda)
    kernel = kernel_for(_fuse_in_place_kernel, out)
    kernel[(triton.cdiv(T * H, block_r),)](
        out, lse, o_level if N else out, lse_level if N else lse, rows, T, T, N, out, rows,
        NUM_HEADS=H, HEAD_DIM=D, BLOCK_R=block_r, BLOCK_D=block_d, UPDATE_LSE=update_lse,
        LEVELS=rows.shape[0], JOINT=False, num_warps=num_warps)
    return out


def fuse_joint(out, o_all, lse_all, ctx_start, row_index) -> torch.Tensor:
    """The output of one call over the levels' rows and the tokens' own (`relay_attention` with a
    joint level): `out[t]` = token t's context row `o_all[ctx_start + t]` merged with its level rows
    `o_all[row_index[k, t]]` by their LSEs, every token written (those with no level row: their
    context row as is).

    Args:
        out: [T, H, D] output (contiguous), fp16/bf16/fp32.
        o_all: [R, H, D] (contiguous), the call's output: level rows from 0, the tokens' from ctx_start.
        lse_all: float32 [H, R] (last dim contiguous), its LSE.
        ctx_start: int32 [1] (device), the first token row (the level rows' count).
        row_index: int32 [T] or [L, T] (contiguous): each token's row in each level, -1 for none.
    """
    T, H, D = out.shape
    rows = row_index.view(-1, T) if row_index.dim() == 1 else row_index
    if not (runs_triton(out) and out.is_contiguous() and o_all.is_contiguous()
            and lse_all.stride(1) == 1 and rows.is_contiguous()):
        start = int(ctx_start.reshape(-1)[0])  # level by level, in fp32 (rounded once, as the kernel)
        acc, o_levels = o_all[start: start + T].to(torch.float32, copy=True), o_all.float()
        lse = lse_all[:, start: start + T].contiguous()
        for k in range(rows.shape[0]):
            relay_fusion(o_levels, lse_all, acc, lse, out=acc, out_lse=lse if k < rows.shape[0] - 1 else None,
                         sys_index=rows[k])
        return out.copy_(acc)
    if T == 0:
        return out
    block_r, block_d, num_warps = _launch_config(T * H, D, out.element_size(), not out.is_cuda)
    kernel = kernel_for(_fuse_in_place_kernel, out)
    kernel[(triton.cdiv(T * H, block_r),)](
        out, lse_all, o_all, lse_all, rows, T, lse_all.stride(0), lse_all.stride(0), o_all, ctx_start,
        NUM_HEADS=H, HEAD_DIM=D, BLOCK_R=block_r, BLOCK_D=block_d, UPDATE_LSE=False,
        LEVELS=rows.shape[0], JOINT=True, num_warps=num_warps)
    return out


def warm_up_fuse_in_place(num_heads: int, head_dim: int, dtype: torch.dtype, device, max_tokens: int,
                          update_lse: bool = False, levels: int = 1, joint_too: bool = False) -> int:
    """Compile every `fuse_in_place` kernel that steps of up to `max_tokens` tokens can launch (and
    with `joint_too`, every `fuse_joint` kernel).

    Its tile height depends on the step's size, and Triton compiles each one on first use (about a
    second each); without this the first large steps of a loaded server stall on compilations.
    Each variant runs once with no rows (it touches no memory). Returns the variants launched.
    """
    device = torch.device(device)
    if device.type != "cuda":
        return 0
    elem = torch.empty((), dtype=dtype).element_size()
    configs = {_launch_config(t * num_heads, head_dim, elem, False) for t in _powers_of_two(max_tokens)}
    out = torch.zeros(1, num_heads, head_dim, dtype=dtype, device=device)
    lse = torch.zeros(num_heads, 1, dtype=torch.float32, device=device)
    rows = torch.full((levels,), -1, dtype=torch.int32, device=device)
    start = torch.zeros(1, dtype=torch.int32, device=device)
    for block_r, block_d, num_warps in sorted(configs):
        for joint in (False, True) if joint_too else (False,):
            _fuse_in_place_kernel[(1,)](out, lse, out, lse, rows, 0, 1, 1, out, start, NUM_HEADS=num_heads,
                                        HEAD_DIM=head_dim, BLOCK_R=block_r, BLOCK_D=block_d,
                                        UPDATE_LSE=update_lse and not joint, LEVELS=levels, JOINT=joint,
                                        num_warps=num_warps)
    return len(configs)


def _powers_of_two(n: int):
    """1, 2, 4, ... up to the first power of two >= n (the launch config is monotonic in the size)."""
    t = 1
    while True:
        yield t
        if t >= n:
            return
        t *= 2
