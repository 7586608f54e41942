"""Argument checks shared by the kernel wrappers, and the codec a page dict holds.

Kernels index pages by arithmetic on the layout of kernels/__init__.py, so a
wrong dtype, shape or stride would read the wrong bytes silently: every wrapper
checks its arguments first and raises KernelArgError saying what to pass.
"""

from __future__ import annotations

import math
import os

import torch

from . import quantize as ref

SIXTEEN_BIT = (torch.float16, torch.bfloat16)
INDEX_DTYPES = (torch.int32, torch.int64)
FIELDS = {
    "16bit": ("k", "v"),
    "int8": ("k", "k_scale", "v", "v_scale"),
    "fp8": ("k", "k_scale", "v", "v_scale"),
    "int4": ("k", "k_scale", "k_zero", "v", "v_scale", "v_zero"),
}


class KernelArgError(ValueError):
    """A kernel was called with arguments it cannot use; the message says which and why."""


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")


def softmax_scale(sm_scale, d: int) -> float:
    """The logits' scale: 1/sqrt(d) by default, else a positive finite number."""
    if sm_scale is None:
        return 1.0 / math.sqrt(d)
    scale = float(sm_scale)
    if not (math.isfinite(scale) and scale > 0):
        raise KernelArgError(f"sm_scale must be a positive finite number, got {sm_scale}")
    return scale


def check_device(*tensors: torch.Tensor) -> torch.device:
    dev = tensors[0].device
    for t in tensors:
        if t.device != dev:
            raise KernelArgError(f"all tensors must be on one device, got {dev} and {t.device}")
    if dev.type == "cpu" and not interpreting():
        raise KernelArgError("CPU tensors need Triton's interpreter: set TRITON_INTERPRET=1 before importing "
                             "triton, or pass CUDA tensors")
    if dev.type not in ("cpu", "cuda"):
        raise KernelArgError(f"tensors on {dev} are not supported; pass CUDA tensors")
    return dev


def check_queries(q: torch.Tensor, lead: int, h: int, d: int) -> tuple[int, ...]:
    """q [*lead dims, Hq, D] fp16/bf16 whose Hq is a multiple of the pages' h KV heads: its shape."""
    check(q, "q", dtype=SIXTEEN_BIT, shape=(None,) * (lead + 1) + (d,))
    if q.shape[-2] % h:
        raise KernelArgError(f"q has {q.shape[-2]} heads, not a multiple of the pages' {h} KV heads")
    return tuple(q.shape)


def check(t: torch.Tensor, name: str, *, dtype=None, shape=None, contiguous: bool = True) -> None:
    """dtype: one dtype or a tuple; shape: a tuple whose None entries match any size."""
    if not isinstance(t, torch.Tensor):
        raise KernelArgError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if dtype is not None:
        ok = dtype if isinstance(dtype, tuple) else (dtype,)
        if t.dtype not in ok:
            raise KernelArgError(f"{name} must be {' or '.join(map(str, ok))}, got {t.dtype}")
    if shape is not None:
        if t.dim() != len(shape) or any(s is not None and s != n for s, n in zip(shape, t.shape)):
            want = "[" + ", ".join("*" if s is None else str(s) for s in shape) + "]"
            raise KernelArgError(f"{name} must have shape {want}, got {list(t.shape)}")
    if contiguous and not t.is_contiguous():
        raise KernelArgError(f"{name} must be contiguous (call .contiguous() first)")


_CODES = {torch.int8: "int8", torch.float8_e4m3fn: "fp8", torch.uint8: "int4"}


def _codec_by_dtype(dt: torch.dtype) -> str | None:
    return "16bit" if dt in SIXTEEN_BIT else _CODES.get(dt)


def codec_of(pages: dict[str, torch.Tensor]) -> str:
    """'16bit', 'int8', 'fp8' or 'int4', from the dtype of pages['k']: the keys' codec."""
    if not isinstance(pages, dict) or "k" not in pages or "v" not in pages:
        raise KernelArgError("pages must be a dict of page fields with at least 'k' and 'v'")
    dt = pages["k"].dtype
    codec = _codec_by_dtype(dt)
    if codec is None:
        raise KernelArgError(f"pages['k'] has dtype {dt}: expected fp16/bf16, int8, float8_e4m3fn or uint8 (int4)")
    vcodec = value_codec_of(pages)
    want = [f for f in FIELDS[codec] if f.startswith("k")] + [f for f in FIELDS[vcodec] if f.startswith("v")]
    missing = [f for f in want if f not in pages]
    if missing:
        raise KernelArgError(f"{codec} keys and {vcodec} values need the fields {want}; missing {missing}")
    return codec


def value_codec_of(pages: dict[str, torch.Tensor]) -> str:
    """The values' codec, from the dtype of pages['v']: the keys' but in a K/V split's pages,
    whose keys may be in a smaller codec (kvguard/compress/codecs/mixed.py)."""
    dt = pages["v"].dtype
    codec = _codec_by_dtype(dt)
    if codec is None:
        raise KernelArgError(f"pages['v'] has dtype {dt}: expected fp16/bf16, int8, float8_e4m3fn or uint8 (int4)")
    return codec


def check_pages(pages: dict[str, torch.Tensor], mixed: bool = False,
                device: torch.device | None = None) -> tuple[str, int, int, int, int]:
    """Check every field against the layout of kernels/__init__.py; returns (codec, P, H, S, D), the
    codec the keys'. Keys and values in different codecs only with `mixed` (the kernels that read
    pages, not those that write them). Values may be in pinned host memory, which a CUDA device
    reads in place; with `device` (the reading kernel's), keys too (a K/V split's exact keys)."""
    codec, vcodec = codec_of(pages), value_codec_of(pages)
    if codec != vcodec and not mixed:
        raise KernelArgError(f"this kernel takes keys and values in one codec, got {codec} keys and {vcodec} values")
    k = pages["k"]
    if k.dim() != 4:
        raise KernelArgError(f"pages['k'] must be [P, H, S, D], got shape {list(k.shape)}")
    p, h, s, dk = k.shape
    d = dk * 2 if codec == "int4" else dk
    if d < 16 or d & (d - 1):
        raise KernelArgError(f"head_dim must be a power of two >= 16, got {d}")
    if s < 1 or s & (s - 1):
        raise KernelArgError(f"page_size must be a power of two, got {s}")
    if "int4" in (codec, vcodec):
        if d % ref.INT4_GROUP:
            raise KernelArgError(f"int4 needs head_dim divisible by {ref.INT4_GROUP}, got {d}")
        if s < 2:
            raise KernelArgError(f"int4 needs page_size >= 2 (two tokens a byte), got {s}")
    if codec in ("int8", "fp8"):
        check(pages["k_scale"], "pages['k_scale']", dtype=torch.float16, shape=(p, h, d))
    elif codec == "int4":
        for f in ("k_scale", "k_zero"):
            check(pages[f], f"pages['{f}']", dtype=torch.float16, shape=(p, h, d))
    if vcodec == "16bit":
        check(pages["v"], "pages['v']", dtype=pages["v"].dtype, shape=(p, h, s, d))
        if codec == "16bit" and pages["v"].dtype != k.dtype:
            raise KernelArgError(f"16-bit pages need K and V in one dtype, got {k.dtype} and {pages['v'].dtype}")
    elif vcodec in ("int8", "fp8"):
        check(pages["v"], "pages['v']", dtype=pages["v"].dtype, shape=(p, h, d, s))  # channel-major
        check(pages["v_scale"], "pages['v_scale']", dtype=torch.float16, shape=(p, h, s))
    else:
        check(pages["v"], "pages['v']", dtype=torch.uint8, shape=(p, h, d, s // 2))  # channel-major
        for f in ("v_scale", "v_zero"):
            check(pages[f], f"pages['{f}']", dtype=torch.float16, shape=(p, h, d // ref.INT4_GROUP, s))
    check(k, "pages['k']")
    keys = [f for f in FIELDS[codec] if f.startswith("k")]
    host = [f for f in FIELDS[vcodec] if f.startswith("v")]
    if device is None:
        dev = check_device(*[pages[f] for f in keys])
    else:
        dev, host = device, keys + host
    for f in host:
        t = pages[f]
        if t.device != dev and not (dev.type == "cuda" and t.device.type == "cpu" and t.is_pinned()):
            raise KernelArgError(f"pages['{f}'] must be on {dev} (or in pinned host memory, which it reads in "
                                 f"place), got {t.device}")
    return codec, p, h, s, d


def check_decode(q: torch.Tensor, pages: dict[str, torch.Tensor], block_table: torch.Tensor,
                 seq_lens: torch.Tensor) -> tuple[str, int, int, int, int, torch.device]:
    """A decode call's arguments: q [B, Hq, D], one layer's pages, block_table [B, n] (rows
    contiguous), seq_lens [B]. Returns (codec, H, S, D, B, device), the codec the keys' (the values'
    may differ: value_codec_of)."""
    codec, _, h, s, d = check_pages(pages, mixed=True, device=q.device)
    b, _, _ = check_queries(q, 1, h, d)
    check(block_table, "block_table", dtype=INDEX_DTYPES, shape=(b, None), contiguous=False)
    if block_table.stride(1) != 1:
        raise KernelArgError("block_table rows must be contiguous (stride 1 along pages)")
    check(seq_lens, "seq_lens", dtype=INDEX_DTYPES, shape=(b,))
    return codec, h, s, d, b, check_device(q, block_table, seq_lens)


def field_args(pages: dict[str, torch.Tensor]) -> list[torch.Tensor]:
    """The six field pointers a kernel takes (k, k_scale, k_zero, v, v_scale, v_zero); absent
    fields are passed as pages['k'] and never read (the kernel's KIND decides)."""
    return [pages.get(f, pages["k"]) for f in ("k", "k_scale", "k_zero", "v", "v_scale", "v_zero")]


KIND = {"16bit": 0, "int8": 1, "fp8": 1, "int4": 2}


# Triton 3.6 miscompiles these: the int4 loader joins low and high nibbles (tl.join), after which
# Triton gives both tensor-core operands of every dot kWidth 8 (eight consecutive K elements per
# thread; seen in the TTGIR, where int8 pages get 4); a product that reduces over 16 elements,
# one m16n8k16 step, has room for only 4, and its result is wrong (no error, no race: the same
# wrong numbers on every run and with any pipeline depth). Q @ K^T reduces over head_dim (>= 64)
# and is right; P @ V reduces over the tokens of a warp's step, 16 with one page per warp. Seen on an
# H200 with the 2-D tile of 1 page and 1 warp and with warp_split at 1 page per warp (2 pages
# over 2 warps, 4 over 4), with or without the inline PTX; fixed upstream ("Fix MMAv2 kWidth for
# small-K upcast operands", triton-lang/triton#11691). benchmarks/kernels/triton_small_k.py shows it
# alone.
MIN_INT4_PV_TOKENS = 32


def pv_pages(pages: int, s: int, codecs, per_warp: int = 1, given: bool = False) -> int:
    """Pages of s tokens a tile's step takes so that P @ V reduces over at least 16 tokens a warp
    (tl.dot's least K, which the interpreter does not enforce and the compiler does), 32 for int4:
    the table's `pages`, doubled as small pages need. A count the caller gave is kept, and refused
    below 16 tokens."""
    if not given:
        while pages * s // per_warp < (MIN_INT4_PV_TOKENS if "int4" in codecs else 16):
            pages *= 2
    if pages * s // per_warp < 16:
        raise KernelArgError(f"a step's P @ V would reduce over {pages * s // per_warp} tokens a warp; Triton's dot "
                             f"needs at least 16: give more pages a step (pages {pages} of {s} tokens)")
    return pages


def check_int4_tile(codec: str, pv_tokens: int) -> None:
    if codec == "int4" and pv_tokens < MIN_INT4_PV_TOKENS:
        raise KernelArgError(f"int4 tiles need at least {MIN_INT4_PV_TOKENS} tokens per warp and step in P @ V, "
                             f"not {pv_tokens}: Triton 3.6 computes a 16-token reduction over int4 pages wrongly")
