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

`graph_split_cap`: the cap itself need not be vLLM's 32. FA3 sizes a call's split workspace by the
cap (fp32 [cap, heads, rows, head dim]: 512 MiB for 1024 rows of 32 heads of 128 at 32 splits, in
every captured graph's pool), while its dynamic schedule never gives any batch more than
`most_dynamic_splits` splits. A cap at that bound changes no split; at head size 128 not even the
combine kernel's template (chosen by the cap: one up to 32), so the results are the same bit for bit
(at smaller head sizes the template may differ: the same sums, perhaps in another order). What changes
is the memory, which goes back to the KV cache.
"""

import math
from fractions import Fraction

import torch

# FA3 splits each sequence of a varlen call by its share of the work (its dynamic split) only in calls
# of at most this many sequences (`PREPARE_VARLEN_MAX_BATCHES_1CTA`, hopper/flash_api.cpp); in larger
# ones a split applies to every sequence alike.
FA3_DYNAMIC_SPLIT_BATCHES = 992


def most_dynamic_splits(num_sms: int, num_kv_heads: int) -> int:
    """The most key splits FA3's dynamic schedule gives any batch of a varlen call on `num_sms`
    multiprocessors with `num_kv_heads` KV heads, whatever its rows, keys and cap.

    FA3's `prepare_varlen_num_blocks` (hopper/flash_prepare_scheduler.cu) gives a batch of n key
    blocks ceil(n / b) splits, b = ceil(T * 1.1 * heads / num_sms), T >= n the call's query x key
    blocks; heads is the KV heads' count, as a split call always packs GQA. So n / b <= num_sms /
    (1.1 * heads) (exact rationals here: on an H100, 132 SMs over 8 heads is exactly 15).

    Example:
        >>> most_dynamic_splits(132, 32), most_dynamic_splits(132, 8), most_dynamic_splits(132, 1)
        (4, 15, 120)
    """
    return max(1, math.ceil(Fraction(10 * num_sms, 11 * num_kv_heads)))


def graph_split_cap(cap: int, num_sms: int, num_kv_heads: int) -> int:
    """vLLM's cap of FA3's splits in a CUDA graph (`cap`, 0 or 1: unsplit) lowered to what FA3's
    schedule can use, never below 2 (a cap of 2 or more runs FA3's split kernels, one of 1 others).

    Example:
        >>> graph_split_cap(32, 132, 32), graph_split_cap(32, 132, 1), graph_split_cap(0, 132, 32)
        (4, 32, 0)
    """
    if cap <= 1:
        return cap
    return min(cap, max(2, most_dynamic_splits(num_sms, num_kv_heads)))


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
