"""Kernel tests: compiled on a GPU when one is present, else on the CPU under Triton's
interpreter. TRITON_INTERPRET is read when a @triton.jit function is defined, so it is set
here, at import, before any kernel module is imported; a kernel module that something
imported earlier without it is reloaded."""

import importlib
import os
import sys

import torch

ON_GPU = torch.cuda.is_available()
if not ON_GPU:
    os.environ["TRITON_INTERPRET"] = "1"

import triton  # noqa: E402  (after the environment is set)

if not ON_GPU:
    for name in ("kernels._pages", "kernels.quantize_scatter", "kernels.paged_decode", "kernels.paged_prefill",
                 "kernels.compact"):
        if name in sys.modules:
            importlib.reload(sys.modules[name])

    # Triton 3.6's interpreter turns scalars into Python ints with int(array of shape (1,)),
    # which numpy >= 2.4 refuses; loops with tensor bounds (range(lo, hi)) need it.
    from triton.runtime import interpreter as _interp

    _patch_lang_tensor = _interp._patch_lang_tensor

    def _patched(tensor, scope):
        _patch_lang_tensor(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.item()))

    _interp._patch_lang_tensor = _patched

DEVICE = "cuda" if ON_GPU else "cpu"
assert triton is not None
