"""n-gram drafts over a request's whole token list when its system prompt's tokens live elsewhere.

vLLM's n-gram speculator (Model Runner V2, `NgramGPUSpeculator`) finds, in each request's token ids,
the latest earlier occurrence of the longest suffix of `min_n`..`max_n` tokens and proposes the `k`
tokens that followed it. A relay request holds only its own tokens (its registered system prompt is in
the slot's pages, and its positions are shifted past it), so vLLM's search would never look into the
system prompt: other drafts than vLLM's for the same request, and with seeded sampling other samples.
These kernels are vLLM's two (scan, finalize), the same arithmetic, reading each row's token ids as
[its slot's `shift` system tokens ; its own tokens]: the drafts vLLM makes for the full prompt. (The
reductions are `interpreter.py`'s, and `tl.zeros` is spelled as `tl.full`: Triton's interpreter runs those
@jit functions of triton.language only when TRITON_INTERPRET was set before triton was imported, and the
tests set it later.)
`ngram_drafts_reference` is the same search in plain Python.
"""

import torch
import triton
import triton.language as tl

from vllm_relay.ops.interpreter import kernel_for, reduce_max, reduce_sum


@triton.jit
def _token(own_row, sys_row, pos, shift, mask):
    """Token ids at the (virtual) positions `pos`: the system prompt's below `shift`, then the own ids."""
    in_sys = pos < shift
    a = tl.load(sys_row + pos, mask=mask & in_sys, other=0)
    b = tl.load(own_row + (pos - shift), mask=mask & (pos >= shift), other=0)
    return tl.where(in_sys, a, b).to(tl.int32)


@triton.jit
def _ngram_scan_kernel(token_ids_ptr, token_ids_stride, idx_mapping_ptr, total_len_ptr, num_sampled_ptr,
                       sys_ids_ptr, sys_stride, row_slot_ptr, row_shift_ptr, scratch_ptr, scratch_stride, L,
                       MIN_N: tl.constexpr, MAX_N: tl.constexpr, MAX_N_PO2: tl.constexpr,
                       BLOCK_L: tl.constexpr):
    b = tl.program_id(0).to(tl.int64)
    blk = tl.program_id(1).to(tl.int64)
    Lp1 = tl.cast(L, tl.int64) + 1
    req_state_idx = tl.load(idx_mapping_ptr + b).to(tl.int64)
    shift = tl.load(row_shift_ptr + b).to(tl.int64)
    slot = tl.maximum(tl.load(row_slot_ptr + b).to(tl.int64), 0)
    seq_len = tl.load(total_len_ptr + req_state_idx).to(tl.int64) + shift
    num_sampled = tl.load(num_sampled_ptr + b)
    eligible_row = (num_sampled > 0) & (seq_len >= MIN_N)
    scratch_off = b * scratch_stride + blk
    if not (eligible_row & (blk * BLOCK_L <= seq_len - MIN_N - 1)):
        tl.store(scratch_ptr + scratch_off, tl.full((), 0, tl.int64))
        return
    own_row = token_ids_ptr + req_state_idx * token_ids_stride
    sys_row = sys_ids_ptr + slot * sys_stride
    suf_iota = tl.arange(0, MAX_N_PO2).to(tl.int64)
    suf_pos = seq_len - MAX_N + suf_iota
    suf_in_range = (suf_iota < MAX_N) & (suf_pos >= 0) & (suf_pos < seq_len)
    suffix = tl.where(suf_in_range, _token(own_row, sys_row, suf_pos, shift, suf_in_range), -1)
    pos = blk * BLOCK_L + tl.arange(0, BLOCK_L).to(tl.int64)
    best_score = tl.full([BLOCK_L], 0, tl.int64)
    for n_iter in tl.static_range(MIN_N, MAX_N + 1):
        match = (pos >= 0) & (pos <= seq_len - n_iter - 1)
        for j in tl.static_range(0, n_iter):
            tok = _token(own_row, sys_row, pos + j, shift, match)
            at_j = tl.where(suf_iota == (MAX_N - n_iter) + j, suffix, 0)
            suf_val = reduce_sum(at_j, 0)
            match = match & (tok == suf_val)
        best_score = tl.where(match, n_iter * Lp1 + pos + 1, best_score)  # longest n, then rightmost pos
    tl.store(scratch_ptr + scratch_off, reduce_max(best_score, 0))


@triton.jit
def _ngram_finalize_kernel(token_ids_ptr, token_ids_stride, idx_mapping_ptr, total_len_ptr, num_sampled_ptr,
                           last_sampled_ptr, sys_ids_ptr, sys_stride, row_slot_ptr, row_shift_ptr,
                           scratch_ptr, scratch_stride, drafts_ptr, L, N_BLOCKS, K: tl.constexpr,
                           K_PO2: tl.constexpr, N_BLOCKS_PO2: tl.constexpr):
    b = tl.program_id(0).to(tl.int64)
    Lp1 = tl.cast(L, tl.int64) + 1
    req_state_idx = tl.load(idx_mapping_ptr + b).to(tl.int64)
    shift = tl.load(row_shift_ptr + b).to(tl.int64)
    slot = tl.maximum(tl.load(row_slot_ptr + b).to(tl.int64), 0)
    nb = tl.arange(0, N_BLOCKS_PO2).to(tl.int64)
    score = reduce_max(tl.load(scratch_ptr + b * scratch_stride + nb, mask=nb < N_BLOCKS, other=0), 0)
    seq_len = tl.load(total_len_ptr + req_state_idx).to(tl.int64) + shift
    num_sampled = tl.load(num_sampled_ptr + b)
    last_tok = tl.load(last_sampled_ptr + req_state_idx)
    has_match = score > 0
    s1 = score - 1
    best_n = tl.where(has_match, s1 // Lp1, 0)
    best_pos = tl.where(has_match, s1 - best_n * Lp1, 0)
    draft_start = tl.where(has_match, best_pos + best_n, 0)
    tokens_avail = tl.maximum(seq_len - draft_start, 0)
    k = tl.arange(0, K_PO2).to(tl.int64)
    gather = tl.minimum(draft_start + k, tl.cast(L, tl.int64) - 1)
    valid = (k < tokens_avail) & (num_sampled > 0) & has_match & (k < K)
    own_row = token_ids_ptr + req_state_idx * token_ids_stride
    gathered = _token(own_row, sys_ids_ptr + slot * sys_stride, gather, shift, valid).to(tl.int64)
    tl.store(drafts_ptr + b * K + k, tl.where(valid, gathered, last_tok), mask=k < K)


def ngram_drafts(token_ids, idx_mapping, total_len, num_sampled, last_sampled, sys_ids, row_slot, row_shift,
                 scratch, drafts, max_model_len: int, min_n: int, max_n: int, block_l: int) -> torch.Tensor:
    """Each batch row's `drafts.shape[1]` draft tokens into `drafts` (int64 [>= B, K]), as vLLM's n-gram
    speculator makes them from the row's token list [its system tokens ; its own].

    Args:
        token_ids: int32 [R, W] each request state's own token ids (vLLM's `all_token_ids`).
        idx_mapping: int [B] each batch row's request state; total_len: int32 [R] its own token count.
        num_sampled: int32 [B] tokens sampled for the row last step (0: no drafts, as vLLM).
        last_sampled: int64 [R] (or [R, 1]) each request state's last sampled token, the fill value.
        sys_ids: int32 [S, P] each slot's system prompt token ids.
        row_slot: int [>= B] each batch row's slot (any value where its shift is 0); row_shift: int [>= B]
            its system tokens (0: a request with no registered prompt).
        scratch: int64 [>= B, cdiv(max_model_len, block_l)] per-block best matches (overwritten).
    """
    B, K = idx_mapping.shape[0], drafts.shape[1]
    if B == 0:
        return drafts[:0]
    n_blocks = triton.cdiv(max_model_len, block_l)
    kernel_for(_ngram_scan_kernel, token_ids)[(B, n_blocks)](
        token_ids, token_ids.stride(0), idx_mapping, total_len, num_sampled, sys_ids, sys_ids.stride(0),
        row_slot, row_shift, scratch, scratch.stride(0), max_model_len, MIN_N=min_n, MAX_N=max_n,
        MAX_N_PO2=max(1, triton.next_power_of_2(max_n)), BLOCK_L=block_l, num_warps=4, num_stages=2)
    kernel_for(_ngram_finalize_kernel, token_ids)[(B,)](
        token_ids, token_ids.stride(0), idx_mapping, total_len, num_sampled, last_sampled.view(-1), sys_ids,
        sys_ids.stride(0), row_slot, row_shift, scratch, scratch.stride(0), drafts, max_model_len, n_blocks,
        K=K, K_PO2=max(1, triton.next_power_of_2(K)), N_BLOCKS_PO2=max(1, triton.next_power_of_2(n_blocks)),
        num_warps=2, num_stages=1)
    return drafts[:B]


def ngram_drafts_reference(tokens: list[int], num_sampled: int, last_token: int, min_n: int, max_n: int,
                           k: int) -> list[int]:
    """One request's `k` drafts from its whole token list `tokens`: the tokens after the rightmost earlier
    occurrence of its longest suffix of `min_n`..`max_n` tokens (filled with `last_token` past the end);
    all `last_token` with no such occurrence or nothing sampled.

    Example:
        >>> ngram_drafts_reference([5, 6, 7, 8, 5, 6], 1, 6, 1, 3, 3)
        [7, 8, 5]
    """
    n_tok = len(tokens)
    if num_sampled <= 0:
        return [last_token] * k
    for n in range(min(max_n, n_tok - 1), min_n - 1, -1):
        suffix = tokens[n_tok - n:]
        for pos in range(n_tok - n - 1, -1, -1):
            if tokens[pos: pos + n] == suffix:
                start = pos + n
                return [tokens[start + i] if start + i < n_tok else last_token for i in range(k)]
    return [last_token] * k
