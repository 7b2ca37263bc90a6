"""Where the ops' kernels run: the env read at each call, interpreted twins built once, helpers rebound."""

import torch
import triton
import triton.language as tl

from vllm_relay.ops.interpreter import interpreted, kernel_for, runs_triton


@triton.jit
def _twice(x):
    return x * 2


@triton.jit
def _twice_kernel(src_ptr, out_ptr, N: tl.constexpr):
    i = tl.arange(0, N)
    tl.store(out_ptr + i, _twice(tl.load(src_ptr + i)))


def test_the_environment_is_read_at_each_call(monkeypatch):
    x = torch.zeros(2)
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    assert not runs_triton(x)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert runs_triton(x)


def test_the_interpreted_twin_is_built_once_and_calls_interpreted_helpers():
    twin = interpreted(_twice_kernel)
    assert interpreted(_twice_kernel) is twin and interpreted(twin) is twin
    assert kernel_for(_twice_kernel, torch.zeros(1)) is twin
    src = torch.randn(8)
    out = torch.empty(8)
    twin[(1,)](src, out, N=8)
    torch.testing.assert_close(out, src * 2, rtol=0, atol=0)
