"""Compaction: move the tokens that survive eviction into fewer pages, so that the
source pages can be freed.

16-bit pages: a bit copy of each surviving token row (compact_tokens).

Quantized pages (compact_pages): survivors are regrouped S at a time into full destination
pages, each head its own. Compaction must not add error, so codes move with their scales
wherever the layout lets them:

- values are quantized per token: a survivor keeps its scale (and int4 zero points), so its
  codes are the same codes;
- keys carry one scale (int4: scale and zero point) per page and channel. For each destination
  page-head and channel the scale is chosen among those of the survivors' source pages and the
  scale a fresh encode would take, the one that requantizes least: cost = scale^2 x the tokens
  whose source page had another scale (their added rounding error, up to a constant), among the
  scales under which every survivor fits; ties go to the smaller scale (then zero point). The
  survivors of a page whose scale is kept keep their codes; only the others are requantized, from
  their exactly decoded values.

A survivor may also come from a 16-bit page (slot < 0, read from `hot`): it is encoded for the
first time, against the chosen key scale and a fresh per-token value scale.

Every page-head's codes are requantized from fp32 values decoded exactly (a code times an fp16
scale is exact in fp32), and a code divided by the scale it was encoded with is that code again:
keeping a scale is keeping the codes, with no separate copy path.

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
from ._pages import FP16_MAX, divide, fp16_scale, load_tokens_f32, rint, store_fields


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
def _choose(cs, cz, main, ok, fs, fz, S: tl.constexpr, ZERO: tl.constexpr):
    """Per channel, the (scale, zero) of least cost among the candidates: each token's source
    page (cs, cz [S, D], where `ok`: from a quantized page, and every survivor fits its grid) and
    the fresh one (fs, fz [D]). cost = scale^2 x tokens of another (scale, zero)."""
    n = S * 1.0
    same = (cs[:, None, :] == cs[None, :, :]) & main[:, None, None]  # [t, u, D]: token t shares u's
    if ZERO:
        same = same & (cz[:, None, :] == cz[None, :, :])
    inf = float("inf")
    cost = tl.where(ok, cs * cs * (n - tl.sum(same.to(tl.float32), 0)), inf)  # [u, D]
    fsame = (cs == fs[None, :]) & main[:, None]
    if ZERO:
        fsame = fsame & (cz == fz[None, :])
    fcost = fs * fs * (n - tl.sum(fsame.to(tl.float32), 0))  # [D]
    best = tl.minimum(tl.min(cost, 0), fcost)
    scale = tl.minimum(tl.min(tl.where(cost == best[None, :], cs, inf), 0), tl.where(fcost == best, fs, inf))
    zero = fz
    if ZERO:
        zero = tl.minimum(tl.min(tl.where((cost == best[None, :]) & (cs == scale[None, :]), cz, inf), 0),
                          tl.where((fcost == best) & (fs == scale), fz, inf))
    return scale, zero


@triton.jit
def _compact_kernel(kp, ksp, kzp, vp, vsp, vzp, hkp, hvp, src, dst, src_head_stride,
                    H: tl.constexpr, S: tl.constexpr, D: tl.constexpr, KIND: tl.constexpr,
                    QMAX: tl.constexpr, ROUND: tl.constexpr, GROUP: tl.constexpr, HOT: tl.constexpr,
                    ON_GPU: tl.constexpr):
    # grid (N, H): head h's tokens src[h, i*S : (i+1)*S] -> page dst[i], head h = program_id(1)
    i = tl.program_id(0)
    h = tl.program_id(1)
    t = tl.arange(0, S)
    d = tl.arange(0, D)
    slot = tl.load(src + h * src_head_stride + i * S + t).to(tl.int64)  # [S]
    main = slot >= 0
    ms = tl.where(main, slot, 0)
    page, off = ms // S, ms % S
    k, v = load_tokens_f32(kp, ksp, kzp, vp, vsp, vzp, page, off, main, h, H, S, D, S, KIND, GROUP)
    if HOT:  # survivors from 16-bit pages: slot -1 - s of the hot pages
        hs = tl.where(main, 0, -1 - slot)
        row = (((hs // S) * H + h) * S + hs % S)[:, None] * D + d[None, :]
        hm = (~main)[:, None]
        k = tl.where(hm, tl.load(hkp + row, mask=hm, other=0.0).to(tl.float32), k)
        v = tl.where(hm, tl.load(hvp + row, mask=hm, other=0.0).to(tl.float32), v)
    ph = page * H + h  # [S] source page-head of each token
    m2 = main[:, None]
    dp = tl.load(dst + i).to(tl.int64) * H + h
    if KIND == 1:
        cs = tl.load(ksp + ph[:, None] * D + d[None, :], mask=m2, other=0.0).to(tl.float32)
        fresh = fp16_scale(tl.max(tl.abs(k), 0), QMAX).to(tl.float32)
        ok = m2 & (cs >= fresh[None, :])  # a smaller scale would clip the largest survivor
        ks, _ = _choose(cs, cs, main, ok, fresh, fresh, S, False)
        kc = divide(k, ks[None, :], ON_GPU)
        vs = tl.where(main, tl.load(vsp + ph * S + off, mask=main, other=0.0).to(tl.float32),
                      fp16_scale(tl.max(tl.abs(v), 1), QMAX).to(tl.float32))  # [S]: the source's, or fresh
        vc = divide(v, vs[:, None], ON_GPU)
        if ROUND:
            kc = rint(kc, ON_GPU)
            vc = rint(vc, ON_GPU)
        kc = tl.minimum(tl.maximum(kc, -QMAX), QMAX)
        vc = tl.minimum(tl.maximum(vc, -QMAX), QMAX)
        store_fields(kp, ksp, kzp, vp, vsp, vzp, dp, kc, ks.to(tl.float16), ks.to(tl.float16), vc,
                     vs.to(tl.float16), vs.to(tl.float16), S, D, KIND, GROUP)
    else:
        NG: tl.constexpr = D // GROUP
        sc = tl.load(ksp + ph[:, None] * D + d[None, :], mask=m2, other=0.0).to(tl.float32)
        zc = tl.load(kzp + ph[:, None] * D + d[None, :], mask=m2, other=0.0).to(tl.float32)
        lo = tl.min(k, 0)
        hi = tl.max(k, 0)
        fs = fp16_scale(hi - lo, 15.0).to(tl.float32)
        fz = tl.minimum(tl.maximum(lo, -FP16_MAX), FP16_MAX).to(tl.float16).to(tl.float32)
        # a source's grid holds every survivor when all round into its codes 0..15
        fits = m2 & (lo[None, :] - zc >= -0.5 * sc) & (hi[None, :] - zc <= 15.5 * sc)
        ks, kz = _choose(sc, zc, main, fits, fs, fz, S, True)
        kc = tl.minimum(tl.maximum(rint(divide(k - kz[None, :], ks[None, :], ON_GPU), ON_GPU), 0.0), 15.0)
        # values per token and group of GROUP channels: the source's scale and zero, or fresh
        vg = v.reshape(S, NG, GROUP)
        gi = (ph[:, None] * NG + tl.arange(0, NG)[None, :]) * S + off[:, None]  # [S, NG], group-major fields
        vlo = tl.min(vg, 2)
        vs = tl.where(m2, tl.load(vsp + gi, mask=m2, other=0.0).to(tl.float32),
                      fp16_scale(tl.max(vg, 2) - vlo, 15.0).to(tl.float32))
        vz = tl.where(m2, tl.load(vzp + gi, mask=m2, other=0.0).to(tl.float32),
                      tl.minimum(tl.maximum(vlo, -FP16_MAX), FP16_MAX).to(tl.float16).to(tl.float32))
        vc = divide(vg - vz[:, :, None], vs[:, :, None], ON_GPU)
        vc = tl.minimum(tl.maximum(rint(vc, ON_GPU), 0.0), 15.0).reshape(S, D)
        store_fields(kp, ksp, kzp, vp, vsp, vzp, dp, kc, ks.to(tl.float16), kz.to(tl.float16), vc,
                     vs.to(tl.float16), vz.to(tl.float16), S, D, KIND, GROUP)


def compact_pages(pages: dict[str, torch.Tensor], src_slots: torch.Tensor, dst_pages: torch.Tensor,
                  hot: dict[str, torch.Tensor] | None = None) -> None:
    """Regroup surviving tokens of quantized pages into full pages (in place, same pool),
    moving codes with their scales where they can (see the module's docstring).

    pages      int8, fp8 or int4 page fields (layout of kernels/__init__.py)
    src_slots  [N * S] (every head) or [H, N * S] (each head its own) int32/int64: the survivors
               in their new order, page * S + offset in `pages`, or -1 - (page * S + offset) in `hot`
    dst_pages  [N] int32/int64, freshly allocated pages: none may hold a survivor
    hot        16-bit pages {'k', 'v': [P', H, S, D]}, where survivors with a negative slot are
    """
    codec, p, h, s, d = check_pages(pages)
    if codec == "16bit":
        raise KernelArgError("compact_pages requantizes quantized pages; 16-bit pages need compact_tokens")
    check(dst_pages, "dst_pages", dtype=INDEX_DTYPES, shape=(None,))
    n = dst_pages.shape[0]
    check(src_slots, "src_slots", dtype=INDEX_DTYPES)
    if src_slots.dim() not in (1, 2) or src_slots.shape[-1] != n * s or (src_slots.dim() == 2 and
                                                                          src_slots.shape[0] != h):
        raise KernelArgError(f"src_slots must be [{n * s}] or [{h}, {n * s}] to fill {n} pages of {s}, got "
                             f"{list(src_slots.shape)}: put a remainder in the 16-bit tail page (dequantize_tokens)")
    hp = 0
    if hot is not None:
        hcodec, hp, hh, hs, hd = check_pages(hot)
        if hcodec != "16bit" or (hh, hs, hd) != (h, s, d):
            raise KernelArgError(f"hot must be 16-bit pages [*, {h}, {s}, {d}], got {hcodec} "
                                 f"{list(hot['k'].shape)}")
        check_device(hot["k"], pages["k"])
    check_device(src_slots, dst_pages, pages["k"])
    if src_slots.numel():
        lo, hi = int(src_slots.min()), int(src_slots.max())
        if hi >= p * s or lo < -hp * s:
            raise KernelArgError(f"src_slots must lie in [0, {p * s}) (page * page_size + offset), or in "
                                 f"[-{hp * s}, 0) for slots of hot pages")
    if torch.isin(dst_pages.long(), src_slots[src_slots >= 0].long() // s).any():
        raise KernelArgError("dst_pages hold survivors: compact into freshly allocated pages")
    if n:
        qmax = ref.FP8_MAX if codec == "fp8" else 127.0
        with_hot = hot is not None and lo < 0
        hk, hv = (hot["k"], hot["v"]) if with_hot else (pages["k"], pages["k"])
        _compact_kernel[(n, h)](*field_args(pages), hk, hv, src_slots, dst_pages,
                                n * s if src_slots.dim() == 2 else 0, H=h, S=s, D=d, KIND=KIND[codec],
                                QMAX=qmax, ROUND=codec == "int8", GROUP=ref.INT4_GROUP, HOT=with_hot,
                                ON_GPU=not interpreting(), num_warps=4)


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


def compact_pages_ref(pages, src_slots, dst_pages, hot=None):
    ref.compact(pages, src_slots, dst_pages, hot)
