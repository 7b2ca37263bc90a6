"""Gather the shared levels' query rows: `out[i] = src[perm[i]]` for the first `count` rows.

Inside a CUDA graph the number of level rows changes every step while the launch is fixed: an
`index_select` over the capture's whole row capacity copies every padding row too (at 512 tokens
and 4 levels, 16 MB per layer on a Llama-7B shape). This kernel reads the step's row count from
device memory and its programs past it return at once, so an empty level costs one launch.
"""

import torch
import triton
import triton.language as tl

from vllm_relay.ops.interpreter import kernel_for, runs_triton


def gather_rows_torch(src, perm, count, out):
    """Torch implementation of `gather_rows` (the CPU path and the kernel's test twin)."""
    _check_args(src, perm, count, out)
    n = int(count.reshape(-1)[0])
    torch.index_select(src, 0, perm[:n].long(), out=out[:n])
    return out


# Triton compiles a kernel again for a pointer that is 16-byte aligned where earlier ones were not.
# The planner's count is `cu[G]` of its persistent plan, aligned only when the step has a multiple of
# four levels: a step with four levels after steps with one to three compiled it mid-run (132 ms of a
# step on the H100, 2026-11-27: benchmarks/results/archive/2026-11-26_ceiling/README.md, the 06:33
# run). One load of one int32
# needs no alignment, so one compiled kernel serves every count.
@triton.jit(do_not_specialize=["max_rows"], do_not_specialize_on_alignment=["count_ptr"])
def _gather_rows_kernel(src_ptr, perm_ptr, count_ptr, out_ptr, max_rows, stride_src, stride_out,
                        ROW: tl.constexpr, BLOCK: tl.constexpr, ROWS_PER_PROGRAM: tl.constexpr):
    n = tl.minimum(tl.load(count_ptr), max_rows)
    first = tl.program_id(0) * ROWS_PER_PROGRAM
    if first >= n:
        return
    cols = tl.arange(0, BLOCK)
    for i in tl.static_range(ROWS_PER_PROGRAM):
        row = first + i
        if row < n:
            t = tl.load(perm_ptr + row).to(tl.int64)
            for c in tl.static_range(0, ROW, BLOCK):
                mask = c + cols < ROW
                v = tl.load(src_ptr + t * stride_src + c + cols, mask=mask)
                tl.store(out_ptr + row.to(tl.int64) * stride_out + c + cols, v, mask=mask)


def gather_rows_triton(src, perm, count, out):
    """Triton implementation of `gather_rows` (CUDA, or CPU under TRITON_INTERPRET=1)."""
    _check_args(src, perm, count, out)
    rows = perm.shape[0]
    if rows == 0:
        return out
    kernel = kernel_for(_gather_rows_kernel, src)
    row = src[0].numel()
    block = min(4096, triton.next_power_of_2(row))
    per = 4
    kernel[(triton.cdiv(rows, per),)](src, perm, count, out, rows, src.stride(0), out.stride(0),
                                      ROW=row, BLOCK=block, ROWS_PER_PROGRAM=per,
                                      num_warps=max(1, min(8, block // 256)))
    return out


def gather_rows(src, perm, count, out):
    """Copy rows `perm[:count]` of `src` into `out[:count]`; rows of `out` past `count` untouched.

    Args:
        src: [T, ...] (rows contiguous), any dtype: the step's queries [T, Hq, D].
        perm: int32 [N], the source row of each output row (entries past `count` may be anything).
        count: int32 [1] on src's device: the rows to copy this step (at most N); read on the
            device, so a CUDA graph captured once replays any count.
        out: [>= N, ...] like src.

    Returns:
        `out`.

    Example:
        >>> gather_rows(q, level.perm, level.num_rows, level.q_buf)  # doctest: +SKIP
    """
    if runs_triton(src):
        return gather_rows_triton(src, perm, count, out)
    return gather_rows_torch(src, perm, count, out)


def warm_up_gather_rows(perm, out) -> None:
    """Compile the kernel every `gather_rows(src, perm[:n], count, out[:n])` of a step will launch, with `src`
    rows shaped and typed as `out`'s (FP8 rows gathered as bytes: pass `out` viewed as uint8), by one
    launch that copies no row. A step whose levels run outside any CUDA graph (speculative decoding's
    verification steps, prompt chunks) otherwise compiles it in the first such step of a loaded server.
    A no-op off CUDA."""
    if not perm.is_cuda:
        return
    src = torch.empty(1, *out.shape[1:], dtype=out.dtype, device=out.device)
    gather_rows_triton(src, perm[:1], torch.zeros(1, dtype=torch.int32, device=perm.device), out[:1])


def _check_args(src, perm, count, out) -> None:
    if perm.dtype != torch.int32 or count.dtype != torch.int32 or perm.dim() != 1 or count.numel() != 1:
        raise ValueError(f"gather_rows: perm must be int32 [N] and count int32 [1], got {perm.dtype} "
                         f"{tuple(perm.shape)} and {count.dtype} {tuple(count.shape)}")
    if out.dtype != src.dtype or out.shape[1:] != src.shape[1:] or out.shape[0] < perm.shape[0]:
        raise ValueError(f"gather_rows: out must be {src.dtype} [>= {perm.shape[0]}, "
                         f"{', '.join(map(str, src.shape[1:]))}], got {out.dtype} {tuple(out.shape)}")
    for name, x in (("src", src), ("out", out)):
        if x.numel() and not x[0].is_contiguous():
            raise ValueError(f"gather_rows: {name}'s rows must be contiguous")
    for name, x in (("perm", perm), ("count", count), ("out", out)):
        if x.device != src.device:
            raise ValueError(f"gather_rows: {name} is on {x.device}, not {src.device}")
