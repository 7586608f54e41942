"""Compaction: move the tokens that survive eviction into fewer pages, so that the
source pages can be freed.

16-bit pages: a bit copy of each surviving token row (compact_tokens).
Quantized pages: keys carry one scale per page and channel, so a token cannot keep its
codes in another page. compact_pages dequantizes the survivors (fp32, exactly as
kernels/quantize.py decodes), regroups them S at a time into full destination pages and
requantizes each page in the same program. Values, quantized per token, could keep their
codes and scale, but requantizing them too keeps one path; requantizing codes that
decoded exactly gives the same codes back in nearly all cases. Survivors that do not
fill a last page belong in the 16-bit tail page: dequantize_tokens gives them in 16-bit.

Sources and destinations must not overlap (write into freshly allocated pages): the
programs of one launch run in any order.
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
from ._pages import load_tokens_f32, store_page


@triton.jit
def _move_tokens_kernel(kp, vp, src, dst, T, H: tl.constexpr, S: tl.constexpr, D: tl.constexpr,
                        BLOCK_T: tl.constexpr):
    # grid (cdiv(T, BLOCK_T), H): k, v rows of slot src[i] -> slot dst[i], head program_id(1)
    i = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    h = tl.program_id(1)
    ok = i < T
    ss = tl.load(src + i, mask=ok, other=0).to(tl.int64)
    ds = tl.load(dst + i, mask=ok, other=0).to(tl.int64)
    d = tl.arange(0, D)
    so = (((ss // S) * H + h) * S + ss % S)[:, None] * D + d[None, :]
    do = (((ds // S) * H + h) * S + ds % S)[:, None] * D + d[None, :]
    tl.store(kp + do, tl.load(kp + so, mask=ok[:, None]), mask=ok[:, None])
    tl.store(vp + do, tl.load(vp + so, mask=ok[:, None]), mask=ok[:, None])


def _check_slots(name: str, slots: torch.Tensor, num_slots: int) -> None:
    check(slots, name, dtype=INDEX_DTYPES, shape=(None,))
    if slots.numel() and (int(slots.min()) < 0 or int(slots.max()) >= num_slots):
        raise KernelArgError(f"{name} must lie in [0, {num_slots}) (page * page_size + offset)")


def compact_tokens(pages: dict[str, torch.Tensor], src_slots: torch.Tensor, dst_slots: torch.Tensor) -> None:
    """Move 16-bit token rows inside one pool (in place).

    pages      {'k', 'v': [P, H, S, D]} fp16/bf16
    src_slots  [T] int32/int64, page * S + offset of each surviving token
    dst_slots  [T] int32/int64, where it goes; no dst slot may also be a src slot
    """
    codec, p, h, s, d = check_pages(pages)
    if codec != "16bit":
        raise KernelArgError(f"compact_tokens moves 16-bit rows; {codec} pages need compact_pages")
    _check_slots("src_slots", src_slots, p * s)
    _check_slots("dst_slots", dst_slots, p * s)
    if src_slots.shape != dst_slots.shape:
        raise KernelArgError(f"src_slots {list(src_slots.shape)} and dst_slots {list(dst_slots.shape)} differ")
    check_device(src_slots, dst_slots, pages["k"])
    if torch.isin(dst_slots, src_slots).any():
        raise KernelArgError("dst_slots overlap src_slots: move survivors into freshly allocated pages")
    t = src_slots.shape[0]
    if t:
        bt = 16
        _move_tokens_kernel[(triton.cdiv(t, bt), h)](pages["k"], pages["v"], src_slots, dst_slots, t,
                                                     H=h, S=s, D=d, BLOCK_T=bt, num_warps=4)


@triton.jit
def _requantize_kernel(kp, ksp, kzp, vp, vsp, vzp, src, dst,
                       H: tl.constexpr, S: tl.constexpr, D: tl.constexpr, KIND: tl.constexpr,
                       QMAX: tl.constexpr, ROUND: tl.constexpr, GROUP: tl.constexpr, ON_GPU: tl.constexpr):
    # grid (N, H): tokens src[i*S : (i+1)*S] -> page dst[i], head program_id(1)
    i = tl.program_id(0)
    h = tl.program_id(1)
    slot = tl.load(src + i * S + tl.arange(0, S)).to(tl.int64)  # [S]
    k, v = load_tokens_f32(kp, ksp, kzp, vp, vsp, vzp, slot // S, slot % S, slot >= 0, h,
                           H, S, D, S, KIND, GROUP)
    dp = tl.load(dst + i).to(tl.int64)
    store_page(kp, ksp, kzp, vp, vsp, vzp, dp * H + h, k, v, S, D, KIND, QMAX, ROUND, GROUP, ON_GPU)


def compact_pages(pages: dict[str, torch.Tensor], src_slots: torch.Tensor, dst_pages: torch.Tensor) -> None:
    """Regroup surviving tokens of quantized pages into full pages (in place, same pool).

    pages      int8, fp8 or int4 page fields (layout of kernels/__init__.py)
    src_slots  [N * S] int32/int64, page * S + offset of each survivor, in their new order
    dst_pages  [N] int32/int64, freshly allocated pages: none may hold a survivor
    """
    codec, p, h, s, d = check_pages(pages)
    if codec == "16bit":
        raise KernelArgError("compact_pages requantizes quantized pages; 16-bit pages need compact_tokens")
    _check_slots("src_slots", src_slots, p * s)
    check(dst_pages, "dst_pages", dtype=INDEX_DTYPES, shape=(None,))
    n = dst_pages.shape[0]
    if src_slots.shape[0] != n * s:
        raise KernelArgError(f"{src_slots.shape[0]} src_slots do not fill {n} pages of {s}: put the "
                             "remainder in the 16-bit tail page (dequantize_tokens)")
    check_device(src_slots, dst_pages, pages["k"])
    if torch.isin(dst_pages.long(), src_slots.long() // s).any():
        raise KernelArgError("dst_pages hold survivors: compact into freshly allocated pages")
    if n:
        qmax = ref.FP8_MAX if codec == "fp8" else 127.0
        _requantize_kernel[(n, h)](*field_args(pages), src_slots, dst_pages, H=h, S=s, D=d, KIND=KIND[codec],
                                   QMAX=qmax, ROUND=codec == "int8", GROUP=ref.INT4_GROUP, ON_GPU=not interpreting(),
                                   num_warps=4)


@triton.jit
def _dequantize_tokens_kernel(kp, ksp, kzp, vp, vsp, vzp, slots, ko, vo, T, H: tl.constexpr, S: tl.constexpr,
                              D: tl.constexpr, KIND: tl.constexpr, GROUP: tl.constexpr, BLOCK_T: tl.constexpr):
    # grid (cdiv(T, BLOCK_T), H): ko, vo [T, H, D]
    i = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    h = tl.program_id(1)
    ok = i < T
    slot = tl.load(slots + i, mask=ok, other=0).to(tl.int64)
    k, v = load_tokens_f32(kp, ksp, kzp, vp, vsp, vzp, slot // S, slot % S, ok, h, H, S, D, BLOCK_T, KIND, GROUP)
    o = (i.to(tl.int64) * H + h)[:, None] * D + tl.arange(0, D)[None, :]
    tl.store(ko + o, k.to(ko.dtype.element_ty), mask=ok[:, None])
    tl.store(vo + o, v.to(vo.dtype.element_ty), mask=ok[:, None])


def dequantize_tokens(pages: dict[str, torch.Tensor], slots: torch.Tensor, dtype: torch.dtype = torch.float16):
    """k, v [T, H, D] in `dtype` (fp16, bf16 or fp32) of the tokens at `slots` [T] (page * S + offset)."""
    codec, p, h, s, d = check_pages(pages)
    _check_slots("slots", slots, p * s)
    if dtype not in SIXTEEN_BIT + (torch.float32,):
        raise KernelArgError(f"dtype must be fp16, bf16 or fp32, got {dtype}")
    check_device(slots, pages["k"])
    t = slots.shape[0]
    k = torch.empty(t, h, d, dtype=dtype, device=slots.device)
    v = torch.empty_like(k)
    if t:
        bt = 16
        _dequantize_tokens_kernel[(triton.cdiv(t, bt), h)](*field_args(pages), slots, k, v, t, H=h, S=s, D=d,
                                                           KIND=KIND[codec], GROUP=ref.INT4_GROUP, BLOCK_T=bt,
                                                           num_warps=4)
    return k, v


# --- references --------------------------------------------------------------------------------


def dequantize_tokens_ref(pages, slots, dtype=torch.float16):
    s = pages["k"].shape[2]
    k, v = ref.decode_pages({name: t[slots.long() // s] for name, t in pages.items()})  # each token's page
    off = (slots.long() % s)[:, None, None, None].expand(-1, k.shape[1], 1, k.shape[3])
    return k.gather(2, off).squeeze(2).to(dtype), v.gather(2, off).squeeze(2).to(dtype)  # [T, H, D]


def compact_tokens_ref(pages, src_slots, dst_slots):
    s = pages["k"].shape[2]
    src, dst = src_slots.long(), dst_slots.long()
    for name in ("k", "v"):
        pages[name][dst // s, :, dst % s] = pages[name][src // s, :, src % s]


def compact_pages_ref(pages, src_slots, dst_pages):
    from .quantize_scatter import quantize_scatter_ref

    s = pages["k"].shape[2]
    k, v = dequantize_tokens_ref(pages, src_slots, torch.float32)  # [N*S, H, D]
    n, h, d = dst_pages.shape[0], k.shape[1], k.shape[2]
    k = k.reshape(n, s, h, d).transpose(1, 2)
    v = v.reshape(n, s, h, d).transpose(1, 2)
    quantize_scatter_ref(k, v, dst_pages, pages)
