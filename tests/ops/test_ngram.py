"""ngram_drafts: vLLM's n-gram drafts over [system tokens ; own tokens] held apart, against vLLM's own kernels
run on the whole token lists (compiled on a GPU; on the CPU under Triton's interpreter in a process of their
own) and against the plain-Python search."""

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import triton

from vllm_relay.ops.ngram import ngram_drafts, ngram_drafts_reference

# vLLM's kernels under the interpreter, in a process where TRITON_INTERPRET is set before triton is imported
# (only then does the interpreter run `tl.zeros`, `tl.max` and `tl.sum`, which they call) and with its
# comparisons fixed (tests/triton_interpreter.py); a CPU build of vLLM leaves them undecorated (its Triton
# disabled): they are decorated there with the real `triton` and `tl`.
_VLLM_ON_CPU = """
import sys, types, torch, triton, triton.language as tl
from tests.triton_interpreter import fix
from vllm.v1.worker.gpu.spec_decode.ngram import speculator
fix()
def kernel(name):
    k = getattr(speculator, name)
    if isinstance(k, types.FunctionType):
        k = triton.jit(types.FunctionType(k.__code__, {**k.__globals__, "tl": tl, "triton": triton},
                                          k.__name__))
    return k
drafts = []
for scan, finalize, grid in torch.load(sys.argv[1]):
    kernel("_ngram_scan_kernel")[grid](*scan)
    kernel("_ngram_finalize_kernel")[grid[:1]](*finalize)
    drafts.append(finalize[8])
torch.save(drafts, sys.argv[1])
"""


def _case(rng, R, B, S, P, W, vocab):
    """R request states with own token lists, B batch rows over them, S slots of P system tokens."""
    sys_ids = torch.from_numpy(rng.integers(0, vocab, (S, P)).astype(np.int32))
    token_ids = torch.from_numpy(rng.integers(0, vocab, (R, W)).astype(np.int32))
    idx = torch.from_numpy(rng.permutation(R)[:B].astype(np.int64))
    total_len = torch.from_numpy(rng.integers(0, W - P, R).astype(np.int32))
    total_len[idx[0]] = 0  # a request with nothing of its own yet
    row_slot = torch.from_numpy(rng.integers(-1, S, B).astype(np.int32))
    shift = np.where(row_slot.numpy() >= 0, rng.integers(1, P + 1, B), 0)
    row_shift = torch.from_numpy(shift.astype(np.int32))
    row_slot[-1], row_shift[-1] = 3 % S, 0  # a slot with no shift: no system tokens
    num_sampled = torch.from_numpy(rng.integers(0, 3, B).astype(np.int32))
    num_sampled[:2] = 1
    last = torch.from_numpy(rng.integers(0, vocab, (R, 1)).astype(np.int64))
    return token_ids, idx, total_len, num_sampled, last, sys_ids, row_slot, row_shift


def _whole(case):
    """Each batch row's whole token list and its last sampled token."""
    token_ids, idx, total_len, _, last, sys_ids, row_slot, row_shift = case
    lists = []
    for b, r in enumerate(idx.tolist()):
        shift = int(row_shift[b])
        head = sys_ids[int(row_slot[b]), :shift].tolist() if shift else []
        lists.append(head + token_ids[r, : int(total_len[r])].tolist())
    return lists, torch.tensor([int(last[r, 0]) for r in idx.tolist()], dtype=torch.int64)


# min_n, max_n, K, vocab, block_l
_SMALL = [(1, 3, 3, 4, 16), (2, 5, 4, 3, 64), (3, 3, 1, 2, 16), (1, 1, 5, 7, 32)]


def _small(min_n, max_n, K, vocab, block_l):
    """A small case's inputs, each row's whole list and last token, and its max_model_len."""
    rng = np.random.default_rng(min_n * 100 + max_n * 10 + K)
    R, B, S, P, W = 9, 7, 4, 37, 96
    case = _case(rng, R, B, S, P, W, vocab)
    return case, *_whole(case), W  # max_model_len W: every whole list fits


@pytest.fixture(scope="module")
def vllm_small_drafts(tmp_path_factory):
    """vLLM's drafts for every small case, from one interpreter process on the CPU (vLLM's import there takes
    most of its time)."""
    jobs = []
    for min_n, max_n, K, vocab, block_l in _SMALL:
        case, whole, lasts, L = _small(min_n, max_n, K, vocab, block_l)
        jobs.append((whole, case[3], lasts, L, min_n, max_n, K, block_l))
    return dict(zip(_SMALL, _vllm_drafts(jobs, tmp_path_factory.mktemp("ngram"))))


@pytest.mark.parametrize("min_n, max_n, K, vocab, block_l", _SMALL)
def test_against_vllm_kernels_and_the_reference(vllm_small_drafts, min_n, max_n, K, vocab, block_l):
    case, whole, lasts, L = _small(min_n, max_n, K, vocab, block_l)
    token_ids, idx, total_len, num_sampled, last, sys_ids, row_slot, row_shift = case
    R = token_ids.shape[0]
    scratch = torch.zeros(R, triton.cdiv(L, block_l), dtype=torch.int64)
    drafts = torch.full((R, K), -7, dtype=torch.int64)
    got = ngram_drafts(*case, scratch, drafts, L, min_n, max_n, block_l).clone()

    want = [ngram_drafts_reference(t, int(num_sampled[b]), int(last[idx[b], 0]), min_n, max_n, K)
            for b, t in enumerate(whole)]
    assert got.tolist() == want
    assert torch.equal(got, vllm_small_drafts[(min_n, max_n, K, vocab, block_l)])


def _vllm_args(lists, num_sampled, last, L, min_n, max_n, K, block_l, device):
    """vLLM's kernels' arguments for whole token lists, one request state a row, and the scan's grid."""
    ids = torch.zeros(len(lists), L, dtype=torch.int32)
    for b, t in enumerate(lists):
        ids[b, : len(t)] = torch.tensor(t, dtype=torch.int32)
    ids, lens = ids.to(device), torch.tensor([len(t) for t in lists], dtype=torch.int32, device=device)
    num_sampled, last = num_sampled.to(device), last.to(device)
    B, n_blocks = ids.shape[0], triton.cdiv(L, block_l)
    rows, drafts = torch.arange(B, device=device), torch.zeros(B, K, dtype=torch.int64, device=device)
    scratch = torch.zeros(B, n_blocks, dtype=torch.int64, device=device)
    po2 = lambda n: max(1, triton.next_power_of_2(n))  # noqa: E731
    scan = (ids, ids.stride(0), rows, lens, num_sampled, scratch, scratch.stride(0), L, min_n, max_n,
            po2(max_n), block_l)
    finalize = (ids, ids.stride(0), rows, lens, num_sampled, last, scratch, scratch.stride(0), drafts, L,
                n_blocks, K, po2(K), po2(n_blocks))
    return scan, finalize, (B, n_blocks)


def _vllm_drafts(jobs, tmp_path=None) -> list[torch.Tensor]:
    """vLLM's n-gram drafts for each job (`_vllm_args`'s arguments but the device): its kernels compiled on a
    GPU, interpreted in one process of their own without one (their arguments saved under `tmp_path`)."""
    if torch.cuda.is_available():
        from vllm.v1.worker.gpu.spec_decode.ngram.speculator import _ngram_finalize_kernel, _ngram_scan_kernel

        out = []
        for job in jobs:
            scan, finalize, grid = _vllm_args(*job, "cuda")
            _ngram_scan_kernel[grid](*scan)
            _ngram_finalize_kernel[grid[:1]](*finalize)
            out.append(finalize[8].cpu())
        return out
    path = tmp_path / "ngram.pt"
    torch.save([_vllm_args(*job, "cpu") for job in jobs], path)
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    subprocess.run([sys.executable, "-c", _VLLM_ON_CPU, str(path)], check=True, env=env, timeout=900)
    return torch.load(path)


@pytest.mark.gpu
@pytest.mark.parametrize("min_n, max_n, K, vocab, block_l",
                         [(1, 3, 3, 4, 16), (2, 5, 4, 3, 64), (2, 4, 3, 8, 256)])
def test_equals_vllm_kernels_on_cuda(min_n, max_n, K, vocab, block_l):
    rng = np.random.default_rng(7 + min_n + max_n * 10)
    R, B, S, P, W = 70, 64, 5, 300, 1100
    case = _case(rng, R, B, S, P, W, vocab)
    num_sampled = case[3]
    L = W + P
    scratch = torch.zeros(R, triton.cdiv(L, block_l), dtype=torch.int64, device="cuda")
    drafts = torch.zeros(R, K, dtype=torch.int64, device="cuda")
    got = ngram_drafts(*(t.cuda() for t in case), scratch, drafts, L, min_n, max_n, block_l).cpu()
    whole, lasts = _whole(case)
    assert torch.equal(got, _vllm_drafts([(whole, num_sampled, lasts, L, min_n, max_n, K, block_l)])[0])


def test_a_match_inside_the_system_prompt():
    """The own tokens end with a 3-gram of the system prompt: the drafts are what followed it there."""
    sys_ids = torch.tensor([[9, 1, 2, 3, 4, 5, 6, 7]], dtype=torch.int32)
    token_ids = torch.tensor([[8, 8, 2, 3, 4, 0, 0, 0]], dtype=torch.int32)
    args = (torch.tensor([0]), torch.tensor([5], dtype=torch.int32), torch.ones(1, dtype=torch.int32),
            torch.tensor([[8]]), sys_ids, torch.zeros(1, dtype=torch.int32))
    drafts = torch.zeros(1, 3, dtype=torch.int64)
    with_prompt = ngram_drafts(token_ids, *args, torch.tensor([8], dtype=torch.int32),
                               torch.zeros(1, 2, dtype=torch.int64), drafts, 32, 2, 4, 16).tolist()
    assert with_prompt == [[5, 6, 7]]
    alone = ngram_drafts(token_ids, *args, torch.zeros(1, dtype=torch.int32),
                         torch.zeros(1, 2, dtype=torch.int64), drafts, 32, 2, 4, 16).tolist()
    assert alone == [[8, 8, 8]]  # its own tokens hold no earlier 2-gram of its end: the last token
