import importlib

import pytest
import torch

from tests.ops.reference import DTYPES, TOL, assert_close, fusion_ref, interpreter_on
from vllm_relay.ops import relay_fusion, relay_fusion_torch, relay_fusion_triton

INF = float("inf")

NEEDS_INTERPRETER = pytest.mark.skipif(
    not interpreter_on(), reason="CPU Triton tests need TRITON_INTERPRET=1 (GPU runs use the *_cuda tests)")
IMPL_PARAMS = [pytest.param(relay_fusion_torch, id="torch"),
               pytest.param(relay_fusion_triton, id="triton", marks=NEEDS_INTERPRETER)]


def make_inputs(T, H, D, dtype, t_sys=None, device="cpu", lse_layout="ht"):
    t_sys = T if t_sys is None else t_sys
    o_sys = torch.randn(t_sys, H, D, device=device).to(dtype)
    o_ctx = torch.randn(T, H, D, device=device).to(dtype)
    lse_sys = torch.randn(t_sys, H, device=device) * 4 + 2
    lse_ctx = torch.randn(T, H, device=device) * 4 + 2
    if lse_layout == "ht":
        lse_sys, lse_ctx = lse_sys.t().contiguous(), lse_ctx.t().contiguous()
    return o_sys, lse_sys, o_ctx, lse_ctx


def to_th(lse, layout):
    return lse if layout == "th" else lse.t()


@pytest.mark.parametrize("impl", IMPL_PARAMS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("lse_layout", ["ht", "th"])
@pytest.mark.parametrize("T,H,D", [(1, 1, 64), (7, 5, 59), (129, 32, 128), (1000, 3, 111)])
def test_matches_reference(impl, dtype, lse_layout, T, H, D):
    o_sys, lse_sys, o_ctx, lse_ctx = make_inputs(T, H, D, dtype, lse_layout=lse_layout)
    out_lse = torch.full_like(lse_ctx, 123.0)
    out = impl(o_sys, lse_sys, o_ctx, lse_ctx, out_lse=out_lse, lse_layout=lse_layout)
    ref, ref_lse = fusion_ref(o_sys, to_th(lse_sys, lse_layout), o_ctx, to_th(lse_ctx, lse_layout))
    assert out.dtype == dtype and out.shape == (T, H, D)
    assert_close(out, ref, dtype)
    torch.testing.assert_close(to_th(out_lse, lse_layout).double(), ref_lse, atol=1e-5, rtol=1e-6)


@pytest.mark.parametrize("impl", IMPL_PARAMS)
@pytest.mark.parametrize("D", [64, 80, 96, 128, 256])
def test_head_sizes(impl, D):
    o_sys, lse_sys, o_ctx, lse_ctx = make_inputs(3, 2, D, torch.bfloat16)
    out = impl(o_sys, lse_sys, o_ctx, lse_ctx)
    ref, _ = fusion_ref(o_sys, lse_sys.t(), o_ctx, lse_ctx.t())
    assert_close(out, ref, torch.bfloat16)


@pytest.mark.parametrize("impl", IMPL_PARAMS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("lse_layout", ["ht", "th"])
def test_sys_index(impl, dtype, lse_layout):
    T, H, D, t_sys = 129, 4, 59, 50
    o_sys, lse_sys, o_ctx, lse_ctx = make_inputs(T, H, D, dtype, t_sys=t_sys, lse_layout=lse_layout)
    sys_index = torch.full((T,), -1, dtype=torch.int32)
    tagged = torch.randperm(T)[:t_sys]
    sys_index[tagged] = torch.randperm(t_sys).int()
    o_ctx_before = o_ctx.clone()
    out_lse = torch.empty_like(lse_ctx)
    out = impl(o_sys, lse_sys, o_ctx, lse_ctx, out_lse=out_lse, sys_index=sys_index, lse_layout=lse_layout)

    has = sys_index >= 0
    rows = sys_index[has].long()
    ref, ref_lse = fusion_ref(o_sys[rows], to_th(lse_sys, lse_layout)[rows], o_ctx[has],
                              to_th(lse_ctx, lse_layout)[has])
    assert_close(out[has], ref, dtype)
    torch.testing.assert_close(to_th(out_lse, lse_layout)[has].double(), ref_lse, atol=1e-5, rtol=1e-6)
    # Untagged tokens: bit-exact o_ctx and lse_ctx.
    assert torch.equal(out[~has], o_ctx_before[~has])
    assert torch.equal(to_th(out_lse, lse_layout)[~has], to_th(lse_ctx, lse_layout)[~has])


@pytest.mark.parametrize("impl", IMPL_PARAMS)
@pytest.mark.parametrize("alias", ["o_ctx", "o_sys", "o_ctx_sys_index"])
def test_out_aliasing(impl, alias):
    T, H, D = 37, 6, 80
    o_sys, lse_sys, o_ctx, lse_ctx = make_inputs(T, H, D, torch.float16)
    sys_index = None
    if alias == "o_ctx_sys_index":
        sys_index = torch.randint(-1, T, (T,), dtype=torch.int32)
    expected = impl(o_sys, lse_sys, o_ctx, lse_ctx, sys_index=sys_index)
    target = o_sys if alias == "o_sys" else o_ctx
    got = impl(o_sys, lse_sys, o_ctx, lse_ctx, out=target, sys_index=sys_index)
    assert got is target
    assert torch.equal(target, expected)


@pytest.mark.parametrize("impl", IMPL_PARAMS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_infinite_lse_cases(impl, dtype):
    T, H, D = 6, 3, 64
    o_sys, lse_sys, o_ctx, lse_ctx = make_inputs(T, H, D, dtype, lse_layout="th")
    # token 0: system part empty (-inf) on every head, system output garbage (NaN)
    lse_sys[0] = -INF
    o_sys[0] = float("nan")
    # token 1: context part empty on head 0, with a NaN context row
    lse_ctx[1, 0] = -INF
    o_ctx[1, 0] = float("nan")
    # token 2: both empty (FA3 -inf / FA2 +inf)
    lse_sys[2] = INF
    lse_ctx[2] = -INF
    o_sys[2] = float("nan")
    # token 3: FA2's +inf for an empty context row
    lse_ctx[3] = INF
    o_ctx[3] = float("inf")
    # token 4: huge finite LSEs (no overflow in exp)
    lse_sys[4] = 1e4
    lse_ctx[4] = 1e4 - 1
    o_ctx_before = o_ctx.clone()
    out_lse = torch.empty_like(lse_ctx)
    out = impl(o_sys, lse_sys, o_ctx, lse_ctx, out_lse=out_lse, lse_layout="th")

    assert not torch.isnan(out[torch.arange(T) != 1]).any()
    assert not torch.isnan(out[1, 1:]).any()
    assert not torch.isnan(out_lse[:, :]).any()
    assert torch.equal(out[0], o_ctx_before[0])
    assert torch.equal(out_lse[0], lse_ctx[0])
    assert torch.equal(out[1, 0], o_sys[1, 0])
    torch.testing.assert_close(out_lse[1, 0], lse_sys[1, 0])
    # both empty: o_ctx passes through, merged LSE stays -inf
    assert torch.equal(out[2], o_ctx_before[2])
    assert torch.all(out_lse[2] == -INF)
    # +inf context LSE is read as empty: out = o_sys, lse = lse_sys
    assert torch.equal(out[3], o_sys[3])
    torch.testing.assert_close(out_lse[3], lse_sys[3])
    ref, ref_lse = fusion_ref(o_sys[4:], lse_sys[4:], o_ctx[4:], lse_ctx[4:])
    assert_close(out[4:], ref, dtype)
    torch.testing.assert_close(out_lse[4:].double(), ref_lse, atol=1e-3, rtol=1e-6)


@pytest.mark.parametrize("impl", IMPL_PARAMS)
def test_strided_inputs(impl):
    """Head strides != D, non-contiguous LSE views, an output slice of a bigger buffer."""
    T, H, D = 19, 4, 96
    big = torch.randn(T, 2 * H, D, dtype=torch.bfloat16)
    o_sys, o_ctx = big[:, :H], big[:, H:]
    lse = torch.randn(2, H, T + 5)
    lse_sys, lse_ctx = lse[0, :, :T], lse[1, :, 5:]
    out_buf = torch.zeros(T + 3, H, D, dtype=torch.bfloat16)
    out = impl(o_sys, lse_sys, o_ctx, lse_ctx, out=out_buf[3:])
    ref, _ = fusion_ref(o_sys, lse_sys.t(), o_ctx, lse_ctx.t())
    assert_close(out, ref, torch.bfloat16)
    assert torch.all(out_buf[:3] == 0)


@NEEDS_INTERPRETER
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_triton_matches_torch(dtype):
    T, H, D, t_sys = 257, 8, 111, 100
    o_sys, lse_sys, o_ctx, lse_ctx = make_inputs(T, H, D, dtype, t_sys=t_sys)
    lse_sys[0, :7] = -INF
    lse_ctx[1, 3:9] = INF
    sys_index = torch.randint(-1, t_sys, (T,), dtype=torch.int32)
    lse_a, lse_b = torch.empty_like(lse_ctx), torch.empty_like(lse_ctx)
    a = relay_fusion_triton(o_sys, lse_sys, o_ctx, lse_ctx, out_lse=lse_a, sys_index=sys_index)
    b = relay_fusion_torch(o_sys, lse_sys, o_ctx, lse_ctx, out_lse=lse_b, sys_index=sys_index)
    # Both round to dtype; the interpreter truncates instead of rounding: at most 1 ulp apart.
    torch.testing.assert_close(a.float(), b.float(), **TOL[dtype])
    torch.testing.assert_close(lse_a, lse_b, atol=1e-5, rtol=1e-6)


def test_dispatcher_uses_torch_without_interpreter(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)

    def boom(*args, **kwargs):
        raise AssertionError("the Triton path must not run for CPU tensors without TRITON_INTERPRET")

    # The package re-exports the function `relay_fusion`, which shadows the module's name.
    module = importlib.import_module("vllm_relay.ops.relay_fusion")
    monkeypatch.setattr(module, "relay_fusion_triton", boom)
    o_sys, lse_sys, o_ctx, lse_ctx = make_inputs(5, 2, 64, torch.float32)
    out = relay_fusion(o_sys, lse_sys, o_ctx, lse_ctx)
    ref, _ = fusion_ref(o_sys, lse_sys.t(), o_ctx, lse_ctx.t())
    assert_close(out, ref, torch.float32)


def test_triton_on_cpu_without_interpreter_is_an_error(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ValueError, match="TRITON_INTERPRET"):
        relay_fusion_triton(*make_inputs(2, 2, 64, torch.float32))


def _bad(name):
    """Return (args, kwargs) for relay_fusion with one argument broken as `name` says."""
    T, H, D = 4, 2, 64
    o_sys, lse_sys, o_ctx, lse_ctx = make_inputs(T, H, D, torch.float16)
    kw = {}
    if name == "o_sys_shape":
        o_sys = o_sys[:, :1]
    elif name == "o_sys_dtype":
        o_sys = o_sys.float()
    elif name == "o_ctx_dtype":
        o_sys, o_ctx = o_sys.to(torch.float64), o_ctx.to(torch.float64)
    elif name == "lse_dtype":
        lse_ctx = lse_ctx.half()
    elif name == "lse_shape":
        lse_ctx = lse_ctx.t()
    elif name == "out_shape":
        kw["out"] = torch.empty(T, H, D + 1, dtype=torch.float16)
    elif name == "last_dim":
        o_ctx = torch.randn(T, H, 2 * D).half()[..., ::2]
    elif name == "sys_index_dtype":
        kw["sys_index"] = torch.zeros(T, dtype=torch.int64)
    elif name == "layout":
        kw["lse_layout"] = "hd"
    elif name == "out_lse_shape":
        kw["out_lse"] = torch.empty(H, T + 1)
    elif name == "alias_sys_index":
        kw["sys_index"] = torch.zeros(T, dtype=torch.int32)
        kw["out"] = o_sys
    elif name == "device":
        lse_ctx = lse_ctx.to("meta")
    return (o_sys, lse_sys, o_ctx, lse_ctx), kw


@pytest.mark.parametrize("impl", IMPL_PARAMS)
@pytest.mark.parametrize("name,match", [
    ("o_sys_shape", "o_sys must be"),
    ("o_sys_dtype", "o_sys dtype"),
    ("o_ctx_dtype", "o_ctx dtype must be"),
    ("lse_dtype", "lse_ctx must be float32"),
    ("lse_shape", "lse_ctx must have shape"),
    ("out_shape", "out must be"),
    ("last_dim", "o_ctx must have a contiguous last dim"),
    ("sys_index_dtype", "sys_index must be int32"),
    ("layout", "lse_layout must be"),
    ("out_lse_shape", "out_lse must have shape"),
    ("alias_sys_index", "out may not alias o_sys"),
    ("device", "lse_ctx is on meta"),
])
def test_launch_checks(impl, name, match):
    args, kw = _bad(name)
    with pytest.raises(ValueError, match=match):
        impl(*args, **kw)


def test_no_system_rows():
    """Every token untagged and zero system rows: out = o_ctx."""
    o_sys, lse_sys, o_ctx, lse_ctx = make_inputs(9, 2, 64, torch.bfloat16, t_sys=0)
    sys_index = torch.full((9,), -1, dtype=torch.int32)
    for impl in (relay_fusion_torch, relay_fusion):
        assert torch.equal(impl(o_sys, lse_sys, o_ctx, lse_ctx, sys_index=sys_index), o_ctx)


# ---------------------------------------------------------------------------------------------- GPU

@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("T,H,D", [(1, 32, 128), (129, 32, 128), (4099, 8, 59), (65536, 32, 128),
                                   (333, 40, 80), (77, 16, 256)])
def test_relay_fusion_cuda(dtype, T, H, D):
    o_sys, lse_sys, o_ctx, lse_ctx = make_inputs(T, H, D, dtype, device="cuda")
    out_lse = torch.empty_like(lse_ctx)
    out = relay_fusion(o_sys, lse_sys, o_ctx, lse_ctx, out_lse=out_lse)
    ref, ref_lse = fusion_ref(o_sys, lse_sys.t(), o_ctx, lse_ctx.t())
    assert_close(out, ref, dtype)
    torch.testing.assert_close(out_lse.t().double().cpu(), ref_lse.cpu(), atol=1e-5, rtol=1e-6)
    torch.testing.assert_close(out.float(), relay_fusion_torch(o_sys, lse_sys, o_ctx, lse_ctx).float(),
                               **TOL[dtype])


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_relay_fusion_cuda_sys_index_and_alias(dtype):
    T, H, D, t_sys = 3001, 32, 128, 1200
    o_sys, lse_sys, o_ctx, lse_ctx = make_inputs(T, H, D, dtype, t_sys=t_sys, device="cuda")
    lse_sys[:, :10] = -INF
    sys_index = torch.full((T,), -1, dtype=torch.int32, device="cuda")
    sys_index[torch.randperm(T, device="cuda")[:t_sys]] = torch.randperm(t_sys, device="cuda").int()
    expected = relay_fusion_torch(o_sys, lse_sys, o_ctx, lse_ctx, sys_index=sys_index)
    o_ctx_before = o_ctx.clone()
    out = relay_fusion(o_sys, lse_sys, o_ctx, lse_ctx, out=o_ctx, sys_index=sys_index)
    assert out is o_ctx
    torch.testing.assert_close(out.float(), expected.float(), **TOL[dtype])
    untagged = sys_index < 0
    assert torch.equal(out[untagged], o_ctx_before[untagged])
    assert not torch.isnan(out).any()


@pytest.mark.gpu
def test_relay_fusion_cuda_no_system_rows():
    o_sys, lse_sys, o_ctx, lse_ctx = make_inputs(17, 8, 128, torch.bfloat16, t_sys=0, device="cuda")
    sys_index = torch.full((17,), -1, dtype=torch.int32, device="cuda")
    out_lse = torch.empty_like(lse_ctx)
    out = relay_fusion(o_sys, lse_sys, o_ctx, lse_ctx, out_lse=out_lse, sys_index=sys_index)
    assert torch.equal(out, o_ctx) and torch.equal(out_lse, lse_ctx)
