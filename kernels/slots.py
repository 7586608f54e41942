"""Which device slot serves each page a K/V split step picked: the ring's bookkeeping in one program.

The K/V split keeps the pages it read last in a ring of device page slots a layer
(kvguard/cache/hot.py). A step's picks [B, k] (row b's first count[b]) each either find their
page in a slot (`page_slot[page]`) or are copied into the ring's next slots from its hand that
no pick of this step reads; the maps page -> slot and slot -> page and the hand are updated
for the copies. Written as torch ops (`take_slots_ref`) that is some sixty small kernels a layer,
each a few microseconds in a CUDA graph; `take_slots` does it in one program: the picks a
[B, k] tile, the ring a vector, what one part writes and another reads passed through a scratch
buffer between barriers. The copies themselves are kernels/gather.py's `scatter_pages`.

Both return (slot of each pick [B, k] int32; where each copy goes [B, k] int32, `c` for no copy;
the page each copy reads [B, k] int32, -1 for none; the pages copied, each row's first, -1 after,
[B, k] int32; how many a row [B] int32). With the same page missed by two rows in one step both
are copied, to two slots, and which of them the page's map names is unspecified.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._checks import KernelArgError, check_device
from ._launch import launch


@triton.jit
def _slots_kernel(chosen, count, ps, sp, hand_p, scratch, table, dst, take, fetched, moved, b, k, c, none,
                  BP: tl.constexpr, KP: tl.constexpr, CP: tl.constexpr):
    r = tl.arange(0, BP)[:, None]
    col = tl.arange(0, KP)[None, :]
    inb = (r < b) & (col < k)
    idx = r * k + col
    cnt = tl.load(count + r, mask=r < b, other=0)
    page = tl.load(chosen + idx, mask=inb, other=-1)
    valid = inb & (col < cnt) & (page >= 0)
    page = tl.where(valid, page, none)
    slot = tl.load(ps + page, mask=inb, other=-1)  # -1: no slot holds it (ps[none] is -1)
    hit = valid & (slot >= 0)
    miss = valid & (slot < 0)
    hand = tl.load(hand_p)
    # the slots this step's hits read, flagged in the scratch's first c words
    j = tl.arange(0, CP)
    tl.store(scratch + j, tl.zeros([CP], tl.int32), mask=j < c)
    tl.debug_barrier()
    tl.store(scratch + tl.where(hit, slot, 0), tl.full([BP, KP], 1, tl.int32), mask=hit)
    tl.debug_barrier()
    # the other slots in the ring's order from the hand; the n-th of them (its rank) after c + 1
    ring = ((hand + j) % c).to(tl.int32)
    free = (j < c) & (tl.load(scratch + ring, mask=j < c, other=1) == 0)
    rank = tl.cumsum(free.to(tl.int32), 0)
    tl.store(scratch + c + rank, ring, mask=free)
    tl.debug_barrier()
    # each copy takes the free slot of its rank among the step's copies, in row-major order
    mi = miss.to(tl.int32)
    row_n = tl.sum(mi, 1)
    row_rank = tl.cumsum(mi, 1)
    nth = (tl.cumsum(row_n, 0) - row_n)[:, None] + row_rank
    new = tl.load(scratch + c + nth, mask=miss, other=0)
    d = tl.where(miss, new, c)
    # the pages the copies overwrite are forgotten where the slot was theirs, then the copies noted
    old = tl.load(sp + d, mask=miss, other=-1)
    gone = miss & (old >= 0)
    old = tl.where(gone, old, none)
    gone = gone & (tl.load(ps + old, mask=gone, other=-1) == d)
    tl.debug_barrier()
    tl.store(ps + old, tl.full([BP, KP], -1, tl.int32), mask=gone)
    tl.debug_barrier()
    tl.store(ps + page, d, mask=miss)
    tl.store(sp + d, page, mask=miss)
    n = tl.sum(row_n, 0)
    last = tl.max(tl.where(free & (rank == n), j, -1), 0)  # the ring's place of the last copy
    tl.store(hand_p, tl.where(n > 0, (hand + last + 1) % c, hand))
    tl.store(table + idx, tl.where(hit, slot, tl.where(miss, new, 0)), mask=inb)
    tl.store(dst + idx, d, mask=inb)
    tl.store(take + idx, tl.where(miss, page, -1), mask=inb)
    tl.store(fetched + idx, tl.full([BP, KP], -1, tl.int32), mask=inb)
    tl.debug_barrier()
    tl.store(fetched + r * k + row_rank - 1, page, mask=miss)
    rows = tl.arange(0, BP)
    tl.store(moved + rows, row_n, mask=rows < b)


def _check(chosen, count, page_slot, slot_page, hand, slots):
    if chosen.dim() != 2 or chosen.dtype != torch.int32 or not chosen.is_contiguous():
        raise KernelArgError("chosen must be [B, k] int32, contiguous")
    b = chosen.shape[0]
    if count.shape != (b,) or count.dtype != torch.int32:
        raise KernelArgError(f"count must be [{b}] int32")
    if (page_slot.dim() != 1 or slot_page.dim() != 1 or page_slot.dtype != torch.int32
            or slot_page.dtype != torch.int32 or slot_page.shape[0] != slots + 1 or slots < 2):
        raise KernelArgError("page_slot must be [pages + 1] int32 and slot_page [slots + 1] int32, slots >= 2")
    if hand.shape != () or hand.dtype != torch.int64:
        raise KernelArgError("hand must be a 0-d int64 tensor")


def take_slots(chosen: torch.Tensor, count: torch.Tensor, page_slot: torch.Tensor, slot_page: torch.Tensor,
               hand: torch.Tensor, scratch: torch.Tensor, slots: int):
    """The ring's bookkeeping for one step's picks (module doc), in one program; updates
    page_slot [pages + 1] (its last entry -1, for no page), slot_page [slots + 1] (its last entry
    for no slot) and hand (0-d int64) in place. scratch: int32, at least 2 * slots + 1 words."""
    check_device(chosen, count, page_slot, slot_page, hand, scratch)
    _check(chosen, count, page_slot, slot_page, hand, slots)
    if scratch.dtype != torch.int32 or scratch.numel() < 2 * slots + 1 or not scratch.is_contiguous():
        raise KernelArgError(f"scratch must be int32 with at least {2 * slots + 1} words")
    b, k = chosen.shape
    out = [torch.empty(b, k, dtype=torch.int32, device=chosen.device) for _ in range(4)]
    moved = torch.empty(b, dtype=torch.int32, device=chosen.device)
    if b == 0 or k == 0:
        moved.zero_()
        return (*out, moved)
    consts = dict(BP=triton.next_power_of_2(b), KP=triton.next_power_of_2(k), CP=triton.next_power_of_2(slots),
                  num_warps=8)
    launch(_slots_kernel, (1,), (chosen, count, page_slot, slot_page, hand, scratch, *out, moved, b, k, slots,
                                 page_slot.shape[0] - 1), consts, tuple(sorted(consts.items())))
    return (*out, moved)


def take_slots_ref(chosen: torch.Tensor, count: torch.Tensor, page_slot: torch.Tensor, slot_page: torch.Tensor,
                   hand: torch.Tensor, slots: int):
    """take_slots as torch ops (any device, no interpreter)."""
    _check(chosen, count, page_slot, slot_page, hand, slots)
    c, none = slots, page_slot.shape[0] - 1
    b, k = chosen.shape
    dev = chosen.device
    valid = (torch.arange(k, device=dev)[None, :] < count[:, None]) & (chosen >= 0)
    pages = torch.where(valid, chosen.long(), none)
    ps, sp = page_slot, slot_page
    slot = ps[pages].long()
    hit = valid & (slot >= 0)
    miss = valid & ~hit
    read = torch.zeros(c + 1, dtype=torch.bool, device=dev)
    read[torch.where(hit, slot, c)] = True
    ring = (hand + torch.arange(c, device=dev)) % c
    free = (~read[ring]).cumsum(0)
    new = ring[torch.searchsorted(free, miss.flatten().cumsum(0)).view(b, k).clamp(max=c - 1)]
    dst = torch.where(miss, new, c)
    old = sp[dst].long()
    gone = miss & (old >= 0)
    gone &= ps[torch.where(gone, old, none)].long() == dst
    ps[torch.where(gone, old, none)] = -1
    ps[torch.where(miss, pages, none)] = torch.where(miss, dst, -1).to(ps.dtype)
    sp[dst] = torch.where(miss, pages, -1).to(sp.dtype)
    n = miss.sum()
    hand.copy_(torch.where(n > 0, hand + torch.searchsorted(free, n.view(1))[0] + 1, hand) % c)
    table = torch.where(hit, slot, torch.where(miss, new, 0)).to(torch.int32)
    at = torch.where(miss, miss.cumsum(dim=1) - 1, k)
    fetched = chosen.new_full((b, k + 1), -1).scatter_(1, at, torch.where(miss, chosen, -1))[:, :k]
    take = torch.where(miss, pages, -1).to(torch.int32)
    return table, dst.to(torch.int32), take, fetched.to(torch.int32), miss.sum(dim=1).to(torch.int32)
