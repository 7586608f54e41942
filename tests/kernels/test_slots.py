"""kernels/slots.py: the K/V split's slot bookkeeping in one program, against its torch ops."""

from __future__ import annotations

import pytest
import torch
from kvguard.kernels._checks import KernelArgError
from kvguard.kernels.slots import take_slots, take_slots_ref

from .conftest import DEVICE


def state(pages: int, slots: int):
    return (torch.full((pages + 1,), -1, dtype=torch.int32, device=DEVICE),
            torch.full((slots + 1,), -1, dtype=torch.int32, device=DEVICE),
            torch.zeros((), dtype=torch.int64, device=DEVICE))


@pytest.mark.parametrize("b,k,slots", [(1, 3, 6), (2, 3, 12), (3, 5, 40), (4, 16, 128)])
def test_one_program_keeps_the_ring_as_the_torch_ops_do(b, k, slots):
    """Steps of random picks (unique within a step, some repeating across steps, rows with
    fewer picks than k): every output and the maps and hand after each step are the torch ops'."""
    g = torch.Generator().manual_seed(b * 100 + k)
    pages = 3 * b * k
    ref, got = state(pages, slots), state(pages, slots)
    scratch = torch.empty(2 * slots + 1, dtype=torch.int32, device=DEVICE)
    copies = 0
    for _ in range(40):
        chosen = torch.randperm(pages, generator=g)[:b * k].view(b, k).to(torch.int32)
        chosen[torch.rand(b, k, generator=g) < 0.1] = -1  # a pick with no page: never read
        count = torch.randint(0, k + 1, (b,), generator=g, dtype=torch.int32)
        chosen, count = chosen.to(DEVICE), count.to(DEVICE)
        want = take_slots_ref(chosen, count, *ref, slots)
        have = take_slots(chosen, count, *got, scratch, slots)
        for w, h, name in zip(want, have, ("table", "dst", "take", "fetched", "moved"), strict=True):
            assert torch.equal(w.cpu(), h.cpu()), name
        for w, h in zip(ref, got, strict=True):
            assert torch.equal(w.cpu(), h.cpu())
        copies += int(want[4].sum())
    assert copies > 0 and (ref[0][:-1] >= 0).any()


def test_bad_arguments_are_refused():
    ps, sp, hand = state(8, 4)
    chosen = torch.zeros(1, 2, dtype=torch.int32, device=DEVICE)
    count = torch.ones(1, dtype=torch.int32, device=DEVICE)
    scratch = torch.empty(9, dtype=torch.int32, device=DEVICE)
    with pytest.raises(KernelArgError, match="scratch"):
        take_slots(chosen, count, ps, sp, hand, scratch[:8], 4)
    with pytest.raises(KernelArgError, match="chosen"):
        take_slots(chosen.long(), count, ps, sp, hand, scratch, 4)
    with pytest.raises(KernelArgError, match="slot_page"):
        take_slots(chosen, count, ps, sp[:4], hand, scratch, 4)
    with pytest.raises(KernelArgError, match="hand"):
        take_slots(chosen, count, ps, sp, hand.int(), scratch, 4)
