"""Writing K/V into pages: full pages quantized into their codec's fields in one
pass, and single tokens scattered into 16-bit (tail) pages.

Keys are quantized per channel over a whole page, so the unit of quantization is
a full page: the cache keeps the partly filled tail page in 16-bit (scatter_tokens)
and hands the page to quantize_scatter once it is full. Codes and scales are those
of kernels/quantize.py bit for bit: fp32 math, divisions rounded to nearest, ties to
even.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import quantize as ref
from ._checks import (
    INDEX_DTYPES,
    KIND,
    SIXTEEN_BIT,
    KernelArgError,
    check,
    check_device,
    check_pages,
    field_args,
    interpreting,
)
from ._pages import store_page


@triton.jit
def _quantize_scatter_kernel(k, v, src, dst, kq, ksp, kzp, vq, vsp, vzp,
                             H: tl.constexpr, S: tl.constexpr, D: tl.constexpr, KIND: tl.constexpr,
                             QMAX: tl.constexpr, ROUND: tl.constexpr, GROUP: tl.constexpr, ON_GPU: tl.constexpr):
    # grid (N, H): one page-head per program
    i = tl.program_id(0)
    h = tl.program_id(1)
    sp = tl.load(src + i).to(tl.int64)
    dp = tl.load(dst + i).to(tl.int64)
    s = tl.arange(0, S)
    d = tl.arange(0, D)
    off = ((sp * H + h) * S + s)[:, None] * D + d[None, :]
    xk = tl.load(k + off).to(tl.float32)  # [S, D]
    xv = tl.load(v + off).to(tl.float32)
    store_page(kq, ksp, kzp, vq, vsp, vzp, dp * H + h, xk, xv, S, D, KIND, QMAX, ROUND, GROUP, ON_GPU)


QUANT_WARPS = 1  # one warp per page-head: its reductions stay in the warp (H200: 81-111 % of copy rate vs 37-63 % at 4)


def quantize_scatter(k: torch.Tensor, v: torch.Tensor, dst_pages: torch.Tensor, pages: dict[str, torch.Tensor],
                     src_pages: torch.Tensor | None = None, num_warps: int = QUANT_WARPS) -> None:
    """Quantize full pages of 16-bit K/V into `pages` (int8, fp8 or int4 fields, in place).

    k, v       [N, H, S, D] fp16/bf16: N full pages, or a 16-bit staging pool when src_pages is given
    dst_pages  [M] int32/int64: destination page of each page written
    pages      the codec's fields (layout of kernels/__init__.py); the codec follows pages['k'].dtype
    src_pages  [M] int32/int64 or None (= arange(N)): which page of k, v goes to dst_pages[i]
    num_warps  per page-head program (tuning)
    Destination pages must be distinct (two writers of one page race).
    """
    codec, _, h, s, d = check_pages(pages)
    if codec == "16bit":
        raise KernelArgError("quantize_scatter writes quantized pages; copy 16-bit pages with index_copy_")
    check(k, "k", dtype=SIXTEEN_BIT, shape=(None, h, s, d))
    check(v, "v", dtype=k.dtype, shape=tuple(k.shape))
    check(dst_pages, "dst_pages", dtype=INDEX_DTYPES, shape=(None,))
    if src_pages is None:
        if dst_pages.shape[0] != k.shape[0]:
            raise KernelArgError(f"dst_pages has {dst_pages.shape[0]} entries for {k.shape[0]} pages of k")
        src_pages = torch.arange(k.shape[0], device=k.device, dtype=torch.int32)
    check(src_pages, "src_pages", dtype=INDEX_DTYPES, shape=(dst_pages.shape[0],))
    check_device(k, v, dst_pages, src_pages, pages["k"])
    n = dst_pages.shape[0]
    if n == 0:
        return
    qmax = ref.FP8_MAX if codec == "fp8" else 127.0
    _quantize_scatter_kernel[(n, h)](k, v, src_pages, dst_pages, *field_args(pages),
                                     H=h, S=s, D=d, KIND=KIND[codec], QMAX=qmax, ROUND=codec == "int8",
                                     GROUP=ref.INT4_GROUP, ON_GPU=not interpreting(), num_warps=num_warps)


def quantize_scatter_ref(k, v, dst_pages, pages, src_pages=None) -> None:
    """PyTorch reference of quantize_scatter: kernels/quantize.py's encoders, then index_copy_.

    The encoders run on the CPU: on CUDA, PyTorch divides by a Python scalar (amax / qmax) by
    multiplying with its reciprocal, which is off by one ulp now and then, so a GPU-side
    reference would itself differ from true division in a few scales."""
    codec = {torch.int8: "int8", torch.float8_e4m3fn: "fp8", torch.uint8: "int4"}[pages["k"].dtype]
    if src_pages is not None:
        k, v = k[src_pages.long()], v[src_pages.long()]
    k, v = k.cpu(), v.cpu()
    f = ref.encode_int4(k, v) if codec == "int4" else ref.encode_int8(k, v, dtype=pages["k"].dtype)
    idx = dst_pages.long()
    for name, t in f.items():
        dst = pages[name]
        t = t.to(dst.device)
        if dst.dtype == torch.float8_e4m3fn:  # index_copy_ lacks float8 on some devices: move bytes
            dst, t = dst.view(torch.uint8), t.view(torch.uint8)
        dst.index_copy_(0, idx, t)


# --- 16-bit tail pages ------------------------------------------------------------------------


@triton.jit
def _scatter_tokens_kernel(k, v, slots, kc, vc, H: tl.constexpr, S: tl.constexpr, D: tl.constexpr,
                           BLOCK_H: tl.constexpr):
    # grid (T,): token t's heads [H, D] -> page slot // S, offset slot % S. A negative slot is padding.
    t = tl.program_id(0)
    slot = tl.load(slots + t).to(tl.int64)
    if slot >= 0:
        hh = tl.arange(0, BLOCK_H)
        d = tl.arange(0, D)
        m = (hh < H)[:, None]
        src = (t * H + hh)[:, None] * D + d[None, :]
        dst = (((slot // S) * H + hh) * S + slot % S)[:, None] * D + d[None, :]
        tl.store(kc + dst, tl.load(k + src, mask=m), mask=m)
        tl.store(vc + dst, tl.load(v + src, mask=m), mask=m)


def scatter_tokens(k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor, pages: dict[str, torch.Tensor]) -> None:
    """Write tokens into 16-bit pages (in place), unchanged bits.

    k, v   [T, H, D] fp16/bf16, the pages' dtype
    slots  [T] int32/int64: page * S + offset of each token; a negative slot skips the token
    pages  {'k', 'v': [P, H, S, D]}
    """
    codec, _, h, s, d = check_pages(pages)
    if codec != "16bit":
        raise KernelArgError(f"scatter_tokens writes 16-bit pages, got {codec} pages (quantize full pages instead)")
    check(k, "k", dtype=pages["k"].dtype, shape=(None, h, d))
    check(v, "v", dtype=pages["k"].dtype, shape=tuple(k.shape))
    check(slots, "slots", dtype=INDEX_DTYPES, shape=(k.shape[0],))
    check_device(k, v, slots, pages["k"])
    if k.shape[0]:
        _scatter_tokens_kernel[(k.shape[0],)](k, v, slots, pages["k"], pages["v"], H=h, S=s, D=d,
                                              BLOCK_H=triton.next_power_of_2(h), num_warps=4)


def scatter_tokens_ref(k, v, slots, pages) -> None:
    s = pages["k"].shape[2]
    keep = slots >= 0
    sl = slots[keep].long()
    pages["k"][sl // s, :, sl % s] = k[keep]
    pages["v"][sl // s, :, sl % s] = v[keep]
