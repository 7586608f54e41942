"""Quantization of whole KV pages: the PyTorch reference of every codec.

Keys are quantized per channel over the tokens of one page, values per token
(KIVI). Scales are computed in fp32, rounded to fp16 for storage, and the
codes are computed against the rounded scale, so decode(encode(x)) sees the
exact scale that was stored.
"""

from __future__ import annotations

import torch

FP16_MIN_NORMAL = 2.0**-14
FP16_MAX = 65504.0
FP8_MAX = 448.0  # largest finite float8_e4m3fn
INT4_GROUP = 32
PLAIN = (torch.float16, torch.bfloat16, torch.float32)  # unquantized fields (fp32: a CPU cache's)


def _scale(amax: torch.Tensor, qmax: float) -> torch.Tensor:
    # A zero group gets the smallest normal scale instead of a division by zero.
    return (amax.float() / qmax).clamp(FP16_MIN_NORMAL, FP16_MAX).to(torch.float16)


def symmetric_quant(x: torch.Tensor, dim: int, qmax: float, dtype: torch.dtype):
    """Symmetric max-abs quantization reducing over `dim`; returns (codes, fp16 scale)."""
    scale = _scale(x.abs().amax(dim=dim, keepdim=True), qmax)
    y = x.float() / scale.float()
    if dtype == torch.int8:
        codes = y.round().clamp(-127, 127).to(torch.int8)
    else:
        codes = y.clamp(-qmax, qmax).to(dtype)
    return codes, scale.squeeze(dim)


def symmetric_dequant(codes: torch.Tensor, scale: torch.Tensor, dim: int, out_dtype=torch.float32):
    return (codes.float() * scale.float().unsqueeze(dim)).to(out_dtype)


def asymmetric_quant4(x: torch.Tensor, dim: int):
    """Min/max 4-bit quantization reducing over `dim`; returns (codes uint8 0..15, scale, zero) in fp16."""
    lo = x.float().amin(dim=dim, keepdim=True)
    hi = x.float().amax(dim=dim, keepdim=True)
    scale = _scale(hi - lo, 15.0)
    zero = lo.clamp(-FP16_MAX, FP16_MAX).to(torch.float16)
    codes = ((x.float() - zero.float()) / scale.float()).round().clamp(0, 15).to(torch.uint8)
    return codes, scale.squeeze(dim), zero.squeeze(dim)


def pack4(codes: torch.Tensor) -> torch.Tensor:
    """[..., D] codes 0..15 -> [..., D//2] bytes, even channel in the low nibble."""
    return codes[..., 0::2] | (codes[..., 1::2] << 4)


def unpack4(packed: torch.Tensor) -> torch.Tensor:
    """[..., D//2] bytes -> [..., D] codes."""
    lo = packed & 0x0F
    hi = packed >> 4
    return torch.stack((lo, hi), dim=-1).flatten(-2)


# --- page codecs: k, v [N, H, S, D] -> fields ------------------------------------------------


def encode_int8(k: torch.Tensor, v: torch.Tensor, dtype: torch.dtype = torch.int8) -> dict[str, torch.Tensor]:
    """Value codes are stored channel-major, [N, H, D, S] (see kernels/__init__.py)."""
    qmax = 127.0 if dtype == torch.int8 else FP8_MAX
    kq, ks = symmetric_quant(k, dim=2, qmax=qmax, dtype=dtype)  # ks [N, H, D]
    vq, vs = symmetric_quant(v, dim=3, qmax=qmax, dtype=dtype)  # vs [N, H, S]
    return {"k": kq, "k_scale": ks, "v": vq.transpose(2, 3).contiguous(), "v_scale": vs}


def decode_int8(f: dict[str, torch.Tensor], out_dtype=torch.float32):
    """-> k, v [N, H, S, D]."""
    return decode_keys(f, out_dtype), decode_values(f, out_dtype)


def encode_int4(k: torch.Tensor, v: torch.Tensor, group: int = INT4_GROUP) -> dict[str, torch.Tensor]:
    n, h, s, d = v.shape
    kc, ks, kz = asymmetric_quant4(k, dim=2)  # ks, kz [N, H, D]
    vg = v.reshape(n, h, s, d // group, group)
    vc, vs, vz = asymmetric_quant4(vg, dim=4)  # vs, vz [N, H, S, D//G]
    return {
        "k": pack4(kc), "k_scale": ks, "k_zero": kz,
        # channel-major [N, H, D, S//2]: a byte holds tokens 2j (low nibble) and 2j + 1 of a channel;
        # scales and zeros group-major [N, H, D//G, S], as the codes (kernels/__init__.py)
        "v": pack4(vc.reshape(n, h, s, d).transpose(2, 3)).contiguous(),
        "v_scale": vs.transpose(2, 3).contiguous(), "v_zero": vz.transpose(2, 3).contiguous(),
    }


def decode_int4(f: dict[str, torch.Tensor], out_dtype=torch.float32, group: int = INT4_GROUP):
    """-> k, v [N, H, S, D]."""
    return decode_keys(f, out_dtype), decode_values(f, out_dtype, group)


def decode_keys(f: dict[str, torch.Tensor], out_dtype=torch.float32) -> torch.Tensor:
    """k [N, H, S, D] of page fields whose keys are in any codec (by the dtype of f['k'])."""
    dt = f["k"].dtype
    if dt in PLAIN:
        return f["k"].to(out_dtype)
    if dt == torch.uint8:
        kc = unpack4(f["k"]).float()
        return (kc * f["k_scale"].float().unsqueeze(2) + f["k_zero"].float().unsqueeze(2)).to(out_dtype)
    return symmetric_dequant(f["k"], f["k_scale"], dim=2, out_dtype=out_dtype)


def decode_values(f: dict[str, torch.Tensor], out_dtype=torch.float32, group: int = INT4_GROUP) -> torch.Tensor:
    """v [N, H, S, D] of page fields whose values are in any codec (by the dtype of f['v'])."""
    dt = f["v"].dtype
    if dt in PLAIN:
        return f["v"].to(out_dtype)
    if dt == torch.uint8:
        vc = unpack4(f["v"]).float().transpose(2, 3)
        n, h, s, d = vc.shape
        vg = vc.reshape(n, h, s, d // group, group)
        v = vg * f["v_scale"].float().transpose(2, 3).unsqueeze(-1) + f["v_zero"].float().transpose(2, 3).unsqueeze(-1)
        return v.reshape(n, h, s, d).to(out_dtype)
    return symmetric_dequant(f["v"].transpose(2, 3), f["v_scale"], dim=3, out_dtype=out_dtype)


def decode_pages(f: dict[str, torch.Tensor], out_dtype=torch.float32):
    """k, v [N, H, S, D] of page fields in any codec (16-bit, int8, fp8, int4), dequantized; keys and
    values may be in different codecs (the K/V split's pages: kvguard/compress/codecs/mixed.py)."""
    return decode_keys(f, out_dtype), decode_values(f, out_dtype)


def sequence_kv(pages: dict[str, torch.Tensor], block_row: torch.Tensor, n: int):
    """A sequence's first n tokens as k, v [H, n, D] fp32, dequantized from its pages (block_row:
    its page ids in order, at least ceil(n / S) of them)."""
    _, h, s, dk = pages["k"].shape
    if n == 0:
        empty = torch.zeros(h, 0, dk * 2 if pages["k"].dtype == torch.uint8 else dk, device=pages["k"].device)
        return empty, empty
    ids = block_row[: -(-n // s)].long()
    k, v = decode_pages({name: x[ids] for name, x in pages.items()})
    d = k.shape[-1]
    return k.permute(1, 0, 2, 3).reshape(h, -1, d)[:, :n], v.permute(1, 0, 2, 3).reshape(h, -1, d)[:, :n]


# --- compaction: survivors regrouped into full pages --------------------------------------------


def _token_fields(pages, pg, hd, off):
    """Each token's source fields, [N, H, S, ...] for page pg, head hd, offset off [N, H, S]."""
    def raw(t):
        return t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t

    def back(x, t):
        return x.view(t.dtype) if t.dtype == torch.float8_e4m3fn else x

    out = {"k": back(raw(pages["k"])[pg, hd, off], pages["k"]), "k_scale": pages["k_scale"][pg, hd]}
    v = raw(pages["v"])
    if pages["k"].dtype == torch.uint8:  # int4: values channel-major [P, H, D, S/2], nibble by offset parity
        b = v[pg, hd, :, off // 2]  # [N, H, S, D]
        out["v"] = torch.where((off % 2 == 0)[..., None], b & 15, b >> 4)
        out["k_zero"] = pages["k_zero"][pg, hd]
        out["v_scale"] = pages["v_scale"][pg, hd, :, off]  # [N, H, S, D // G]
        out["v_zero"] = pages["v_zero"][pg, hd, :, off]
    else:
        out["v"] = back(v[pg, hd, :, off], pages["v"])  # [N, H, S, D]
        out["v_scale"] = pages["v_scale"][pg, hd, off]  # [N, H, S]
    return out


def _choose(cs, cz, main, ok, fs, fz):
    """_choose over [N, H, S, D] candidates: tokens on dim 2."""
    n = float(cs.shape[2])
    same = (cs.unsqueeze(3) == cs.unsqueeze(2)) & main[:, :, :, None, None]  # [N, H, t, u, D]
    fsame = (cs == fs.unsqueeze(2)) & main[..., None]
    if cz is not None:
        same &= cz.unsqueeze(3) == cz.unsqueeze(2)
        fsame &= cz == fz.unsqueeze(2)
    inf = torch.tensor(float("inf"))
    cost = torch.where(ok, cs * cs * (n - same.float().sum(2)), inf)  # [N, H, u, D]
    fcost = fs * fs * (n - fsame.float().sum(2))
    best = torch.minimum(cost.amin(2), fcost)
    scale = torch.minimum(torch.where(cost == best.unsqueeze(2), cs, inf).amin(2), torch.where(fcost == best, fs, inf))
    if cz is None:
        return scale, None
    zero = torch.minimum(torch.where((cost == best.unsqueeze(2)) & (cs == scale.unsqueeze(2)), cz, inf).amin(2),
                         torch.where((fcost == best) & (fs == scale), fz, inf))
    return scale, zero


def compact(pages, src_slots, dst_pages, hot=None, group: int = INT4_GROUP):
    """Regroup surviving tokens of quantized pages into full pages `dst_pages` (in place), moving
    codes with their scales where the layout lets them: the reference of kernels/compact.py's
    compact_pages, whose docstring says how scales are chosen. src_slots [N * S] or [H, N * S]:
    page * S + offset in `pages`, or -1 - (page * S + offset) in the 16-bit pages `hot`."""
    dev = pages["k"].device
    f = {name: t.cpu() for name, t in pages.items()}
    _, h, s = f["k"].shape[:3]
    n = dst_pages.shape[0]
    src = src_slots.long().cpu()
    src = (src.expand(h, -1) if src.dim() == 1 else src).reshape(h, n, s).transpose(0, 1)  # [N, H, S]
    main = src >= 0
    ms = src.clamp(min=0)
    pg, off = ms // s, ms % s
    hd = torch.arange(h)[None, :, None].expand_as(pg)
    tf = _token_fields(f, pg, hd, off)
    int4 = f["k"].dtype == torch.uint8
    if int4:
        g = group
        k = unpack4(tf["k"]).float() * tf["k_scale"].float() + tf["k_zero"].float()
        vg = tf["v"].float().unflatten(-1, (-1, g)) * tf["v_scale"].float()[..., None] + tf["v_zero"].float()[..., None]
        v = vg.flatten(-2)
    else:
        k = tf["k"].float() * tf["k_scale"].float()
        v = tf["v"].float() * tf["v_scale"].float()[..., None]
    if hot is not None:
        hs = (-1 - src).clamp(min=0)
        hk, hv = hot["k"].cpu()[hs // s, hd, hs % s].float(), hot["v"].cpu()[hs // s, hd, hs % s].float()
        k = torch.where(main[..., None], k, hk)
        v = torch.where(main[..., None], v, hv)
    m2 = main[..., None]
    if int4:
        sc, zc = tf["k_scale"].float(), tf["k_zero"].float()
        lo, hi = k.amin(2, keepdim=True), k.amax(2, keepdim=True)
        fs = _scale(hi - lo, 15.0).float().squeeze(2)
        fz = lo.clamp(-FP16_MAX, FP16_MAX).half().float().squeeze(2)
        fits = m2 & (lo - zc >= -0.5 * sc) & (hi - zc <= 15.5 * sc)
        ks, kz = _choose(sc, zc, main, fits, fs, fz)
        kc = ((k - kz.unsqueeze(2)) / ks.unsqueeze(2)).round().clamp(0, 15).to(torch.uint8)
        vg = v.unflatten(-1, (-1, group))  # [N, H, S, NG, G]
        vlo = vg.amin(-1)
        vs = torch.where(m2, tf["v_scale"].float(), _scale(vg.amax(-1) - vlo, 15.0).float())
        vz = torch.where(m2, tf["v_zero"].float(), vlo.clamp(-FP16_MAX, FP16_MAX).half().float())
        vc = ((vg - vz[..., None]) / vs[..., None]).round().clamp(0, 15).to(torch.uint8).flatten(-2)
        out = {"k": pack4(kc), "k_scale": ks.half(), "k_zero": kz.half(),
               "v": pack4(vc.transpose(2, 3)).contiguous(),
               "v_scale": vs.half().transpose(2, 3).contiguous(), "v_zero": vz.half().transpose(2, 3).contiguous()}
    else:
        dtype = f["k"].dtype
        qmax = FP8_MAX if dtype == torch.float8_e4m3fn else 127.0
        cs = tf["k_scale"].float()
        fresh = _scale(k.abs().amax(2), qmax).float()
        ks, _ = _choose(cs, None, main, m2 & (cs >= fresh.unsqueeze(2)), fresh, None)
        vs = torch.where(main, tf["v_scale"].float(), _scale(v.abs().amax(-1), qmax).float())

        def codes(y):
            if dtype == torch.int8:
                return y.round().clamp(-127, 127).to(torch.int8)
            return y.clamp(-qmax, qmax).to(dtype)

        out = {"k": codes(k / ks.unsqueeze(2)), "k_scale": ks.half(),
               "v": codes(v / vs[..., None]).transpose(2, 3).contiguous(), "v_scale": vs.half()}
    idx = dst_pages.long().to(dev)
    for name, t in out.items():
        dst = pages[name]
        t = t.to(dev)
        if dst.dtype == torch.float8_e4m3fn:  # index_copy_ lacks float8 on some devices: move bytes
            dst, t = dst.view(torch.uint8), t.view(torch.uint8)
        dst.index_copy_(0, idx, t)
