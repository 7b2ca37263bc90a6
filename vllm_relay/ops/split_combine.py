"""Partial attention outputs over disjoint key ranges of the same rows, merged into one by their LSEs.

A kernel whose programs are too few to fill the GPU (a level of a few rows over a long key range: one
program per tile of rows and KV head, each looping over every key) splits each program's keys into
`S` ranges, one program each, and writes each range's result as a partial: `part_out[s]`, the
attention over range s alone (normalised, fp32), and `part_lse[s]`, its natural-log LSE (-inf where
the row sees no key of the range; its output is 0 there). Merged:

    lse = log(sum_s exp(part_lse[s]))            out = sum_s exp(part_lse[s] - lse) * part_out[s]

A row that sees no key of any range gets out = 0 and lse = -inf (FlashAttention-3's convention).
`combine_splits` is the Triton kernel (one program a row, every head); `combine_splits_torch` its torch
twin, in fp32. Rows outside `start[0]` .. `end[0]` - 1 (read on the device: a step's rows under a CUDA
graph) are left as they are.
"""

import torch
import triton
import triton.language as tl

from vllm_relay.ops.interpreter import kernel_for, runs_triton


@triton.jit(do_not_specialize=["stride_ps", "stride_ls", "stride_lh", "stride_olh"],
            do_not_specialize_on_alignment=["start_ptr", "end_ptr"])
def _combine_kernel(part_out_ptr, part_lse_ptr, out_ptr, lse_ptr, start_ptr, end_ptr,
                    stride_ps, stride_pt, stride_ph, stride_ls, stride_lh, stride_ot, stride_oh, stride_olh,
                    SPLITS: tl.constexpr, HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
                    BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr):
    row = tl.program_id(0)
    if (row < tl.load(start_ptr)) | (row >= tl.load(end_ptr)):
        return
    h = tl.arange(0, BLOCK_H)
    d = tl.arange(0, BLOCK_D)
    h_mask = h < HEADS
    mask = h_mask[:, None] & (d < HEAD_DIM)[None, :]
    m = tl.full([BLOCK_H], float("-inf"), tl.float32)
    for s in tl.static_range(SPLITS):
        m = tl.maximum(m, tl.load(part_lse_ptr + s * stride_ls + h * stride_lh + row, mask=h_mask,
                                  other=float("-inf")))
    m_safe = tl.where(m == float("-inf"), 0.0, m)
    acc = tl.full([BLOCK_H, BLOCK_D], 0.0, tl.float32)
    total = tl.full([BLOCK_H], 0.0, tl.float32)
    for s in tl.static_range(SPLITS):
        w = tl.exp(tl.load(part_lse_ptr + s * stride_ls + h * stride_lh + row, mask=h_mask,
                           other=float("-inf")) - m_safe)
        o = tl.load(part_out_ptr + s * stride_ps + row * stride_pt + h[:, None] * stride_ph + d[None, :],
                    mask=mask, other=0.0)
        acc += w[:, None] * o
        total += w
    seen = total > 0
    out = acc / tl.where(seen, total, 1.0)[:, None]
    tl.store(out_ptr + row * stride_ot + h[:, None] * stride_oh + d[None, :],
             out.to(out_ptr.dtype.element_ty), mask=mask)
    lse = tl.where(seen, m_safe + tl.log(tl.where(seen, total, 1.0)), float("-inf"))
    tl.store(lse_ptr + h * stride_olh + row, lse, mask=h_mask)


def combine_splits(part_out: torch.Tensor, part_lse: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
                   start: torch.Tensor, end: torch.Tensor) -> None:
    """Merge `S` partials of each row into `out` and `lse`, in place, rows `start[0]` .. `end[0]` - 1 only.

    Args:
        part_out: float32 [S, N, H, D], contiguous in its last dim: range s's output (0 where it sees no key).
        part_lse: float32 [S, H, N], contiguous in its last dim: range s's natural-log LSE (-inf: no key).
        out: [N, H, D] fp16/bf16/fp32, contiguous in its last dim.
        lse: float32 [H, N], contiguous in its last dim.
        start, end: int32 tensors on the partials' device: the first row to merge, and the row past the last,
            each its first element (e.g. `cu_seqlens_q[:1]` and `cu_seqlens_q[G:]`).

    The Triton kernel on CUDA tensors (and on CPU ones under TRITON_INTERPRET=1), else the torch twin.
    No host synchronization: the launch can be captured in a CUDA graph.
    """
    if not runs_triton(part_out):
        return combine_splits_torch(part_out, part_lse, out, lse, start, end)  # (which checks them)
    _check(part_out, part_lse, out, lse)
    S, N, H, D = part_out.shape
    if N == 0:
        return None
    kernel = kernel_for(_combine_kernel, part_out)
    block_d = triton.next_power_of_2(D)
    kernel[(N,)](part_out, part_lse, out, lse, start, end, *part_out.stride()[:3],
                 part_lse.stride(0), part_lse.stride(1), out.stride(0), out.stride(1), lse.stride(0),
                 SPLITS=S, HEADS=H, HEAD_DIM=D, BLOCK_H=triton.next_power_of_2(H), BLOCK_D=block_d,
                 num_warps=4 if H * block_d <= 4096 else 8)
    return None


def combine_splits_torch(part_out: torch.Tensor, part_lse: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
                         start: torch.Tensor, end: torch.Tensor) -> None:
    """Torch implementation of `combine_splits` (fp32; reads `start` and `end` on the host)."""
    _check(part_out, part_lse, out, lse)
    a, n = max(int(start.reshape(-1)[0]), 0), min(int(end.reshape(-1)[0]), part_out.shape[1])
    if n <= a:
        return None
    parts = part_lse[:, :, a:n].float()  # [S, H, rows]
    total = torch.logsumexp(parts, dim=0)  # -inf where every range is empty
    w = torch.exp(parts - total.masked_fill(total == float("-inf"), 0.0)[None])  # 0 for empty ranges
    o = torch.einsum("shn,snhd->nhd", w, part_out[:, a:n].float())
    out[a:n] = o.to(out.dtype)
    lse[:, a:n] = total
    return None


def _check(part_out, part_lse, out, lse) -> None:
    if part_out.dim() != 4 or part_lse.dim() != 3:
        raise ValueError(f"combine_splits: need part_out [S, N, H, D] and part_lse [S, H, N], got "
                         f"{tuple(part_out.shape)}, {tuple(part_lse.shape)}")
    S, N, H, D = part_out.shape
    if part_lse.shape != (S, H, N) or out.shape != (N, H, D) or lse.shape != (H, N):
        raise ValueError(f"combine_splits: shapes {tuple(part_out.shape)}, {tuple(part_lse.shape)}, "
                         f"{tuple(out.shape)}, {tuple(lse.shape)} do not agree")
    if part_out.dtype != torch.float32 or part_lse.dtype != torch.float32 or lse.dtype != torch.float32:
        raise ValueError("combine_splits: the partials and the LSE must be float32")
    for t in (part_out, part_lse, out, lse):
        if t.stride(-1) != 1:
            raise ValueError("combine_splits: every tensor must be contiguous in its last dim")
