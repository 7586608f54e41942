"""Gather whole pages of one field into a dense buffer, on the device.

The K/V split (kvguard/cache/split.py) keeps cold pages' values in pinned host memory, which is
mapped into the device's address space. A prefill chunk's queries together read many of those
pages, most of them many times; gathering the pages they read once into device memory (one read
of each over the bus) lets the attention kernels read them there. torch cannot index a host
tensor from the device, so this kernel does: one program a page and block of its elements.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._checks import KernelArgError
from ._launch import launch

BLOCK = 1024


@triton.jit
def _gather_kernel(src, idx, dst, page_elems, BLOCK: tl.constexpr):
    p = tl.program_id(0)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < page_elems
    page = tl.load(idx + p).to(tl.int64)
    x = tl.load(src + page * page_elems + offs, mask=ok)
    tl.store(dst + p.to(tl.int64) * page_elems + offs, x, mask=ok)


def gather_pages(src: torch.Tensor, idx: torch.Tensor, device: torch.device) -> torch.Tensor:
    """src [P, ...] contiguous (on the device, or in pinned host memory when the device is CUDA);
    idx [n] int32/int64 page indices on `device`. Returns src[idx] on `device`, read in place."""
    if not src.is_contiguous() or idx.dim() != 1 or idx.dtype not in (torch.int32, torch.int64):
        raise KernelArgError("gather_pages takes a contiguous src [P, ...] and idx [n] int32 or int64")
    if idx.device != device or (src.device != device and not (device.type == "cuda" and src.is_pinned())):
        raise KernelArgError(f"idx must be on {device}, and src there or in pinned host memory")
    out = torch.empty((idx.shape[0], *src.shape[1:]), dtype=src.dtype, device=device)
    elems = src[0].numel() if src.shape[0] else 0
    if out.numel() == 0:
        return out
    nbytes = elems * src.element_size()
    launch(_gather_kernel, (idx.shape[0], triton.cdiv(nbytes, BLOCK)), (_bytes(src), idx, _bytes(out), nbytes),
           dict(BLOCK=BLOCK), (BLOCK,))
    return out


def _bytes(t: torch.Tensor) -> torch.Tensor:
    """[P, ...] as [P, bytes a page] uint8: the kernel moves bytes whatever the field's type
    (fp8 and int8 codes, fp16 scales)."""
    return t.view(torch.uint8).view(t.shape[0], -1)
