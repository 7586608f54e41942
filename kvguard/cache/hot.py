"""The K/V split's recent reads kept on the device: a ring of page slots a layer (`kv_split.slots`).

A decode step of the split reads the values of the cold pages each row picks, from host memory
over the bus. Most of a step's picks were picked in the steps just before (docs/fidelity.md,
"Where the picks repeat"), so on the kernel path the split keeps the pages it read last in
`slots` device pages a layer, whole (keys copied on the device, values over the bus; with exact
keys in host memory, those and the values over the bus), taken in
turn as a ring. After the picks, a picked page that a slot holds is read there; the others are
copied, each read over the bus once, into the ring's next slots from its hand that no pick of
this step reads (a page read again keeps its slot that turn, as a clock's second chance); the
decode kernels then read every picked page from the slots, as they read any pool. The
bookkeeping is one program a layer (kernels/slots.py), the copies kernels/gather.py's scatter;
everything runs on the device with shapes that do not depend on the data, so a CUDA graph
captures it (StaticStep). A step whose rows may pick more than half the slots reads in place,
as without slots.

A slot holds a copy of a split page's data; the split page stays where it is. When a split page
is wiped (freed: released, erased, moved back to the device), every slot holding it is zeroed
and forgotten, so no copy outlives the page and a page id used again never finds stale values.
"""

from __future__ import annotations

import torch

from kvguard.kernels._checks import interpreting
from kvguard.kernels.gather import scatter_pages
from kvguard.kernels.slots import take_slots, take_slots_ref

from .pool import PagePool


class HotValues:
    def __init__(self, pool: PagePool, slots: int, device: torch.device, view=None):
        self.slots = slots
        layers = pool.num_layers
        # [L, slots + 1, ...] per field the decode kernels read of the split's pool (`view` of its
        # fields: with exact keys those keys and the values), all on the device; the last slot is
        # where the fixed-size ops put what they must not keep
        read = pool._stacks if view is None else view(pool._stacks)
        self._stacks = {name: torch.zeros((layers, slots + 1, *st.shape[2:]), dtype=st.dtype, device=device)
                        for name, st in read.items()}
        self.fields = [{name: st[layer] for name, st in self._stacks.items()} for layer in range(layers)]
        self.nbytes = sum(st[:, :slots].numel() * st.element_size() for st in self._stacks.values())
        self.none = pool.num_pages  # a page id past the pool's: where the ops park what is not a pick
        self.page_slot = torch.full((layers, pool.num_pages + 1), -1, dtype=torch.int32, device=device)
        self.slot_page = torch.full((layers, slots + 1), -1, dtype=torch.int32, device=device)
        self.hand = torch.zeros(layers, dtype=torch.int64, device=device)  # the ring's next slot, a layer
        # the bookkeeping in one program on the device (kernels/slots.py), as torch ops where no
        # kernel runs (the CPU without Triton's interpreter)
        self.kernel = device.type == "cuda" or interpreting()
        self._scratch = torch.empty(2 * slots + 1, dtype=torch.int32, device=device)
        pool.on_wipe.append(self.forget)

    def fits(self, picks: int) -> bool:
        """Whether a step that picks at most `picks` pages a layer can be served: its hits hold
        at most `picks` slots, and as many are left for its copies."""
        return 0 < 2 * picks <= self.slots

    def take(self, layer: int, src: dict[str, torch.Tensor], chosen: torch.Tensor,
             count: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Serve one layer's picks, chosen [B, k] split page ids (row b's first count[b]) from the
        slots, copying in those no slot holds. `src`: the split pool's fields of the layer
        that the decode kernels read (its view).
        Returns (the slot of each pick [B, k] int32, for the decode kernels over `fields[layer]`;
        the pages copied over the bus [B, k] int32, each row's first, -1 after; how many [B] int32)."""
        state = (self.page_slot[layer], self.slot_page[layer], self.hand[layer])
        if self.kernel:
            table, dst, pages, fetched, moved = take_slots(chosen, count, *state, self._scratch, self.slots)
        else:
            table, dst, pages, fetched, moved = take_slots_ref(chosen, count, *state, self.slots)
        for name, field in src.items():
            scatter_pages(field, pages.flatten(), self.fields[layer][name], dst.flatten())
        return table, fetched, moved

    def forget(self, pages: list[int]) -> None:
        """The split pool wiped these pages: zero and forget every slot that holds one."""
        idx = torch.as_tensor(list(pages), dtype=torch.int32, device=self.slot_page.device)
        held = torch.isin(self.slot_page, idx)  # [L, slots + 1]
        self.page_slot[:, idx.long()] = -1
        self.slot_page[held] = -1
        for st in self._stacks.values():
            st[held] = 0
