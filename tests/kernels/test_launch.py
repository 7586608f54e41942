"""kernels._launch: a compiled kernel launched again directly must be the one Triton would pick."""

import itertools

import pytest
import torch
from triton._C.libtriton import native_specialize_impl
from triton.backends.compiler import BaseBackend

from kernels._launch import _arg_class
from kernels.paged_decode import paged_decode

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
    from kernels import _launch

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
