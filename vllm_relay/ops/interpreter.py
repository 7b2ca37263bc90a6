"""Where the ops' Triton kernels run: compiled on CUDA tensors, under Triton's interpreter on CPU ones when
TRITON_INTERPRET=1 (the unit tests), and not at all otherwise (each op's torch twin then serves)."""

import os
import types

import torch
import triton
import triton.language as tl


def interpreting() -> bool:
    """TRITON_INTERPRET=1, read at the call (tests set it after this module is imported)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def runs_triton(x: torch.Tensor) -> bool:
    """Whether an op on `x` takes its Triton kernel: a CUDA tensor, or any under the interpreter."""
    return x.is_cuda or interpreting()


def kernel_for(kernel, x: torch.Tensor):
    """`kernel` as compiled for a CUDA tensor `x`, as the interpreter runs it for a CPU one."""
    return kernel if x.is_cuda else interpreted(kernel)


def interpreted(kernel):
    """`kernel` as the Triton interpreter runs it, for CPU tensors under TRITON_INTERPRET=1.

    `triton.jit` picks compiled or interpreted when the module is imported; a test run may import
    the kernels' modules before TRITON_INTERPRET is set, so the interpreted twin is built on demand here.
    """
    from triton.runtime.interpreter import InterpretedFunction

    if isinstance(kernel, InterpretedFunction):
        return kernel
    cached = getattr(kernel, "_relay_interpreted", None)
    if cached is None:
        fn = kernel.fn
        # The @triton.jit helpers it calls must be interpreted too: rebind them in a copy of its globals.
        helpers = {name: interpreted(obj) for name, obj in fn.__globals__.items()
                   if isinstance(obj, triton.runtime.JITFunction) and name in fn.__code__.co_names}
        if helpers:
            fn = types.FunctionType(fn.__code__, {**fn.__globals__, **helpers}, fn.__name__, fn.__defaults__,
                                    fn.__closure__)
        cached = InterpretedFunction(fn)
        kernel._relay_interpreted = cached
    return cached


# Reductions spelled as `tl.max`, `tl.min` and `tl.sum` spell them, with their combine functions, for the
# kernels that run under the interpreter in the tests: those three are @jit functions of triton.language that
# Triton's interpreter can call only when TRITON_INTERPRET was set before triton was imported (the tests set
# it later), and it runs these combines as numpy's own reductions. Compiled, they are the same reductions.
@triton.jit
def reduce_max(x, axis: tl.constexpr):
    return tl.reduce(x, axis, tl.standard._elementwise_max)


@triton.jit
def reduce_min(x, axis: tl.constexpr):
    return tl.reduce(x, axis, tl.standard._elementwise_min)


@triton.jit
def reduce_sum(x, axis: tl.constexpr):
    return tl.reduce(x, axis, tl.standard._sum_combine)
