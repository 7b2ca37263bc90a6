"""One key split for every batch of a FlashAttention-3 call whose graph was captured split.

A full CUDA graph fixes FlashAttention-3's split count at capture (vLLM's cap: 32), and its
ahead-of-time schedule picks each batch's count per step, up to the cap: for a level of a few
hundred rows over a short prompt it picks 2 splits where one wave of unsplit tiles is faster (and
the split combine then runs over every group of the graph's call). The schedule is a persistent
int32 buffer the captured kernels read at replay; for a varlen call with a dynamic split it is laid
out [rows of each batch (b4) | splits of each batch (b4) | tile semaphore], b4 = batch rounded up to
4 (`get_scheduler_metadata` in vLLM 0.26's `vllm_flash_attn`, hopper/flash_api.cpp). Writing 1
into the splits makes the captured kernels run each batch whole and write its output and LSE
directly (FA3 itself does so for batches it will not split; its combine skips them): the same
attention, one wave of tiles, no combine.
"""

import torch


def force_one_split(scheduler_metadata: torch.Tensor, batch: int) -> bool:
    """Set every batch's split count in `scheduler_metadata` (FA3's dynamic-split schedule of a
    varlen call over `batch` batches) to 1. Returns False, leaving it untouched, when its length is
    not that layout's (no dynamic split, or another FlashAttention version): FA3's choice stands.

    Example:
        >>> sched = torch.tensor([5, 3, 0, 0, 2, 2, 0, 0, 0], dtype=torch.int32)
        >>> force_one_split(sched, 2), sched.tolist()
        (True, [5, 3, 0, 0, 1, 1, 1, 1, 0])
        >>> force_one_split(torch.zeros(5, dtype=torch.int32), 2)  # no split vector
        False
    """
    b4 = -(-batch // 4) * 4
    if scheduler_metadata.dtype != torch.int32 or scheduler_metadata.shape != (2 * b4 + 1,):
        return False
    scheduler_metadata[b4: 2 * b4] = 1
    return True
