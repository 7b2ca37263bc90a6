"""A fix for Triton's interpreter, which the tests run the kernels through on CPU tensors.

Triton 3.8 and 3.9's interpreter builds a comparison's result (`x < y`, `s >= 0`) with the
operands' type (int32, say) around numpy's bool data. A vector mask combined with a compared
*scalar* (`in_row & (s >= 0)`) then splats the scalar with that type, the mask comes out as int32,
and the masked load fails ("mask has unsupported dtype"). Compiled kernels type comparisons as
int1, as the language says. `fix()` makes the interpreter's comparisons int1 too; the kernels run
unchanged.
"""


def fix() -> None:
    try:
        import triton.language as tl
        from triton.runtime.interpreter import InterpreterBuilder, TensorHandle
    except ImportError:
        return
    for name in dir(InterpreterBuilder):
        if not name.startswith(("create_icmp", "create_fcmp")):
            continue
        compare = getattr(InterpreterBuilder, name)
        if getattr(compare, "_relay_int1", False):
            continue

        def typed(self, lhs, rhs, _compare=compare):
            out = _compare(self, lhs, rhs)
            return out if out.dtype == tl.int1 else TensorHandle(out.data, tl.int1)

        typed._relay_int1 = True
        setattr(InterpreterBuilder, name, typed)
