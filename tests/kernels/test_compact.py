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
from .util import CODECS, FP8_STORES_OK, assert_fields_match, encode, make_pages, outlier_kv


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


@pytest.mark.parametrize("codec", ("int8", "fp8", "int4"))
@pytest.mark.parametrize("hot_dtype", (torch.float16, torch.bfloat16))
def test_compact_pages_per_head_from_both_pools(codec, hot_dtype):
    """Each head its own survivors, some of them from 16-bit pages (negative slots)."""
    pages = make_pages(codec, 12, 3, 16, 64, torch.float16, seed=4)
    hot = make_pages("16bit", 5, 3, 16, 64, hot_dtype, seed=5)
    want = {n: t.clone() for n, t in pages.items()}
    gen = torch.Generator().manual_seed(6)
    src = []
    for h in range(3):
        q = torch.randperm(6 * 16, generator=gen)  # from pages 0-5 of the codec's pool
        t = -1 - torch.randperm(5 * 16, generator=gen)[: 8 * h]  # and 0, 8, 16 from the 16-bit pool
        row = torch.cat([q[: 48 - t.numel()], t])
        src.append(row[torch.randperm(48, generator=gen)])
    src = torch.stack(src).to(torch.int32).to(DEVICE)
    dst = torch.tensor([9, 7, 11], dtype=torch.int64, device=DEVICE)
    compact_pages(pages, src, dst, hot)
    compact_pages_ref(want, src, dst, hot)
    assert_fields_match(pages, want, codec)


@pytest.mark.parametrize("codec", ("int8", "fp8", "int4"))
@pytest.mark.parametrize("kernel", (True, False), ids=("kernel", "ref"))
def test_codes_move_with_their_scales(codec, kernel):
    """A page's survivors keep their codes and scales, whichever of its tokens were evicted (the
    largest of a channel among them): decoded, they are exactly what they were. Tokens of
    another page that fit under its scales are requantized to them, and only those; values,
    per token, keep theirs."""
    if kernel and codec == "fp8" and not FP8_STORES_OK:
        pytest.skip("the interpreter writes float8 codes wrongly (tests/kernels/util.py)")
    run = compact_pages if kernel else compact_pages_ref
    gen = torch.Generator().manual_seed(7)
    k, v = outlier_kv((12, 2, 16, 64), torch.float16, gen)
    k[5] *= 0.25  # page 5's keys fit under page 2's scales
    pages = encode(codec, k, v)
    # page 2 without its tokens 0-3, then 4 tokens of page 5; per head the same
    src = torch.cat([torch.arange(2 * 16 + 4, 3 * 16), torch.arange(5 * 16, 5 * 16 + 4)]).to(DEVICE)
    before = dequantize_tokens_ref(pages, src, torch.float32)
    run(pages, src, torch.tensor([8], device=DEVICE))
    after = dequantize_tokens_ref(pages, torch.arange(8 * 16, 9 * 16, device=DEVICE), torch.float32)
    assert torch.equal(after[1], before[1])
    kept = pages["k_scale"][8] == pages["k_scale"][2]  # [H, D]: channels that kept page 2's scale
    if codec == "int4":
        kept &= pages["k_zero"][8] == pages["k_zero"][2]
    # nearly all; the others lost their largest token (evicted), and requantizing all 16 tokens to
    # a scale under half of page 2's adds less error than the 4 on page 2's grid
    assert kept.float().mean() > 0.9
    assert torch.equal(after[0][:12][:, kept], before[0][:12][:, kept])
    assert not torch.equal(after[0][12:][:, kept], before[0][12:][:, kept])  # page 5's keys: on page 2's grid


def test_a_whole_page_moves_unchanged():
    for codec in ("int8", "int4"):
        pages = make_pages(codec, 8, 2, 16, 64, torch.float16, seed=8)
        want = {n: t[3].clone() for n, t in pages.items()}
        compact_pages(pages, torch.arange(3 * 16, 4 * 16, device=DEVICE), torch.tensor([6], device=DEVICE))
        assert all(torch.equal(pages[n][6], w) for n, w in want.items())


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
    with pytest.raises(KernelArgError, match=r"src_slots must lie"):  # a 16-bit slot, no 16-bit pages
        compact_pages(pages, src - 100, torch.tensor([6, 7], device=DEVICE))
    with pytest.raises(KernelArgError, match="hot must be 16-bit"):
        compact_pages(pages, src, torch.tensor([6, 7], device=DEVICE), pages)
    with pytest.raises(KernelArgError, match=r"\[2, 32\]"):
        compact_pages(pages, src.expand(3, -1).contiguous(), torch.tensor([6, 7], device=DEVICE))
    with pytest.raises(KernelArgError, match="compact_tokens"):
        compact_pages(make_pages("16bit", 8, 2, 16, 64, torch.float16), src, torch.tensor([6, 7], device=DEVICE))
    p16 = make_pages("16bit", 8, 2, 16, 64, torch.float16)
    with pytest.raises(KernelArgError, match="overlap"):
        compact_tokens(p16, src[:4], src[2:6])
    with pytest.raises(KernelArgError, match="differ"):
        compact_tokens(p16, src[:4], torch.arange(100, 103, device=DEVICE))
