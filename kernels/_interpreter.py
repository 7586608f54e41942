"""A fix for Triton 3.6's interpreter under NumPy 2.4 and later, applied on import.

The interpreter (TRITON_INTERPRET=1: the kernels on the CPU, as their tests run them) turns a
tensor used as a Python integer, such as a loop bound, into one with `int(tensor.handle.data)`.
Scalars are arrays of one element and one dimension there, which NumPy 2.4 refuses to convert:
`range(0, tl.max(lim, 0), BN)` in kernels/paged_prefill.py, and every loop with a bound read
from memory, raise TypeError. This takes the element instead (`.item()`), as upstream did
(triton-lang/triton#9171). Compiled kernels are not touched.
"""

from __future__ import annotations

try:
    from triton.runtime import interpreter as _interpreter
except ImportError:  # another Triton: nothing to fix
    _interpreter = None


def _index(self) -> int:
    return int(self.handle.data.item())


def _patch() -> None:
    original = getattr(_interpreter, "_patch_lang_tensor", None)
    if original is None or getattr(original, "one_element_index", False):
        return

    def patch_lang_tensor(tensor, scope):
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", _index)  # restored with the rest when the kernel returns

    patch_lang_tensor.one_element_index = True
    _interpreter._patch_lang_tensor = patch_lang_tensor


if _interpreter is not None:
    _patch()
