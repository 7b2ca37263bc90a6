"""benchmarks/bench_page_size.py: the level call it times reads the same keys through every page view,
against attention computed here with a plain softmax (fp32, random inputs, odd sizes)."""

import math

import pytest
import torch

from tests.benchmarks import load
from vllm_relay.ops.varlen_attention import varlen_attention_torch

bench = load("bench_page_size")


def softmax_attention(q, k, v, causal_own):
    """Each query over keys k (the first S, then its chunk's own up to itself when causal_own)."""
    hq, hkv = q.shape[1], k.shape[1]
    k, v = (x.repeat_interleave(hq // hkv, dim=1) for x in (k, v))
    s = torch.einsum("qhd,khd->hqk", q, k) * q.shape[-1] ** -0.5
    if causal_own is not None:  # bottom-right: query i of the chunk sees the S prompt keys and own keys <= i
        S, rows = causal_own
        own = torch.arange(k.shape[0])[None, :] - S
        s = s.masked_fill((own > torch.arange(q.shape[0])[:, None])[None], float("-inf"))
    return torch.einsum("hqk,khd->qhd", s.softmax(-1), v)


@pytest.mark.parametrize("causal", [False, True])
def test_every_page_view_reads_the_prompt(causal):
    torch.manual_seed(3)
    big = 128 if causal else 176
    S, rows, n, hq, hkv = 300, 16, 37, 4, 2  # S and n no multiple of a page or of rows
    nb = math.ceil((S + 512) / big) * big // bench.PAGE
    k, v = torch.randn(nb, bench.PAGE, hkv, bench.D), torch.randn(nb, bench.PAGE, hkv, bench.D)
    q = torch.randn(n, hq, bench.D)
    flat_k, flat_v = k.reshape(-1, hkv, bench.D), v.reshape(-1, hkv, bench.D)
    want = torch.empty_like(q)
    for lo in range(0, n, rows):  # each group of rows over the prompt (and its own keys when causal)
        hi = min(lo + rows, n)
        keys = S + (rows if causal else 0)
        want[lo:hi] = softmax_attention(q[lo:hi], flat_k[:keys], flat_v[:keys], (S, rows) if causal else None)
    for view in ("page16", f"page{big}"):
        fn, out, flops = bench.level_call(varlen_attention_torch, q, k, v, rows, S, {}, causal, view, big // bench.PAGE)
        fn()
        if causal:  # a full chunk's rows see S + i + 1 keys; the last, partial chunk's are shifted (bottom-right)
            full = n // rows * rows
            torch.testing.assert_close(out[:full], want[:full], rtol=1e-4, atol=1e-4)
        else:
            torch.testing.assert_close(out, want, rtol=1e-4, atol=1e-4)
        assert flops == 4 * n * S * bench.D * hq + (2 * n * rows * bench.D * hq if causal else 0)
