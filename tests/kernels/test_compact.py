"""Compaction and token gathers against their references."""

import pytest
import torch
from kvguard.kernels._checks import KernelArgError
from kvguard.kernels.compact import (
    compact_pages,
    compact_pages_ref,
    compact_tokens,
    compact_tokens_ref,
    dequantize_tokens,
    dequantize_tokens_ref,
)

from .conftest import DEVICE, ON_GPU
from .util import CODECS, assert_fields_match, make_pages


def _survivors(n, pages_used=6, s=16, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return torch.randperm(pages_used * s, generator=gen)[:n].to(torch.int32).to(DEVICE)


@pytest.mark.parametrize("dtype", (torch.float16, torch.bfloat16))
def test_compact_tokens(dtype):
    pages = make_pages("16bit", 12, 3, 16, 64, dtype)
    want = {n: t.clone() for n, t in pages.items()}
    src = _survivors(37)
    dst = torch.arange(8 * 16, 8 * 16 + 37, dtype=torch.int64, device=DEVICE)
    compact_tokens(pages, src, dst)
    compact_tokens_ref(want, src, dst)
    assert torch.equal(pages["k"], want["k"]) and torch.equal(pages["v"], want["v"])


@pytest.mark.parametrize("codec", ("int8", "fp8", "int4"))
@pytest.mark.parametrize("dim", (64, 128))
def test_compact_pages(codec, dim):
    pages = make_pages(codec, 12, 2, 16, dim, torch.float16, seed=dim)
    want = {n: t.clone() for n, t in pages.items()}
    src = _survivors(32, seed=1)
    dst = torch.tensor([9, 7], dtype=torch.int32, device=DEVICE)
    compact_pages(pages, src, dst)
    compact_pages_ref(want, src, dst)
    assert_fields_match(pages, want, codec)


@pytest.mark.parametrize("codec", CODECS)
@pytest.mark.parametrize("dtype", (torch.float16, torch.bfloat16, torch.float32))
def test_dequantize_tokens(codec, dtype):
    pages = make_pages(codec, 8, 3, 16, 64, torch.bfloat16, seed=2)
    slots = _survivors(21, seed=3)
    k, v = dequantize_tokens(pages, slots, dtype)
    rk, rv = dequantize_tokens_ref(pages, slots, dtype)
    assert k.shape == (21, 3, 64) and k.dtype == dtype
    # the interpreter truncates fp32 -> bf16 instead of rounding: one bf16 step apart there
    tol = 2**-7 if dtype == torch.bfloat16 and not ON_GPU else 0.0
    for a, b in ((k, rk), (v, rv)):
        assert ((a.float() - b.float()).abs() <= tol * b.float().abs()).all()


def test_errors():
    pages = make_pages("int8", 8, 2, 16, 64, torch.float16)
    src = _survivors(32)
    with pytest.raises(KernelArgError, match="tail page"):
        compact_pages(pages, src[:20], torch.tensor([7], device=DEVICE))
    with pytest.raises(KernelArgError, match="survivors"):
        compact_pages(pages, src, torch.tensor([7, int(src[0]) // 16], device=DEVICE))
    with pytest.raises(KernelArgError, match=r"src_slots must lie"):
        compact_pages(pages, src + 1000, torch.tensor([6, 7], device=DEVICE))
    with pytest.raises(KernelArgError, match="compact_tokens"):
        compact_pages(make_pages("16bit", 8, 2, 16, 64, torch.float16), src, torch.tensor([6, 7], device=DEVICE))
    p16 = make_pages("16bit", 8, 2, 16, 64, torch.float16)
    with pytest.raises(KernelArgError, match="overlap"):
        compact_tokens(p16, src[:4], src[2:6])
    with pytest.raises(KernelArgError, match="differ"):
        compact_tokens(p16, src[:4], torch.arange(100, 103, device=DEVICE))
