"""kernels._launch: a compiled kernel launched again directly must be the one Triton would pick."""

import itertools

import pytest
import torch
import triton.language as tl
from kvguard.kernels._launch import _arg_class
from kvguard.kernels.paged_decode import paged_decode
from triton._C.libtriton import native_specialize_impl
from triton.backends.compiler import BaseBackend

from .conftest import DEVICE, ON_GPU
from .util import make_pages


def _samples():
    base = torch.zeros(64, dtype=torch.int32, device=DEVICE)
    return [0, 1, 2, 15, 16, 17, 32, -16, -1, 2**31 - 16, 2**31, 2**31 + 1, -(2**31), -(2**31) - 1, 0.5, 1.0,
            True, False, base, base[1:], base[4:], base.float(), base.view(torch.uint8)[4:]]


def test_argument_classes_are_as_fine_as_tritons():
    # two arguments of one class must be specialized alike by Triton (the class may be finer)
    samples = _samples()
    for a, b in itertools.combinations(samples, 2):
        if _arg_class(a) == _arg_class(b):
            assert (native_specialize_impl(BaseBackend, a, False, True, True)
                    == native_specialize_impl(BaseBackend, b, False, True, True)), (a, b)
    assert _arg_class("text") is None


@pytest.mark.skipif(not ON_GPU, reason="the interpreter always takes Triton's own launch path")
def test_direct_launch_matches_tritons_launch():
    from kvguard.kernels import _launch

    pages = make_pages("int8", 40, 2, 16, 64, torch.float16, seed=3)
    q = torch.randn(3, 8, 64, device=DEVICE, dtype=torch.float16)
    table = torch.randperm(40, device=DEVICE)[:36].reshape(3, 12).to(torch.int32)
    lens2 = torch.tensor([[150, 7, 191], [31, 64, 1]], dtype=torch.int32, device=DEVICE)
    _launch._COMPILED.clear()
    first = [paged_decode(q, pages, table, lens, return_mass=True) for lens in lens2]  # through Triton
    assert _launch._COMPILED
    again = [paged_decode(q, pages, table, lens, return_mass=True) for lens in lens2]  # directly
    for x, y in zip(first, again):
        for u, v in zip(x, y):
            assert torch.equal(u, v)


def _toy(x, n, scale, BLOCK: tl.constexpr, FLAG: tl.constexpr = False):  # only its signature is used
    pass


class _Compiled:
    """Stands in for a CompiledKernel: records the direct launches."""

    function, packed_metadata = "function", "metadata"

    def __init__(self):
        self.runs = []

    def run(self, *args):
        self.runs.append(args)


def test_launch_keeps_one_compiled_kernel_per_kind(monkeypatch):
    # the bookkeeping of kernels/_launch.py without a GPU: a JITFunction whose launch through
    # Triton is recorded and returns a stand-in compiled kernel
    from kvguard.kernels import _launch
    from triton import knobs
    from triton.runtime.jit import JITFunction

    kernel = JITFunction(_toy)
    through_triton = []

    def triton_launch(grid):
        def call(*args, **kwargs):
            through_triton.append((grid, args, kwargs))
            return compiled
        return call

    compiled = _Compiled()
    monkeypatch.setattr(JITFunction, "__getitem__", lambda self, grid: triton_launch(grid))
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch._C, "_cuda_getCurrentRawStream", lambda device: 7, raising=False)
    monkeypatch.setattr(_launch, "_DIRECT", True)
    monkeypatch.setattr(_launch, "_COMPILED", {})
    x = torch.zeros(64)
    consts = {"BLOCK": 32, "num_warps": 4}
    _launch.launch(kernel, (3,), (x, 40, 0.5), consts, ("k", 32))
    assert len(through_triton) == 1 and not compiled.runs  # the first of its kind goes through Triton
    _launch.launch(kernel, (5, 2), (x, 56, 0.25), consts, ("k", 32))
    assert len(through_triton) == 1
    # grid padded to 3, the stream, no metadata or hooks, the runtime arguments, then the
    # constexprs in the signature's order with their defaults
    assert compiled.runs == [(5, 2, 1, 7, "function", "metadata", None, None, None, x, 56, 0.25, 32, False)]
    _launch.launch(kernel, (3,), (x, 48, 0.5), consts, ("k", 32))  # 48: a multiple of 16, as Triton tells apart
    _launch.launch(kernel, (3,), (x[1:], 40, 0.5), consts, ("k", 32))  # another alignment
    _launch.launch(kernel, (3,), (x, 40, 0.5), {"BLOCK": 64, "num_warps": 4}, ("k", 64))  # other constexprs
    assert len(through_triton) == 4 and len(compiled.runs) == 1
    hook = lambda *a, **k: None  # noqa: E731  a profiler's launch hook: Triton's path every time
    knobs.runtime.launch_enter_hook.add(hook)
    try:
        _launch.launch(kernel, (5, 2), (x, 56, 0.25), consts, ("k", 32))
    finally:
        knobs.runtime.launch_enter_hook.remove(hook)
    assert len(through_triton) == 5 and len(compiled.runs) == 1
