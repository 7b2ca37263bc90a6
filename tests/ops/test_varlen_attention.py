import pytest
import torch

from tests.ops.reference import DTYPES, assert_close, attention_ref, cu_seqlens, make_paged_cache, on_grid
from vllm_relay.ops import varlen_attention_torch

# (q_len, k_len) per request: decode, full prefill, chunked prefill (q_len < k_len), empty KV,
# and more queries than keys (the first rows see nothing under bottom-right causality).
SCENARIOS = {
    "decode": [(1, 1), (1, 15), (1, 300)],
    "prefill": [(7, 7), (129, 129), (1, 1)],
    "chunked": [(5, 300), (33, 47), (1, 15)],
    "empty_kv": [(3, 0), (1, 15), (2, 0)],
    "q_longer": [(9, 4), (1, 1)],
    # Decodes run batched (padded to the longest): interleaved with prefills and an empty one.
    "decode_mixed": [(1, 40), (3, 3), (1, 17), (1, 0), (1, 300), (6, 50), (1, 1), (1, 33)],
}


def run_case(lens, h_kv, group, d, block_size, dtype, causal, softcap=0.0, fp8=None, scales=(1.0, 1.0),
             sinks=None):
    """One call against the fp32 reference. With `fp8` (a float8 dtype) the cache holds K / k_scale
    and V / v_scale in it, read with k_descale / v_descale; the reference gets the values it holds."""
    hq = h_kv * group
    q = torch.randn(sum(ql for ql, _ in lens), hq, d).to(dtype)
    ks = [torch.randn(kl, h_kv, d).to(dtype) for _, kl in lens]
    vs = [torch.randn(kl, h_kv, d).to(dtype) for _, kl in lens]
    fp8_kw = {}
    if fp8 is not None:  # what the cache holds, exactly: values of the FP8 grid, times the scale
        ks = [on_grid(k, scales[0], fp8) for k in ks]
        vs = [on_grid(v, scales[1], fp8) for v in vs]
        k_cache, v_cache, table, seqused = make_paged_cache(
            [k / scales[0] for k in ks], [v / scales[1] for v in vs], block_size, torch.float32)
        k_cache, v_cache = k_cache.to(fp8), v_cache.to(fp8)  # exact: every value is on the grid
        fp8_kw = dict(k_descale=scales[0], v_descale=torch.full((len(lens), h_kv), scales[1]))
    else:
        k_cache, v_cache, table, seqused = make_paged_cache(ks, vs, block_size, dtype)
    cu = cu_seqlens([ql for ql, _ in lens])
    scale = d ** -0.5
    out, lse = varlen_attention_torch(
        q=q, k=k_cache, v=v_cache, cu_seqlens_q=cu, seqused_k=seqused,
        max_seqlen_q=max(ql for ql, _ in lens), max_seqlen_k=max(kl for _, kl in lens),
        softmax_scale=scale, causal=causal, block_table=table, return_softmax_lse=True,
        fa_version=3, scheduler_metadata=None, num_splits=0, window_size=[-1, -1], softcap=softcap, s_aux=sinks,
        **fp8_kw)
    assert out.dtype == dtype and out.shape == q.shape
    assert lse.dtype == torch.float32 and lse.shape == (hq, q.shape[0])
    for b in range(len(lens)):
        rows = slice(int(cu[b]), int(cu[b + 1]))
        ref_o, ref_lse = attention_ref(q[rows], ks[b], vs[b], scale, causal, softcap, sinks)
        assert_close(out[rows], ref_o, dtype, msg=f"request {b}")
        torch.testing.assert_close(lse[:, rows], ref_lse, atol=1e-4, rtol=1e-5)
    return out, lse


@pytest.mark.parametrize("scenario", list(SCENARIOS))
@pytest.mark.parametrize("group", [1, 4, 8])
@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_matches_reference(scenario, group, block_size, dtype):
    run_case(SCENARIOS[scenario], h_kv=2, group=group, d=64, block_size=block_size, dtype=dtype, causal=True)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_non_causal_odd_head_size(dtype):
    run_case([(7, 17), (1, 1000), (4, 3)], h_kv=1, group=4, d=59, block_size=16, dtype=dtype, causal=False)


@pytest.mark.parametrize("fp8", [torch.float8_e4m3fn, torch.float8_e5m2], ids=str)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_fp8_kv_cache_read_with_its_scales(fp8, dtype):
    """An FP8 cache (decodes batched and a chunked prefill) read as value * scale, both scales."""
    run_case(SCENARIOS["decode_mixed"], h_kv=2, group=2, d=64, block_size=16, dtype=dtype, causal=True,
             fp8=fp8, scales=(0.37, 1.9))


@pytest.mark.parametrize("scenario", ["decode_mixed", "chunked", "q_longer"])
def test_softcap(scenario):
    """Soft-capped scores, small enough a cap (5) that it bends most of them (scores scaled x4)."""
    run_case(SCENARIOS[scenario], h_kv=2, group=3, d=16, block_size=16, dtype=torch.float32, causal=True,
             softcap=5.0)


@pytest.mark.parametrize("scenario", ["decode_mixed", "empty_kv", "q_longer", "chunked"])
def test_sinks(scenario):
    """Attention sinks (one logit per query head, no value): in every row's softmax and LSE, rows
    that see no key included (their LSE is the sink). Sinks of 1-5 against scores of a few units:
    each takes a real share of the weight."""
    sinks = torch.linspace(1.0, 5.0, 6)
    run_case(SCENARIOS[scenario], h_kv=2, group=3, d=16, block_size=16, dtype=torch.float32, causal=True,
             sinks=sinks)


def test_scales_need_an_fp8_cache_and_one_value():
    q = torch.randn(1, 4, 64)
    k_cache, v_cache, table, seqused = make_paged_cache([torch.randn(3, 4, 64)], [torch.randn(3, 4, 64)],
                                                        16, torch.float32)
    kw = dict(q=q, cu_seqlens_q=cu_seqlens([1]), seqused_k=seqused, causal=True, block_table=table)
    with pytest.raises(ValueError, match="FP8 KV cache only"):
        varlen_attention_torch(k=k_cache, v=v_cache, k_descale=0.5, **kw)
    f8 = torch.float8_e4m3fn
    with pytest.raises(NotImplementedError, match="one scale"):
        varlen_attention_torch(k=k_cache.to(f8), v=v_cache.to(f8),
                               k_descale=torch.tensor([[0.5, 1.0, 1.0, 1.0]]), **kw)


def test_long_prefill():
    """T=1000 tokens of one request in chunks bounded by the score budget."""
    run_case([(1000, 1000)], h_kv=2, group=4, d=64, block_size=32, dtype=torch.bfloat16, causal=True)


def test_empty_rows_are_zero_and_minus_inf():
    out, lse = run_case(SCENARIOS["empty_kv"], h_kv=1, group=1, d=64, block_size=16,
                        dtype=torch.float16, causal=True)
    assert torch.all(out[:3] == 0) and torch.all(out[4:] == 0)
    assert torch.all(lse[:, :3] == float("-inf"))


def test_out_is_written_in_place():
    q = torch.randn(5, 4, 64)
    k_cache, v_cache, table, seqused = make_paged_cache([torch.randn(9, 4, 64)], [torch.randn(9, 4, 64)],
                                                        16, torch.float32)
    buf = torch.full((7, 4, 64), 7.0)
    out = varlen_attention_torch(q, k_cache, v_cache, cu_seqlens([5]), seqused, 5, 9, 0.125, True, table,
                                 out=buf[:5])
    assert out.data_ptr() == buf.data_ptr()
    ref, _ = attention_ref(q, k_cache[table[0, 0]][:9], v_cache[table[0, 0]][:9], 0.125, True)
    assert_close(out, ref, torch.float32)
    assert torch.all(buf[5:] == 7.0)


@pytest.mark.parametrize("kwargs,match", [
    ({"window_size": (8, 4)}, "window_size"),
    ({"q_descale": torch.ones(1, 4)}, "q_descale"),
    ({"alibi_slopes": torch.ones(4)}, "alibi_slopes"),
    ({"cu_seqlens_k": torch.zeros(2, dtype=torch.int32)}, "cu_seqlens_k"),
])
def test_unsupported_features_raise(kwargs, match):
    q = torch.randn(1, 4, 64)
    k_cache, v_cache, table, seqused = make_paged_cache([torch.randn(3, 4, 64)], [torch.randn(3, 4, 64)],
                                                        16, torch.float32)
    with pytest.raises(NotImplementedError, match=match):
        varlen_attention_torch(q=q, k=k_cache, v=v_cache, cu_seqlens_q=cu_seqlens([1]), seqused_k=seqused,
                               max_seqlen_q=1, max_seqlen_k=3, causal=True, block_table=table, **kwargs)


@pytest.mark.parametrize("bad,match", [
    ("gqa", "not a multiple"),
    ("dtype", "KV dtype"),
    ("missing_k", "k_cache is required"),
    ("seqused", "seqused_k"),
])
def test_argument_checks(bad, match):
    q = torch.randn(2, 6 if bad == "gqa" else 4, 64)
    kv_dtype = torch.float16 if bad == "dtype" else torch.float32
    k_cache, v_cache, table, seqused = make_paged_cache([torch.randn(3, 4, 64)], [torch.randn(3, 4, 64)],
                                                        16, kv_dtype)
    kw = dict(q=q, k=k_cache, v=v_cache, cu_seqlens_q=cu_seqlens([2]), seqused_k=seqused, max_seqlen_q=2,
              max_seqlen_k=3, causal=True, block_table=table)
    if bad == "missing_k":
        del kw["k"]
    if bad == "seqused":
        kw["seqused_k"] = torch.tensor([3, 3], dtype=torch.int32)
    with pytest.raises(ValueError, match=match):
        varlen_attention_torch(**kw)


def test_batched_decodes_split_into_chunks(monkeypatch):
    """Small limits: the batched decodes run in several chunks (one request alone when it is over
    them), with the same results."""
    import vllm_relay.ops.varlen_attention as va

    monkeypatch.setattr(va, "_MAX_SCORE_ELEMS", 4 * 64)
    monkeypatch.setattr(va, "_MAX_KV_ELEMS", 2 * 64 * 16)
    run_case([(1, 40), (1, 17), (1, 300), (2, 9), (1, 33), (1, 64), (1, 5), (1, 65)], 2, 2, 16, 16,
             torch.float32, causal=True)


def test_batched_decodes_read_separate_caches_too():
    """K and V in two tensors (not the halves of one packed cache): the same results."""
    lens = [(1, 40), (1, 17), (1, 300), (2, 9), (1, 1)]
    hq, h_kv, d = 4, 2, 64
    q = torch.randn(sum(ql for ql, _ in lens), hq, d)
    ks = [torch.randn(kl, h_kv, d) for _, kl in lens]
    vs = [torch.randn(kl, h_kv, d) for _, kl in lens]
    k_cache, v_cache, table, seqused = make_paged_cache(ks, vs, 16, torch.float32)
    kwargs = dict(q=q, cu_seqlens_q=cu_seqlens([ql for ql, _ in lens]), seqused_k=seqused, causal=True,
                  block_table=table, return_softmax_lse=True)
    packed = varlen_attention_torch(k=k_cache, v=v_cache, **kwargs)
    separate = varlen_attention_torch(k=k_cache.contiguous(), v=v_cache.contiguous(), **kwargs)
    torch.testing.assert_close(separate, packed)


@pytest.mark.parametrize("scenario", ["decode_mixed", "chunked", "prefill"])
@pytest.mark.parametrize("left", [0, 5, 40])
def test_sliding_window(scenario, left):
    """FlashAttention's causal window (left, 0): query i sees keys K - L + i - left .. K - L + i."""
    torch.manual_seed(left)
    lens = SCENARIOS[scenario]
    q = torch.randn(sum(ql for ql, _ in lens), 8, 64)
    ks = [torch.randn(kl, 2, 64) for _, kl in lens]
    vs = [torch.randn(kl, 2, 64) for _, kl in lens]
    k_cache, v_cache, table, seqused = make_paged_cache(ks, vs, 16, torch.float32)
    cu = cu_seqlens([ql for ql, _ in lens])
    out, lse = varlen_attention_torch(q=q, k=k_cache, v=v_cache, cu_seqlens_q=cu, seqused_k=seqused, causal=True,
                                      block_table=table, return_softmax_lse=True, window_size=(left, 0))
    for b, (ql, kl) in enumerate(lens):
        rows = slice(int(cu[b]), int(cu[b + 1]))
        first = torch.arange(ql) + kl - ql - left
        ref_o, ref_lse = attention_ref(q[rows], ks[b], vs[b], 64 ** -0.5, True, first=first)
        assert_close(out[rows], ref_o, torch.float32, msg=f"request {b}")
        torch.testing.assert_close(lse[:, rows], ref_lse, atol=1e-4, rtol=1e-5)


def test_per_row_key_starts_are_refused_not_ignored():
    """A window layer's level (each row from its own first key) is `window_level_attention_torch`'s; here
    `key_start` would change the result, so it is refused rather than dropped."""
    k_cache, v_cache, table, seqused = make_paged_cache([torch.randn(20, 2, 8)], [torch.randn(20, 2, 8)], 16,
                                                        torch.float32)
    with pytest.raises(NotImplementedError, match="key_start"):
        varlen_attention_torch(q=torch.randn(1, 2, 8), k=k_cache, v=v_cache, cu_seqlens_q=cu_seqlens([1]),
                               seqused_k=seqused, causal=False, block_table=table,
                               key_start=torch.zeros(1, dtype=torch.int32))
