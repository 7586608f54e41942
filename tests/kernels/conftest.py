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
    for name in ("kvguard.kernels._pages", "kvguard.kernels.quantize_scatter", "kvguard.kernels.paged_decode",
                 "kvguard.kernels.paged_prefill", "kvguard.kernels.page_scores",
                 "kvguard.kernels.page_pick",
                 "kvguard.kernels.compact"):
        if name in sys.modules:
            importlib.reload(sys.modules[name])
    # (kernels/_interpreter.py fixes the interpreter's loop bounds for NumPy >= 2.4)

DEVICE = "cuda" if ON_GPU else "cpu"
assert triton is not None
