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
    k = symmetric_dequant(f["k"], f["k_scale"], dim=2, out_dtype=out_dtype)
    v = symmetric_dequant(f["v"].transpose(2, 3), f["v_scale"], dim=3, out_dtype=out_dtype)
    return k, v


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
    kc = unpack4(f["k"]).float()
    k = kc * f["k_scale"].float().unsqueeze(2) + f["k_zero"].float().unsqueeze(2)
    vc = unpack4(f["v"]).float().transpose(2, 3)
    n, h, s, d = vc.shape
    vg = vc.reshape(n, h, s, d // group, group)
    v = vg * f["v_scale"].float().transpose(2, 3).unsqueeze(-1) + f["v_zero"].float().transpose(2, 3).unsqueeze(-1)
    return k.to(out_dtype), v.reshape(n, h, s, d).to(out_dtype)


def decode_pages(f: dict[str, torch.Tensor], out_dtype=torch.float32):
    """k, v [N, H, S, D] of page fields in any codec (16-bit, int8, fp8, int4), dequantized."""
    dt = f["k"].dtype
    if dt in (torch.float16, torch.bfloat16):
        return f["k"].to(out_dtype), f["v"].to(out_dtype)
    return decode_int4(f, out_dtype) if dt == torch.uint8 else decode_int8(f, out_dtype)


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
