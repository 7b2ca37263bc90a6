"""vllm_relay/ops/window_level.py and window_level_torch.py: a sliding-window layer's shared level (each
row from its own first visible key on), the Triton kernel and its torch twin against a dense fp32
reference written here.

The paged caches are filled with NaN wherever no key of a group lives (unused blocks, the blocks of a
group wholly before its rows' first visible keys) and table entries past a group's keys are garbage
(other groups' blocks, -7, 10**6): a kernel that reads a key no row sees shows as NaN or a fault."""

from pathlib import Path

import pytest
import torch

from tests.ops.reference import DTYPES, assert_close, cu_seqlens, interpreter_on, on_grid, scatter_blocks
from vllm_relay.ops.window_level import window_level_attention
from vllm_relay.ops.window_level_torch import window_level_attention_torch

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
NEEDS_TRITON = pytest.mark.skipif(DEVICE == "cpu" and not interpreter_on(),
                                  reason="needs CUDA or TRITON_INTERPRET=1")
IMPLS = [pytest.param(window_level_attention_torch, id="torch"),
         pytest.param(window_level_attention, id="triton", marks=NEEDS_TRITON)]
PAD_ROWS = 3  # rows past cu_seqlens_q[G]: garbage queries, outputs that must keep their sentinel
SENTINEL = 7.0

# Groups as (key_start of each row, seqused_k): key starts negative, 0, mid-block, at a block boundary,
# len - 1, len and past it (rows that see nothing); groups with 1, 3 and 17 rows; 0, 1, 15, 16, 33 and
# 200 keys (block size 16).
GROUPS = [
    ([-4, 0, 17], 33),
    ([5], 0),  # no keys at all
    ([37, 48, 199, 200, 250, -1, 0, 63, 64, 100, 128, 150, 190, 191, 192, 77, 120], 200),
    ([0], 1),
    ([14, 15, 3], 15),
    ([16], 16),  # sees nothing: its only key is before its first
]
SMALL = [([-4, 0, 17], 33), ([5], 0), ([30, 14, 15], 47), ([0], 1)]


def dense_ref(q, k, v, first, scale, softcap):
    """Each row's attention over keys first[r] .. K - 1 of its group, in fp32, one head at a time.

    q: [R, Hq, D]; k, v: [K, Hkv, D] fp32 (dense, in key order); first: int [R]. A row that sees no key:
    o = 0, lse = -inf. Returns (o [R, Hq, D], lse [Hq, R])."""
    R, Hq, D = q.shape
    K, Hkv = k.shape[0], k.shape[1]
    o = torch.zeros(R, Hq, D)
    lse = torch.full((Hq, R), float("-inf"))
    seen = torch.arange(K)[None, :] >= torch.as_tensor(first).long()[:, None]  # [R, K]
    for h in range(Hq):
        kh, vh = k[:, h // (Hq // Hkv)], v[:, h // (Hq // Hkv)]
        s = (q[:, h].float() @ kh.T) * scale
        if softcap:
            s = softcap * torch.tanh(s / softcap)
        s = s.masked_fill(~seen, float("-inf"))
        for r in range(R):
            if seen[r].any():
                w = torch.softmax(s[r][seen[r]], dim=0)
                o[r, h] = w @ vh[seen[r]]
                lse[h, r] = torch.logsumexp(s[r][seen[r]], dim=0)
    return o, lse


def build(groups, h_kv, group, d, block_size, dtype, fp8=None, scales=(1.0, 1.0), layout="stacked"):
    """Inputs of one call and what the reference needs. K/V are dense per group, scattered into a paged
    cache through a random table (shuffled physical blocks); with `fp8` the cache holds K / k_scale and
    V / v_scale in that dtype, the dense K/V are the values it holds (on its grid, times the scale).

    layout: "stacked", k = kv[:, 0] of a [blocks, 2, bs, Hkv, D] tensor; "packed", K and V side by side
    in the last dim of [blocks, bs, Hkv, 2 D] (vLLM's FlashAttention allocation); "interleaved", K and V
    alternating in the last dim (a stride of 2 there, as views of vLLM's CPU cache may have)."""
    hq = h_kv * group
    rows = [len(ks) for ks, _ in groups]
    n = sum(rows)
    q = torch.randn(n + PAD_ROWS, hq, d)
    q[n:] = float("nan")
    ks, vs, firsts = [], [], []
    for starts, k_len in groups:
        k, v = torch.randn(k_len, h_kv, d), torch.randn(k_len, h_kv, d)
        if fp8 is not None:
            k, v = on_grid(k, scales[0], fp8), on_grid(v, scales[1], fp8)
        else:
            k, v = k.to(dtype).float(), v.to(dtype).float()
        ks.append(k)
        vs.append(v)
        firsts.append(torch.tensor(starts, dtype=torch.int32))
    nblk = [(k.shape[0] + block_size - 1) // block_size for k in ks]
    total = sum(nblk) + 4
    cache_dtype = fp8 or dtype
    if layout == "stacked":
        kv = torch.full((total, 2, block_size, h_kv, d), float("nan")).to(cache_dtype)
        views = lambda kv: (kv[:, 0], kv[:, 1])  # noqa: E731
    else:
        kv = torch.full((total, block_size, h_kv, 2 * d), float("nan")).to(cache_dtype)
        views = (lambda kv: (kv[..., :d], kv[..., d:])) if layout == "packed" else (  # noqa: E731
            lambda kv: (kv[..., 0::2], kv[..., 1::2]))
    k_cache, v_cache = views(kv)
    width = max(nblk) + 2
    ids = torch.randperm(total)
    table = torch.randint(0, total, (len(groups), width), dtype=torch.int32)  # past the end: garbage
    table[:, -1] = torch.tensor([-7, 10**6] * len(groups), dtype=torch.int32)[: len(groups)]
    scatter_blocks(k_cache, v_cache, ks, vs, ids, table, scales if fp8 is not None else (1.0, 1.0))
    # Blocks wholly before every row's first key: garbage (a window group may have freed them).
    for g, first in enumerate(firsts):
        before = min(max(int(first.min()), 0) // block_size, nblk[g]) if first.numel() else 0
        table[g, :before] = torch.tensor([-7, 10**6, total - 1], dtype=torch.int32)[torch.arange(before) % 3]
    key_start = torch.cat(firsts + [torch.tensor([-3, 10**6, 0][:PAD_ROWS], dtype=torch.int32)])
    cu = cu_seqlens(rows)
    seqused = torch.tensor([k.shape[0] for k in ks], dtype=torch.int32)
    args = {"q": q.to(dtype), "k": k_cache, "v": v_cache, "cu_seqlens_q": cu, "seqused_k": seqused,
            "block_table": table, "key_start": key_start}
    args = {name: x.to(DEVICE) for name, x in args.items()}
    args["k"], args["v"] = views(kv.to(DEVICE))  # the layout's strides on the device too
    args["max_seqlen_q"] = max(rows) + 2  # an upper bound, as a CUDA graph's
    return args, ks, vs, firsts


def check(impl, groups, h_kv, group, d, dtype, block_size=16, softcap=0.0, fp8=None, scales=(1.0, 1.0),
          descale=None, layout="stacked", keys=None):
    """One call of `impl` against `dense_ref`, every group; rows past cu_seqlens_q[G] untouched. `keys`:
    the call's max_seqlen_k (the most keys a row reads, which bounds the key ranges; None: unknown)."""
    args, ks, vs, firsts = build(groups, h_kv, group, d, block_size, dtype, fp8, scales, layout)
    n = sum(len(s) for s, _ in groups)
    scale = d ** -0.5 * (4.0 if softcap else 1.0)  # with a cap: scores large enough that it bends them
    out = torch.full(args["q"].shape, SENTINEL, dtype=dtype, device=DEVICE)
    got, lse = impl(**args, **(descale or {}), softmax_scale=scale, out=out, causal=False,
                    return_softmax_lse=True, softcap=softcap, fa_version=3, scheduler_metadata=None,
                    num_splits=0, max_seqlen_k=keys, window_size=(-1, -1), alibi_slopes=None)
    assert got is out
    assert lse.dtype == torch.float32 and lse.shape == (args["q"].shape[1], n + PAD_ROWS)
    assert not got[:n].isnan().any() and not lse[:, :n].isnan().any()
    assert (got[n:] == SENTINEL).all(), "rows past cu_seqlens_q[G] must be left as they are"
    assert (lse[:, n:] == float("-inf")).all()
    q = args["q"].cpu().float()
    r0 = 0
    for g, (k, v, first) in enumerate(zip(ks, vs, firsts, strict=True)):
        r1 = r0 + first.numel()
        ref_o, ref_lse = dense_ref(q[r0:r1], k, v, first, scale, softcap)
        assert_close(got[r0:r1], ref_o, dtype, msg=f"group {g}")
        torch.testing.assert_close(lse[:, r0:r1].cpu(), ref_lse, atol=1e-4, rtol=1e-5, msg=f"group {g} lse")
        empty = first >= k.shape[0]
        assert (got[r0:r1].cpu()[empty] == 0).all() and (lse[:, r0:r1].cpu()[:, empty] == float("-inf")).all()
        r0 = r1
    return got, lse


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("h_kv, group, d", [(2, 5, 80), (1, 4, 64), (3, 1, 64), (1, 2, 200)],
                         ids=["gqa5-d80", "gqa4", "mha", "d200"])
def test_matches_dense_reference(impl, dtype, h_kv, group, d):
    """Head sizes up to 128 take tiles of 64 keys, larger ones 32 or 16 (`window_launch.tiles`, with the
    interpreter's one multiprocessor: the grid's programs too many for the small tiles); 17 rows of group 2
    fill a tile of 64. (`test_key_ranges_merged_by_their_lse`: the small tiles.)"""
    check(impl, GROUPS, h_kv, group, d, dtype)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("d", [64, 200])
def test_softcap(impl, dtype, d):
    """Gemma 2's soft-capping; at d=200 a few rows a group take tiles of 32 keys."""
    check(impl, SMALL, 2, 2, d, dtype, softcap=5.0)


@pytest.mark.parametrize("impl", IMPLS)
def test_packed_kv_layout(impl):
    """K and V side by side in the last dim (head stride 2 D): the caches' strides are used as given."""
    check(impl, SMALL, 2, 3, 64, torch.float16, layout="packed")


def test_torch_twin_reads_a_cache_strided_in_its_last_dim_and_the_kernel_refuses_it():
    """The twin gathers any strides (the CPU backend's level call on vLLM's CPU cache views); the
    kernel's entry needs the last dim contiguous and says so."""
    check(window_level_attention_torch, SMALL, 2, 3, 64, torch.float32, layout="interleaved")
    args, *_ = build(SMALL, 2, 3, 64, 16, torch.float32, layout="interleaved")
    with pytest.raises(ValueError, match="k must have a contiguous last dim"):
        window_level_attention(**args, softmax_scale=0.1)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("fp8, dtype", [(torch.float8_e4m3fn, torch.bfloat16),
                                        (torch.float8_e5m2, torch.float32)], ids=["e4m3-bf16", "e5m2-fp32"])
def test_fp8_cache_read_with_its_scales(impl, fp8, dtype):
    """An FP8 cache read as value * scale: k_descale a tensor expanded to [G, Hkv] (as relay passes it),
    v_descale a float."""
    scales = (0.37, 1.9)
    k_descale = torch.tensor(scales[0], device=DEVICE).reshape(1, 1).expand(len(GROUPS), 2)
    check(impl, GROUPS, 2, 5, 80, dtype, fp8=fp8, scales=scales,
          descale={"k_descale": k_descale, "v_descale": scales[1]})


@pytest.mark.parametrize("impl", IMPLS)
def test_fp8_queries(impl):
    """FP8 queries (q_descale) over an FP8 cache: the values they hold times their scales; out in bf16."""
    args, ks, vs, firsts = build(SMALL, 1, 4, 64, 16, torch.float32, torch.float8_e4m3fn, (0.5, 0.25))
    q = on_grid(args["q"].cpu(), 0.3)
    args["q"] = (q / 0.3).to(torch.float8_e4m3fn).to(DEVICE)
    scales = {"q_descale": 0.3, "k_descale": 0.5, "v_descale": 0.25}
    descale = {name: torch.tensor([x], device=DEVICE) for name, x in scales.items()}
    out, lse = impl(**args, softmax_scale=0.125, **descale)
    assert out.dtype == torch.bfloat16
    r0 = 0
    for k, v, first in zip(ks, vs, firsts, strict=True):
        r1 = r0 + first.numel()
        ref_o, ref_lse = dense_ref(q[r0:r1], k, v, first, 0.125, 0.0)
        assert_close(out[r0:r1], ref_o, torch.bfloat16)
        torch.testing.assert_close(lse[:, r0:r1].cpu(), ref_lse, atol=1e-4, rtol=1e-5)
        r0 = r1


@pytest.mark.parametrize("impl", IMPLS)
def test_allocates_and_returns_out_alone(impl):
    args, ks, vs, firsts = build(SMALL, 1, 2, 64, 16, torch.float16)
    out = impl(**args, softmax_scale=None, return_softmax_lse=False)
    assert isinstance(out, torch.Tensor) and out.dtype == torch.float16 and out.shape == args["q"].shape
    ref_o, _ = dense_ref(args["q"][:3].cpu().float(), ks[0], vs[0], firsts[0], 64 ** -0.5, 0.0)
    assert_close(out[:3], ref_o, torch.float16)


@pytest.mark.skipif(DEVICE != "cpu", reason="CPU tensors only")
def test_cpu_without_the_interpreter_takes_the_torch_twin(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    args, *_ = build(SMALL, 1, 2, 64, 16, torch.float32)
    got, got_lse = window_level_attention(**args, softmax_scale=0.1)
    want, want_lse = window_level_attention_torch(**args, softmax_scale=0.1)
    assert torch.equal(got, want) and torch.equal(got_lse, want_lse)


@pytest.mark.parametrize("impl", IMPLS)
def test_refuses_what_would_change_the_result(impl):
    args, *_ = build(SMALL, 1, 2, 64, 16, torch.float32)
    for bad in ({"causal": True}, {"window_size": (127, 0)}, {"alibi_slopes": torch.zeros(2)}):
        with pytest.raises(NotImplementedError):
            impl(**args, softmax_scale=0.1, **bad)
    with pytest.raises(ValueError, match="FP8 KV cache only"):
        impl(**args, softmax_scale=0.1, k_descale=0.5)


@pytest.fixture
def split_keys(monkeypatch):
    """Every launch cut into key ranges of one key tile (the rule's, with a GPU of many multiprocessors
    and ranges of 16 keys at least), and the merges counted."""
    from vllm_relay.ops import window_launch as launch
    from vllm_relay.ops import window_level as wl

    merges = []
    combine = wl.combine_splits
    monkeypatch.setattr(launch, "sm_count", lambda device: 10_000)
    monkeypatch.setattr(launch, "MIN_SPLIT_KEYS", 16)
    monkeypatch.setattr(wl, "combine_splits", lambda *a: merges.append(a[0].shape[0]) or combine(*a))
    return merges


@pytest.mark.parametrize("h_kv, group, d", [(2, 5, 80), (3, 1, 64), (1, 2, 200)],
                         ids=["gqa5-d80", "mha", "d200"])
@NEEDS_TRITON
def test_key_ranges_merged_by_their_lse(split_keys, h_kv, group, d):
    """A level of few programs over a long window cut into key ranges (16 of them, most of them empty for
    the short groups: their partials are 0 and -inf), each a program, merged as one call's result."""
    check(window_level_attention, GROUPS, h_kv, group, d, torch.float32)
    check(window_level_attention, SMALL, h_kv, group, d, torch.bfloat16, softcap=5.0)
    assert split_keys == [16, 16]


@pytest.mark.parametrize("ranges", [False, True], ids=["whole", "ranges"])
@pytest.mark.parametrize("h_kv, group, d", [(2, 5, 80), (1, 2, 200)], ids=["gqa5-d80", "d200"])
@NEEDS_TRITON
def test_compact_grid_loops_over_the_real_tiles_only(monkeypatch, split_keys, ranges, h_kv, group, d):
    """A call of many groups, most of them empty (a CUDA graph's), as a grid of a few programs, each looping
    over work items (tile, KV head, range) numbered group by group: every real tile once, the empty
    groups never; with the key ranges and without."""
    from vllm_relay.ops import window_launch as launch

    monkeypatch.setattr(launch, "COMPACT_FROM_GROUPS", 2)
    monkeypatch.setattr(launch, "COMPACT_WAVES", 1)
    monkeypatch.setattr(launch, "sm_count", lambda device: 3)  # 3 programs, each over many work items
    monkeypatch.setattr(launch, "num_splits", lambda *_: 4 if ranges else 1)
    padded = GROUPS + [([], 0)] * 3 + [([2, 9], 40)] + [([], 5)]  # empty groups between and after
    check(window_level_attention, padded, h_kv, group, d, torch.float32)
    assert split_keys == ([4] if ranges else [])


@NEEDS_TRITON
def test_no_more_key_ranges_than_a_rows_keys_fill(split_keys):
    """max_seqlen_k, the most keys a row reads (a window's length), bounds the ranges: 40 keys fill two of
    16 at least, 16 keys one (no merge); the result is exact whatever the rows' keys span."""
    check(window_level_attention, GROUPS, 2, 4, 64, torch.float32, keys=40)
    check(window_level_attention, GROUPS, 2, 4, 64, torch.float32, keys=16)
    assert split_keys == [2]


@pytest.mark.parametrize("grid", ["by group", "compact"])
@NEEDS_TRITON
def test_groups_empty_and_not_on_either_grid(monkeypatch, grid):
    """The grid by group (a program a tile of every group, the empty ones too) and the compact one (a few
    programs looping over the real tiles), on the same groups, empty ones among them."""
    from vllm_relay.ops import window_launch as launch

    monkeypatch.setattr(launch, "COMPACT_FROM_GROUPS", 2 if grid == "compact" else None)
    padded = [([], 0)] + GROUPS + [([], 7), ([3], 30)]
    check(window_level_attention, padded, 2, 4, 64, torch.bfloat16)


@NEEDS_TRITON
def test_key_ranges_of_an_fp8_cache(split_keys):
    scales = (0.37, 1.9)
    check(window_level_attention, GROUPS, 2, 4, 64, torch.bfloat16, fp8=torch.float8_e4m3fn, scales=scales,
          descale={"k_descale": torch.tensor([scales[0]], device=DEVICE), "v_descale": scales[1]})
    assert split_keys == [16]


@pytest.mark.gpu
@pytest.mark.parametrize("group, d", [(8, 128), (4, 256), (1, 96)])
def test_cuda_head_sizes(group, d):
    check(window_level_attention, GROUPS, 2, group, d, torch.bfloat16)


@pytest.mark.gpu
def test_cuda_graph_replays_new_lengths_and_key_starts():
    """Captured once, replayed with other lengths and first keys (the launch reads them on the device)."""
    args, *_ = build(GROUPS, 2, 4, 128, 16, torch.bfloat16)
    out = torch.zeros_like(args["q"])
    kw = dict(args, softmax_scale=0.1, out=out)
    window_level_attention(**kw)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        _, lse = window_level_attention(**kw)
    for shift in (0, 5, 40):
        args["key_start"].add_(shift)
        args["seqused_k"].sub_(torch.clamp(args["seqused_k"], max=shift // 5))
        graph.replay()
        want_o, want_lse = window_level_attention_torch(**dict(kw, out=None))
        n = int(args["cu_seqlens_q"][-1])
        assert_close(out[:n], want_o[:n], torch.bfloat16)
        torch.testing.assert_close(lse[:, :n], want_lse[:, :n], atol=1e-4, rtol=1e-5)


# Compiled in a process of its own: with TRITON_INTERPRET set (these tests set it) @triton.jit makes
# interpreted functions, which do not compile.
_HOPPER_REGISTERS = r"""
import json, os, re, subprocess, sys, tempfile
import triton
import triton.backends.nvidia as nvidia
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from vllm_relay.ops import window_launch as launch
from vllm_relay.ops import window_level as wl

ptxas = os.path.join(os.path.dirname(nvidia.__file__), "bin", "ptxas-blackwell")
if not os.path.exists(ptxas):
    print(json.dumps(None)); sys.exit()
fn, results = wl._window_level_kernel, {}
for key in json.loads(sys.argv[1]):
    group, head_dim, max_rows, parallel, cache, softcap = key
    compact = parallel == 0  # the compact grid of a graph's call (66 groups); else by group, 8 KV heads
    launch.COMPACT_FROM_GROUPS = 1 if compact else None
    _, consts = launch.launch(max_rows, group, 8, head_dim, 66 if compact else parallel // 8, max_rows, None,
                              132)  # an H100's multiprocessors
    num_warps = consts.pop("num_warps")
    types = {"q_ptr": "*bf16", "k_ptr": cache, "v_ptr": cache, "out_ptr": "*bf16", "lse_ptr": "*fp32",
             "part_out_ptr": "*fp32", "part_lse_ptr": "*fp32"}
    consts.update(GROUP=group, HEAD_DIM=head_dim, BLOCK_SIZE=16, SCALES_ON_DEVICE=cache != "*bf16",
                  SOFTCAP=softcap, DOT_PRECISION="tf32", DOT_IN_FP32=False)
    signature = {name: "constexpr" if name in consts else types.get(name) or (
        "*fp32" if name.endswith("scale_ptr") else "*i32" if name.endswith("_ptr")
        else "fp32" if name.endswith("scale") or name == "softcap" else "i32") for name in fn.arg_names}
    source = ASTSource(fn, signature, constexprs={(fn.arg_names.index(k),): v for k, v in consts.items()})
    compiled = triton.compile(source, target=GPUTarget("cuda", 90, 32), options={"num_warps": num_warps})
    with tempfile.NamedTemporaryFile("w", suffix=".ptx") as ptx:
        ptx.write(compiled.asm["ptx"])
        ptx.flush()
        report = subprocess.run([ptxas, "-v", "--gpu-name", "sm_90a", ptx.name, "-o", os.devnull],
                                capture_output=True, text=True, check=True)
    text = report.stdout + report.stderr
    results[json.dumps(key)] = [int(re.search(r"Used (\d+) registers", text).group(1)),
                                int(re.search(r"(\d+) bytes spill stores", text).group(1))]
print(json.dumps(results))
"""
HEAD_SIZES = {"gemma3": (2, 256, "*bf16", False), "gemma2-softcap": (2, 256, "*bf16", True),
              "gpt-oss": (8, 64, "*bf16", False), "llama3": (4, 128, "*bf16", False),
              "llama2": (1, 128, "*bf16", False), "llama3-fp8": (4, 128, "*fp8e4nv", False),
              "group16": (16, 128, "*bf16", False)}
LAUNCH_ROWS = (1, 8, 256)
# groups x KV heads: one group's 8 KV heads (eager), a CUDA graph's capacity of groups; 0: the compact grid
PARALLEL = (8, 100_000, 0)


@pytest.fixture(scope="module")
def hopper_registers():
    """(registers a thread, bytes spilled a thread) of each launch below, the kernel compiled for sm_90a
    (no GPU needed: Triton's own ptxas)."""
    import json
    import os
    import subprocess
    import sys

    keys = [[g, d, rows, parallel, cache, softcap] for g, d, cache, softcap in HEAD_SIZES.values()
            for rows in LAUNCH_ROWS for parallel in PARALLEL]
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = subprocess.run([sys.executable, "-c", _HOPPER_REGISTERS, json.dumps(keys)], capture_output=True,
                         text=True, env=env, cwd=Path(__file__).resolve().parents[2], timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    results = json.loads(out.stdout.strip().splitlines()[-1])
    if results is None:
        pytest.skip("Triton's NVIDIA backend has no ptxas here")
    return {tuple(json.loads(k)): v for k, v in results.items()}


@pytest.mark.parametrize("shape", list(HEAD_SIZES))
@pytest.mark.parametrize("max_rows", LAUNCH_ROWS)
@pytest.mark.parametrize("parallel", PARALLEL)
def test_tiles_fit_in_registers_on_hopper(hopper_registers, shape, max_rows, parallel):
    """Every launch of the served head sizes (Gemma 2 and 3, gpt-oss, Llama 2 and 3, FP8 caches) keeps its
    tiles in registers when compiled for Hopper: a spill moves to local memory what each key tile's loop
    keeps reading."""
    group, head_dim, cache, softcap = HEAD_SIZES[shape]
    registers, spilled = hopper_registers[group, head_dim, max_rows, parallel, cache, softcap]
    assert spilled == 0, f"{spilled} bytes spilled a thread ({registers} registers)"


@NEEDS_TRITON
def test_the_warm_up_launches_every_variant_and_writes_nothing():
    """`warm_up_window_level` launches each variant a one-group call of up to `max_rows` rows takes, over a
    group of no rows: the output keeps its sentinel."""
    from vllm_relay.ops import window_launch as launch
    from vllm_relay.ops.window_level import warm_up_window_level

    args, *_ = build(SMALL, 2, 4, 64, 16, torch.bfloat16, layout="packed")
    out = torch.full(args["q"].shape, SENTINEL, dtype=torch.bfloat16, device=DEVICE)
    want = launch.one_group_variants(4, 2, 64, 300, 96, launch.sm_count(args["q"].device))
    assert warm_up_window_level(args["q"], args["k"], args["v"], out, 300, 96, 0.1, softcap=5.0) == len(want)
    assert (out == SENTINEL).all()


@pytest.mark.gpu
@pytest.mark.parametrize("fp8", [None, torch.float8_e4m3fn], ids=["bf16", "fp8"])
def test_after_the_warm_up_a_large_prompt_chunk_compiles_nothing(fp8):
    """Gemma 3's window layers (16 query heads of 256 over 8 KV heads): a level call of 600 rows (an eager
    step's prompt chunk) takes wider tiles than any decode graph's; the warm-up compiled them."""
    from vllm_relay.ops.window_level import _window_level_kernel, warm_up_window_level

    scales = (0.5, 2.0) if fp8 else (1.0, 1.0)
    args, *_ = build([(list(range(-40, 560)), 700)], 8, 2, 256, 16, torch.bfloat16, fp8=fp8, scales=scales,
                     layout="packed")
    descale = {"k_descale": torch.tensor([scales[0]], device=DEVICE),
               "v_descale": torch.tensor([scales[1]], device=DEVICE)} if fp8 else {}
    out = torch.zeros(args["q"].shape, dtype=torch.bfloat16, device=DEVICE)
    assert warm_up_window_level(args["q"], args["k"], args["v"], out, 4096, 1024, 0.0625, **descale) >= 2
    cache = _window_level_kernel.device_caches[torch.cuda.current_device()][0]
    compiled = len(cache)
    window_level_attention(**args, **descale, softmax_scale=0.0625, out=out, max_seqlen_k=1024)
    assert len(cache) == compiled
