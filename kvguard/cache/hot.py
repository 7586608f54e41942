"""The K/V split's recent reads kept on the device: a ring of page slots a layer (`kv_split.slots`).

A decode step of the split reads the values of the cold pages each row picks, from host memory
over the bus. Most of a step's picks were picked in the steps just before (docs/fidelity.md,
"Where the picks repeat"), so on the kernel path the split keeps the pages it read last in
`slots` device pages a layer, whole (keys copied on the device, values over the bus), taken in
turn as a ring. After the picks, a picked page that a slot holds is read there; the others are
copied, each read over the bus once, into the ring's next slots from its hand that no pick of
this step reads (a page read again keeps its slot that turn, as a clock's second chance); the
decode kernels then read every picked page from the slots, as they read any pool. Everything
runs on the device with shapes that do not depend on the data, so a CUDA graph captures it
(StaticStep). A step whose rows may pick more than half the slots reads in place, as without
slots.

A slot holds a copy of a split page's data; the split page stays where it is. When a split page
is wiped (freed: released, erased, moved back to the device), every slot holding it is zeroed
and forgotten, so no copy outlives the page and a page id used again never finds stale values.
"""

from __future__ import annotations

import torch

from kvguard.kernels.gather import scatter_pages

from .pool import PagePool


class HotValues:
    def __init__(self, pool: PagePool, slots: int, device: torch.device):
        self.slots = slots
        layers = pool.num_layers
        # [L, slots + 1, ...] per field of the split's pool, all on the device; the last slot is
        # where the fixed-size ops put what they must not keep
        self._stacks = {name: torch.zeros((layers, slots + 1, *st.shape[2:]), dtype=st.dtype, device=device)
                        for name, st in pool._stacks.items()}
        self.fields = [{name: st[layer] for name, st in self._stacks.items()} for layer in range(layers)]
        self.nbytes = sum(st[:, :slots].numel() * st.element_size() for st in self._stacks.values())
        self.none = pool.num_pages  # a page id past the pool's: where the ops park what is not a pick
        self.page_slot = torch.full((layers, pool.num_pages + 1), -1, dtype=torch.int32, device=device)
        self.slot_page = torch.full((layers, slots + 1), -1, dtype=torch.int32, device=device)
        self.hand = torch.zeros(layers, dtype=torch.int64, device=device)  # the ring's next slot, a layer
        # made here: a graph's capture copies nothing in
        self._gone = torch.tensor(-1, dtype=torch.int32, device=device)
        self._true = torch.tensor(True, device=device)
        pool.on_wipe.append(self.forget)

    def fits(self, picks: int) -> bool:
        """Whether a step that picks at most `picks` pages a layer can be served: its hits hold
        at most `picks` slots, and as many are left for its copies."""
        return 0 < 2 * picks <= self.slots

    def take(self, layer: int, src: dict[str, torch.Tensor], chosen: torch.Tensor,
             count: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Serve one layer's picks, chosen [B, k] split page ids (row b's first count[b]) from the
        slots, copying in those no slot holds. `src`: the split pool's fields of the layer.
        Returns (the slot of each pick [B, k] int32, for the decode kernels over `fields[layer]`;
        the pages copied over the bus [B, k] int32, each row's first, -1 after; how many [B] int32)."""
        c = self.slots
        b, k = chosen.shape
        dev = chosen.device
        valid = (torch.arange(k, device=dev)[None, :] < count[:, None]) & (chosen >= 0)
        pages = torch.where(valid, chosen.long(), self.none)
        ps, sp, hand = self.page_slot[layer], self.slot_page[layer], self.hand[layer]
        slot = ps[pages].long()  # -1: no slot holds it
        hit = valid & (slot >= 0)
        miss = valid & ~hit
        # the copies take the ring's next slots from the hand that no hit of this step reads
        read = torch.zeros(c + 1, dtype=torch.bool, device=dev).index_put_((torch.where(hit, slot, c),), self._true)
        ring = (hand + torch.arange(c, device=dev)) % c  # the slots in the ring's order
        free = (~read[ring]).cumsum(0)  # free slots up to each place in that order
        at = torch.searchsorted(free, miss.flatten().cumsum(0)).view(b, k)  # the place of each copy's slot
        new = ring[at.clamp(max=c - 1)]
        dst = torch.where(miss, new, c)
        # the pages the copies overwrite are forgotten where the slot was theirs, then the copies noted
        old = sp[dst].long()
        gone = miss & (old >= 0)
        gone &= ps[torch.where(gone, old, self.none)].long() == dst
        ps.index_put_((torch.where(gone, old, self.none),), self._gone)
        ps.index_put_((torch.where(miss, pages, self.none),), torch.where(miss, dst, -1).to(ps.dtype))
        sp.index_put_((dst,), torch.where(miss, pages, -1).to(sp.dtype))
        take, to = torch.where(miss, pages, -1).flatten(), dst.flatten()
        for name, field in src.items():
            scatter_pages(field, take, self.fields[layer][name], to)
        n = miss.sum()
        hand.copy_(torch.where(n > 0, hand + torch.searchsorted(free, n.view(1))[0] + 1, hand) % c)  # past the last
        table = torch.where(hit, slot, torch.where(miss, new, 0)).to(torch.int32)
        # each row's copies first, in pick order (a column past the last takes the rest)
        at = torch.where(miss, miss.cumsum(dim=1) - 1, k)
        fetched = chosen.new_full((b, k + 1), -1).scatter_(1, at, torch.where(miss, chosen, -1))[:, :k]
        return table, fetched, miss.sum(dim=1).to(torch.int32)

    def forget(self, pages: list[int]) -> None:
        """The split pool wiped these pages: zero and forget every slot that holds one."""
        idx = torch.as_tensor(list(pages), dtype=torch.int32, device=self.slot_page.device)
        held = torch.isin(self.slot_page, idx)  # [L, slots + 1]
        self.page_slot[:, idx.long()] = -1
        self.slot_page[held] = -1
        for st in self._stacks.values():
            st[held] = 0
