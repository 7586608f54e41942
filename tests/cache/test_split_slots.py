"""The K/V split's recent reads in device slots (kv_split.slots, kvguard/cache/hot.py)."""

from __future__ import annotations

import pytest
import torch

from kvguard.cache import CacheConfig, CacheManager
from kvguard.cache import events as ev
from kvguard.cache.hot import HotValues
from kvguard.cache.pool import PagePool
from kvguard.cache.tiers import CpuTier
from kvguard.compress.codecs import make_codec
from kvguard.errors import ConfigError
from kvguard.policy.schema import split_key
from kvguard.types import Subject

L, H, HQ, KD, KS = 2, 2, 6, 32, 16  # layers, KV heads, query heads, head dim, page size


def cache(rule: dict, codec: str = "int8", lengths=(200, 120)):
    m = CacheManager(CacheConfig(num_layers=L, num_kv_heads=H, head_dim=KD, num_query_heads=HQ, page_size=KS,
                                 num_pages=64, dtype=torch.float16, codec=codec, fp_sink=0, fp_window=16,
                                 use_kernels=True, kv_split={"window": 32, **rule}), tiers={"cpu": CpuTier()})
    g = torch.Generator().manual_seed(31)
    rows = []
    for i, n in enumerate(lengths):
        seq = m.open(Subject("acme", f"u{i}", f"s{i}"))
        k, v = torch.randn(L, n, H, KD, generator=g), torch.randn(L, n, H, KD, generator=g)
        k[:, 17::23] *= 3  # some pages matter more than others: the picks repeat
        for layer in range(L):
            assert m.append(seq, layer, k[layer].half(), v[layer].half())
        rows.append(seq)
        assert m.split_cold(seq) > 0
    m.events.take_events()
    return m, rows


def fetches(m: CacheManager) -> list[tuple]:
    m.split.drain()
    return [(e.seq, sorted(e.pages), e.bytes) for e in m.events.take_events() if isinstance(e, ev.PagesFetched)]


@pytest.mark.parametrize("codec,rule", [("int8", {"top_k": 3}), ("fp16", {"top_k": 2}),
                                        ("int8", {"top_k": 3, "keys": "int4"}), ("int8", {"fraction": 0.25}),
                                        ("int8", {"top_k": 3, "keys": "int4", "host_keys": True}),
                                        ("int8", {"mass": 0.02, "top_k": 3})])
def test_slots_give_the_same_answer_and_read_less_over_the_bus(codec, rule):
    """Steps with slots answer as steps without, bit for bit; each step's fetch names only pages
    no slot held (a subset of what it picked), and over the steps fewer bytes cross the bus."""
    (a, arows), (b, brows) = cache(rule, codec), cache(rule | {"slots": 24}, codec)
    assert b.split.hot is not None and a.split.hot is None
    g = torch.Generator().manual_seed(32)
    without = with_slots = 0
    for step in range(4):
        k, v = torch.randn(L, 2, H, KD, generator=g).half(), torch.randn(L, 2, H, KD, generator=g).half()
        q = torch.randn(L, 2, HQ, KD, generator=g).half()
        for layer in range(L):
            for m, rows in ((a, arows), (b, brows)):
                m.append_step(rows, layer, k[layer], v[layer])
            torch.testing.assert_close(b.attend_step(brows, layer, q[layer]), a.attend_step(arows, layer, q[layer]),
                                       rtol=0, atol=0)
        fa, fb = fetches(a), fetches(b)
        by_seq = {s: set(p) for s, p, _ in fa}
        assert all(set(p) <= by_seq[s] for s, p, _ in fb)
        if step == 0:
            assert fb == fa  # nothing held yet
        without += sum(n for *_, n in fa)
        with_slots += sum(n for *_, n in fb)
    assert with_slots < without
    assert b.stats().bytes_on_device == a.stats().bytes_on_device + b.split.hot.nbytes


def test_a_page_held_in_a_slot_is_read_there_not_over_the_bus():
    """After a step copies its picks into slots, poisoning the host's copy of every split value
    changes nothing for the same query; a cache without slots reads the poison."""
    m, rows = cache({"top_k": 2, "slots": 16})
    q = torch.randn(2, HQ, KD, generator=torch.Generator().manual_seed(3)).half()
    before = m.attend_step(rows, 0, q)
    m.pools["split"]._stacks["v"][:] = 127
    torch.testing.assert_close(m.attend_step(rows, 0, q), before, rtol=0, atol=0)
    m.free(rows[0])
    m.free(rows[1])
    fetched = [e for e in m.events.take_events() if isinstance(e, ev.PagesFetched)]
    assert len(fetched) == 2  # the first read's two rows; the second read copied nothing
    n, nrows = cache({"top_k": 2})
    n.pools["split"]._stacks["v"][:] = 127
    assert not torch.equal(n.attend_step(nrows, 0, q), before)


def test_freed_and_erased_pages_leave_no_copy_in_a_slot():
    """A sequence freed, and a user erased: every slot that held one of their split pages is
    zeroed and forgotten, the other row's slots stay."""
    m, rows = cache({"top_k": 3, "slots": 16})
    q = torch.randn(L, 2, HQ, KD, generator=torch.Generator().manual_seed(4)).half()
    for layer in range(L):
        m.attend_step(rows, layer, q[layer])
    hot = m.split.hot

    def held(seq):
        pages = {int(r.page) for r in m.seqs.get(seq).pages if r.where == "split"}
        return int(torch.isin(hot.slot_page, torch.tensor(sorted(pages), dtype=torch.int32)).sum())
    assert held(rows[0]) > 0 and held(rows[1]) > 0
    m.free(rows[0])
    assert (hot.slot_page >= 0).sum() == held(rows[1]) > 0
    event = m.erase_user("acme", "u1")
    assert event.tier_copies == 0 and m.pools["split"].used_count == 0
    assert (hot.slot_page == -1).all() and (hot.page_slot == -1).all()
    assert all(not st.view(torch.uint8).any() for st in hot._stacks.values())


def test_the_ring_serves_every_pick_from_a_slot_holding_that_page():
    """Many steps of random picks, some repeating, over a small ring: each pick's slot holds
    its page's data after the step; a page is copied only if no slot held it; the two maps
    agree."""
    codec = make_codec("int8")
    pool = PagePool(codec, num_pages=40, num_layers=1, num_kv_heads=H, head_dim=KD, page_size=KS,
                    dtype=torch.float16, device=torch.device("cpu"))
    g = torch.Generator().manual_seed(5)
    for st in pool._stacks.values():
        st.copy_(torch.randint(-100, 100, st.shape, generator=g).to(st.dtype))
    b, k, ring = 2, 3, 12
    hot = HotValues(pool, ring, torch.device("cpu"))
    src = pool.fields[0]
    copied = picked = 0
    for _ in range(80):
        count = torch.randint(0, k + 1, (b,), generator=g, dtype=torch.int32)
        chosen = torch.randperm(24, generator=g)[:b * k].view(b, k).to(torch.int32)  # 24 pages: picks repeat
        held = {int(p) for p in hot.slot_page[0, :ring].tolist() if p >= 0}
        table, fetched, moved = hot.take(0, src, chosen, count)
        for r in range(b):
            picks = chosen[r, :int(count[r])].tolist()
            for c, p in enumerate(picks):
                for name in src:
                    assert torch.equal(hot.fields[0][name][int(table[r, c])], src[name][p])
            got = fetched[r, :int(moved[r])].tolist()
            assert fetched[r, int(moved[r]):].eq(-1).all()
            assert set(got) == {p for p in picks if p not in held}
        copied += int(moved.sum())
        picked += int(count.sum())
        for p in range(hot.none):
            s = int(hot.page_slot[0, p])
            assert s == -1 or int(hot.slot_page[0, s]) == p
    assert 0 < copied < picked


def test_config_and_policy_name_the_slots():
    with pytest.raises(ConfigError, match="slots"):
        CacheConfig(num_layers=1, num_kv_heads=1, head_dim=8, kv_split={"top_k": 2, "slots": 1})
    assert split_key({"top_k": 8, "window": 256, "slots": 600}) == "kvsplit@8p/w256/slots600"
    ref = CacheManager(CacheConfig(num_layers=1, num_kv_heads=1, head_dim=8, num_pages=8, use_kernels=False,
                                   kv_split={"top_k": 2, "slots": 4}), tiers={"cpu": CpuTier()})
    assert ref.split.hot is None  # the reference path copies its picks in every read: no slots
