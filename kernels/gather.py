"""Gather whole pages of one field into a dense buffer, or scatter some into slots, on the device.

The K/V split (kvguard/cache/split.py) keeps cold pages' values in pinned host memory, which is
mapped into the device's address space. A prefill chunk's queries together read many of those
pages, most of them many times; gathering the pages they read once into device memory (one read
of each over the bus) lets the attention kernels read them there. torch cannot index a host
tensor from the device, so this kernel does: one program a page and block of its elements. The split's decode keeps the pages it
read last in device slots (kvguard/cache/hot.py): `scatter_pages` copies a step's new picks into
theirs, reading nothing for the picks a slot already holds.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._checks import KernelArgError
from ._launch import launch

BLOCK = 1024


@triton.jit
def _gather_kernel(src, idx, dst, didx, page_elems, BLOCK: tl.constexpr, SCATTER: tl.constexpr = False):
    # dst[p] = src[idx[p]]; SCATTER: dst[didx[p]] = src[idx[p]] where idx[p] >= 0 (nothing read else)
    p = tl.program_id(0)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < page_elems
    page = tl.load(idx + p).to(tl.int64)
    to = p.to(tl.int64)
    if SCATTER:
        ok = ok & (page >= 0)
        to = tl.load(didx + p).to(tl.int64)
    x = tl.load(src + page * page_elems + offs, mask=ok)
    tl.store(dst + to * page_elems + offs, x, mask=ok)


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
    launch(_gather_kernel, (idx.shape[0], triton.cdiv(nbytes, BLOCK)), (_bytes(src), idx, _bytes(out), idx, nbytes),
           dict(BLOCK=BLOCK), (BLOCK,))
    return out


def scatter_pages(src: torch.Tensor, idx: torch.Tensor, dst: torch.Tensor, didx: torch.Tensor) -> None:
    """dst[didx[i]] = src[idx[i]] for every i with idx[i] >= 0; a negative idx[i] reads nothing
    (a fixed-size call, as a CUDA graph needs, that copies only some pages). src [P, ...]
    contiguous (on the device, or in pinned host memory when the device is CUDA), dst [Q, ...]
    contiguous on the device, of src's dtype and page shape; idx, didx [n] int32/int64 on the
    device, didx[i] < Q where idx[i] >= 0 (unchecked: reading it would wait for the device)."""
    dev = dst.device
    if (not src.is_contiguous() or not dst.is_contiguous() or src.dtype != dst.dtype or src.shape[1:] != dst.shape[1:]
            or idx.dim() != 1 or idx.shape != didx.shape
            or idx.dtype not in (torch.int32, torch.int64) or didx.dtype not in (torch.int32, torch.int64)):
        raise KernelArgError("scatter_pages takes contiguous src [P, ...] and dst [Q, ...] of one dtype and page "
                             "shape, and idx, didx [n] int32 or int64")
    # (whether host memory is pinned is a driver query: asked outside a CUDA graph's capture, whose
    # eager first run checks the same tensors)
    if idx.device != dev or didx.device != dev or (src.device != dev and not (dev.type == "cuda" and (
            torch.cuda.is_current_stream_capturing() or src.is_pinned()))):
        raise KernelArgError(f"idx, didx must be on {dev}, and src there or in pinned host memory")
    nbytes = src[0].numel() * src.element_size() if src.shape[0] else 0
    if idx.numel() == 0 or nbytes == 0:
        return
    launch(_gather_kernel, (idx.shape[0], triton.cdiv(nbytes, BLOCK)), (_bytes(src), idx, _bytes(dst), didx, nbytes),
           dict(BLOCK=BLOCK, SCATTER=True), (BLOCK, True))


def _bytes(t: torch.Tensor) -> torch.Tensor:
    """[P, ...] as [P, bytes a page] uint8: the kernel moves bytes whatever the field's type
    (fp8 and int8 codes, fp16 scales)."""
    return t.view(torch.uint8).view(t.shape[0], -1)
