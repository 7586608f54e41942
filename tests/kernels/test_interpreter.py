"""What kernels/_interpreter.py changes in Triton's interpreter keeps its answers: a 32-bit
overflow is still caught (with Triton's message), arithmetic in range is exact, and a shape's
type is the one Triton builds. Under the interpreter only (a GPU compiles instead)."""

from __future__ import annotations

import pytest
import torch
import triton
import triton.language as tl
from kvguard.kernels import _interpreter  # noqa: F401  (what the kernel modules import)

from .conftest import ON_GPU

pytestmark = pytest.mark.skipif(ON_GPU, reason="the interpreter's fixes; a GPU compiles the kernels")


@triton.jit
def _arith_kernel(x, out, by, N: tl.constexpr):
    i = tl.arange(0, N)
    v = tl.load(x + i)
    tl.store(out + i, (v * by + 7) - 3)


def test_32_bit_overflow_is_still_caught_and_arithmetic_in_range_is_exact():
    from triton.runtime.errors import InterpreterError

    x = torch.tensor([1, -2, 3, 40000], dtype=torch.int32)
    out = torch.empty_like(x)
    _arith_kernel[(1,)](x, out, 1000, N=4)
    assert out.tolist() == [1004, -1996, 3004, 40000004]
    with pytest.raises(InterpreterError, match="int32 overflow detected for operation mul"):
        _arith_kernel[(1,)](x, out, 100000, N=4)  # 40000 * 100000 > 2**31
    with pytest.raises(InterpreterError, match="int32 overflow detected for operation add"):
        _arith_kernel[(1,)](torch.tensor([2**31 - 5] * 4, dtype=torch.int32), out, 1, N=4)


def test_a_shapes_type_is_the_one_triton_builds():
    _arith_kernel[(1,)](torch.zeros(4, dtype=torch.int32), torch.empty(4, dtype=torch.int32), 1, N=4)  # patched now
    core = tl.core
    for values in ([4, 16], [tl.constexpr(4), 16], [tl.constexpr(8)], [1, tl.constexpr(1)]):
        made = core.tuple(values).type
        again = core.tuple(values).type
        built = core._type_for_tuple_values(values)
        assert made is again  # looked up, not built again
        assert made == built and str(made) == str(built), (values, made, built)
    assert core.tuple([4, 16]).type != core.tuple([16, 4]).type
    assert core.tuple([True, 1]).type == core._type_for_tuple_values([True, 1])  # bools: as Triton does it
