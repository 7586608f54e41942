"""Random pages with outlier key channels, as real models have, and error measures."""

from __future__ import annotations

import torch
from kvguard.kernels import quantize as ref

from .conftest import DEVICE, ON_GPU

CODECS = ("16bit", "int8", "fp8", "int4")
# The interpreter writes float8 wrongly (its own conversion), so fp8 codes written by a
# kernel are only compared on a GPU. fp8 scales and fp8 reads are checked everywhere.
FP8_STORES_OK = ON_GPU


def outlier_kv(shape, dtype, gen: torch.Generator, outlier: float = 20.0):
    """Random k, v of `shape` (head_dim last) with two key channels `outlier` times larger."""
    d = shape[-1]
    k = torch.randn(shape, generator=gen)
    v = torch.randn(shape, generator=gen)
    k[..., [3, d // 2 + 1]] *= outlier
    return k.to(dtype).to(DEVICE), v.to(dtype).to(DEVICE)


def encode(codec: str, k: torch.Tensor, v: torch.Tensor) -> dict[str, torch.Tensor]:
    """Page fields of k, v [N, H, S, D] in `codec`, by the reference encoders."""
    if codec == "16bit":
        return {"k": k.clone(), "v": v.clone()}
    if codec == "int4":
        return ref.encode_int4(k, v)
    return ref.encode_int8(k, v, dtype=torch.float8_e4m3fn if codec == "fp8" else torch.int8)


def make_pages(codec: str, num_pages: int, heads: int, page_size: int, dim: int, dtype, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    k, v = outlier_kv((num_pages, heads, page_size, dim), dtype, gen)
    return encode(codec, k, v)


def empty_fields(codec: str, num_pages: int, heads: int, page_size: int, dim: int, dtype=torch.float16):
    """Zeroed fields of a pool in `codec` (the reference encoders give the shapes and dtypes)."""
    z = torch.zeros(1, heads, page_size, dim, dtype=dtype, device=DEVICE)
    return {n: torch.zeros((num_pages, *t.shape[1:]), dtype=t.dtype, device=DEVICE)
            for n, t in encode(codec, z, z).items()}


def rel_err(out: torch.Tensor, ref_out: torch.Tensor) -> float:
    return ((out.float() - ref_out.float()).norm() / ref_out.float().norm()).item()


def as_numbers(t: torch.Tensor) -> torch.Tensor:
    """Codes as integers: int4 bytes unpacked; float8 by bit pattern (adjacent values of one
    sign differ by 1), so that a flipped .5 tie shows as a difference of 1."""
    if t.dtype == torch.float8_e4m3fn:
        return t.view(torch.uint8).int()
    if t.dtype == torch.uint8:
        return ref.unpack4(t).int()
    return t.int()


def assert_fields_match(out: dict, want: dict, codec: str) -> None:
    """Scales exactly; codes identical but for a rare ±1 at exact .5 ties."""
    for name, w in want.items():
        o = out[name]
        if name in ("k", "v"):
            if codec == "fp8" and not FP8_STORES_OK:
                continue
            diff = (as_numbers(o) - as_numbers(w)).abs()
            assert diff.max() <= 1, f"{name}: codes off by {diff.max()}"
            assert (diff > 0).float().mean() < 1e-3, f"{name}: {(diff > 0).sum()} codes differ"
        else:
            assert torch.equal(o, w), f"{name} differs at {(o != w).nonzero()[:5].tolist()}"
