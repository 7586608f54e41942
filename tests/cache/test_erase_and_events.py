"""Erasure overwrites what it frees; every operation emits exactly its events."""

from __future__ import annotations

import pytest
import redis
import torch

from kvguard.cache import CacheConfig, CacheManager
from kvguard.cache.tiers import CpuTier, DiskTier, RedisTier
from kvguard.errors import TierError
from kvguard.types import Subject
from tests.conftest import outlier_kv


def make(codec="int8", tiers=None, **kw):
    cfg = CacheConfig(num_layers=2, num_kv_heads=2, head_dim=64, num_query_heads=4, num_pages=32, codec=codec,
                      fp_sink=4, **kw)
    return CacheManager(cfg, tiers=tiers)


def write(m, seq, n, seed=0):
    k, v = outlier_kv(n, 2, 64, seed=seed)
    for layer in range(2):
        assert m.append(seq, layer, k, v)
    return k, v


def pool_bytes(m):
    return {name: [t.clone() for layer in p.fields for t in layer.values()] for name, p in m.pools.items()}


@pytest.mark.parametrize("codec", ["fp16", "int8", "int4"])
def test_erase_user_overwrites_freed_pages_and_spares_others(codec, alice, bob):
    m = make(codec)
    a1, a2 = m.open(alice), m.open(Subject("acme", "alice", "s-9"))
    b = m.open(bob)
    write(m, a1, 70, 1)
    write(m, a2, 20, 2)
    kb, vb = write(m, b, 50, 3)
    before_b = [t.clone() for t in m.kv(b, 1)]
    alice_pages = {(r.where, int(r.page)) for s in (a1, a2) for r in m._seq(s).pages}
    m.events.take_events()
    event = m.erase_user("acme", "alice")
    assert event.op == "erase" and event.sequences == 2 and event.scope == "user"
    assert sorted(event.pages) == sorted(f"{w}:{p}" for w, p in alice_pages)
    # every field of every freed page reads back as zeros
    for where, page in alice_pages:
        for layer in m.pools[where].fields:
            for t in layer.values():
                assert not t[page].view(torch.uint8).any()
    assert m.sequences() == [b]
    after_b = m.kv(b, 1)
    assert all(torch.equal(x, y) for x, y in zip(before_b, after_b))
    assert [e.op for e in m.events.take_events()] == ["erase"]


def test_erase_session_only_that_session(alice):
    m = make()
    s1 = m.open(alice)
    s2 = m.open(Subject("acme", "alice", "other"))
    write(m, s1, 30)
    write(m, s2, 30)
    m.erase_session("acme", "s-1")
    assert m.sequences() == [s2]


def test_shared_prefix_page_loses_owner_and_index_entry(alice, bob):
    m = make("fp16")
    prompt = list(range(40))
    a = m.open(alice, tokens=prompt)
    assert m.length(a) == 0
    write(m, a, 40)
    assert m.publish_prefix(a, prompt) == 2
    b = m.open(bob, tokens=prompt)
    assert m.length(b) == 32  # two full pages reused
    shared = [int(r.page) for r in m._seq(b).pages]
    assert all(m.pools["hot"].ref[p] == 2 for p in shared)
    event = m.erase_user("acme", "alice")
    assert event.shared_pages == 2 and event.prefix_entries == 2
    for p in shared:
        assert m.pools["hot"].owners[p] == {bob: 1}
    assert m.length(m.open(Subject("acme", "carol", "x"), tokens=prompt)) == 0


def test_prefix_is_salted_per_tenant(alice):
    m = make("fp16")
    prompt = list(range(32))
    a = m.open(alice, tokens=prompt)
    write(m, a, 32)
    m.publish_prefix(a, prompt)
    assert m.length(m.open(Subject("acme", "dave", "d"), tokens=prompt)) == 32
    assert m.length(m.open(Subject("other-tenant", "eve", "e"), tokens=prompt)) == 0


TIERS = [
    pytest.param(lambda tmp: CpuTier(), id="cpu"),
    pytest.param(lambda tmp: DiskTier(tmp / "pages"), id="disk"),
    pytest.param(lambda tmp: RedisTier(redis.Redis(host="127.0.0.1", port=6379),
                                       prefix=f"kvguard-test:{tmp.name}:"), id="redis"),
]


@pytest.mark.parametrize("factory", TIERS)
def test_offload_fetch_and_erase_in_tier(factory, tmp_path, alice):
    tier = factory(tmp_path)
    m = make("int8", fp_window=16, tiers={tier.name: tier})
    seq = m.open(alice)
    write(m, seq, 70)
    before = [t.clone() for t in m.kv(seq, 1)]
    m.events.take_events()
    moved = m.offload(seq, tier.name, max_pages=2)
    assert moved == 2 and len(tier.keys()) == 2
    assert m.stats().pages_offloaded == {tier.name: 2}
    after = m.kv(seq, 1)  # fetches back
    assert all(torch.equal(x, y) for x, y in zip(before, after))
    assert tier.keys() == []
    off, fetch = m.events.take_events()
    assert (off.op, fetch.op) == ("offload", "fetch")
    # both count the device pages' bytes; the offload also what the tier holds for them
    assert off.bytes == fetch.bytes == sum(m.pools[p.split(":")[0]].page_bytes for p in off.pages)
    assert off.stored_bytes > 0 and "stored_bytes" in off.details()
    m.offload(seq, tier.name, max_pages=3)
    event = m.erase_user("acme", "alice")
    assert event.tier_copies == 3 and tier.keys() == []
    seq = m.open(alice)
    write(m, seq, 70)
    m.offload(seq, tier.name, max_pages=2)
    m.events.take_events()
    m.free(seq)
    (freed,) = m.events.take_events()
    assert freed.op == "free" and freed.tier_copies == 2 and tier.keys() == []
    assert freed.bytes == sum(m.pools[p.split(":")[0]].page_bytes for p in freed.pages) > 0


def test_each_operation_emits_exactly_its_events(alice):
    m = make("int8", evictor="h2o", evictor_options={"budget": 32, "sink": 4, "window": 8}, auto_compact=False,
             tiers={"cpu": CpuTier()})
    seq = m.open(alice)
    assert m.events.take_events() == []
    write(m, seq, 15)  # no page full yet
    assert m.events.take_events() == []
    write(m, seq, 40)  # pages 1 and 2 fill (page 0 holds the sinks)
    evs = m.events.take_events()
    assert [e.op for e in evs] == ["quantize"]
    assert evs[0].pages == ("main:0", "main:1") and evs[0].n_tokens == 32 and evs[0].codec == "int8"
    assert evs[0].bytes < evs[0].bytes_before
    m.attend(seq, 0, torch.randn(1, 4, 64).half())
    assert m.events.take_events() == []
    used = {name: p.used_count for name, p in m.pools.items()}
    ev = m.compact(seq)
    evs = m.events.take_events()
    assert [e.op for e in evs] == ["quantize", "evict"] and ev.n_tokens == 55 - 32  # survivors re-encoded
    assert len(evs[0].pages) == 1 and evs[0].pages[0].startswith("main:") and evs[0].pages[0] not in ev.pages
    freed = sum(used.values()) - sum(p.used_count for p in m.pools.values()) + 2  # + the 2 pages written
    assert len(ev.pages) == freed and ev.bytes == sum(m.pools[p.split(":")[0]].page_bytes for p in ev.pages)
    assert m.compact(seq) is None and m.events.take_events() == []
    m.offload(seq, "cpu", max_pages=1)
    m.kv(seq, 0)
    assert [e.op for e in m.events.take_events()] == ["offload", "fetch"]
    m.free(seq)
    assert [e.op for e in m.events.take_events()] == ["free"]
    # details never carry the subject
    assert "subject" not in ev.details() and "alice" not in repr(ev)


def free_pages(m):
    return sum(p.free_count for p in m.pools.values())


class FlakyTier(CpuTier):
    """A CPU tier whose reads or erasures fail while `broken` names them."""

    def __init__(self):
        super().__init__()
        self.broken: set[str] = set()
        self.puts_left: int | None = None

    def put(self, key, blob):
        if "put" in self.broken:  # stored, but the reply is lost
            super().put(key, blob)
            raise ConnectionError("tier reply lost")
        if self.puts_left is not None:
            if self.puts_left == 0:
                raise ConnectionError("tier full")
            self.puts_left -= 1
        return super().put(key, blob)

    def get(self, key):
        if "get" in self.broken:
            raise ConnectionError("tier unreachable")
        return super().get(key)

    def erase(self, key):
        if "erase" in self.broken:  # overwritten, then the removal fails
            for t in self._pages.get(key, {}).values():
                t.zero_()
            raise ConnectionError("tier unreachable")
        super().erase(key)


def offloaded(alice):
    """A sequence of 70 tokens with 3 pages offloaded to a FlakyTier, and what it reads before."""
    tier = FlakyTier()
    m = make("int8", fp_window=16, tiers={"cpu": tier})
    seq = m.open(alice)
    write(m, seq, 70)
    before = [t.clone() for t in m.kv(seq, 1)]
    assert m.offload(seq, "cpu", max_pages=3) == 3
    return tier, m, seq, before


def test_a_failed_tier_read_leaks_no_page_and_loses_no_copy(alice):
    # the tier fails mid-fetch: no device page stays taken for the copies not brought back, and
    # the sequence still points at them, so a later fetch (or an erasure) finds them
    tier, m, seq, before = offloaded(alice)
    free = free_pages(m)
    tier.broken = {"get"}
    with pytest.raises(ConnectionError):
        m.kv(seq, 1)
    assert free_pages(m) == free and len(tier.keys()) == 3
    assert m.stats().pages_offloaded == {"cpu": 3}
    tier.broken = set()
    assert all(torch.equal(x, y) for x, y in zip(before, m.kv(seq, 1)))
    assert tier.keys() == [] and free_pages(m) == free - 3
    m.free(seq)
    assert all(p.free_count == p.num_pages for p in m.pools.values())


def test_a_copy_that_cannot_be_erased_after_its_fetch_is_erased_with_the_sequence(alice):
    # the tier overwrites a copy, then fails to remove it (a disk or Redis erase is two steps):
    # the page fetched back is its home now, and the copy left behind goes with the sequence
    tier, m, seq, before = offloaded(alice)
    tier.broken = {"erase"}
    assert all(torch.equal(x, y) for x, y in zip(before, m.kv(seq, 1)))
    assert m.stats().pages_offloaded == {} and len(tier.keys()) == 3
    with pytest.raises(TierError, match="3 of 3"):
        m.free(seq)
    assert m.length(seq) == 70  # nothing released: free again later
    tier.broken = set()
    m.free(seq)
    assert tier.keys() == [] and all(p.free_count == p.num_pages for p in m.pools.values())


def test_an_erasure_the_tier_refuses_releases_nothing_and_can_run_again(alice, bob):
    tier = FlakyTier()
    m = make("int8", fp_window=16, tiers={"cpu": tier})
    a1, a2, b = m.open(alice), m.open(Subject("acme", "alice", "s-9")), m.open(bob)
    for i, seq in enumerate((a1, a2, b)):
        write(m, seq, 40, seed=i)
    assert m.offload(a2, "cpu", max_pages=2) == 2 and m.offload(b, "cpu", max_pages=1) == 1
    m.events.take_events()
    held = free_pages(m)
    tier.broken = {"erase"}
    with pytest.raises(TierError):
        m.erase_user("acme", "alice")
    assert m.events.take_events() == [] and free_pages(m) == held
    assert set(m.sequences()) == {a1, a2, b}
    tier.broken = set()
    event = m.erase_user("acme", "alice")
    assert event.sequences == 2 and event.tier_copies == 2 and len(tier.keys()) == 1
    assert set(m.sequences()) == {b}


def test_an_offload_that_fails_midway_records_the_pages_it_moved(alice):
    tier = FlakyTier()
    m = make("int8", fp_window=16, tiers={"cpu": tier})
    seq = m.open(alice)
    write(m, seq, 70)
    before = [t.clone() for t in m.kv(seq, 1)]
    m.events.take_events()
    free = free_pages(m)
    tier.puts_left = 2
    with pytest.raises(ConnectionError):
        m.offload(seq, "cpu")
    (event,) = m.events.take_events()
    assert event.op == "offload" and len(event.pages) == 2 and len(tier.keys()) == 2
    assert free_pages(m) == free + 2 and m.stats().pages_offloaded == {"cpu": 2}
    assert all(torch.equal(x, y) for x, y in zip(before, m.kv(seq, 1)))


def test_a_disk_page_that_cannot_be_written_leaves_nothing(tmp_path, monkeypatch):
    tier = DiskTier(tmp_path / "pages")

    def full(fd):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr("os.fsync", full)
    with pytest.raises(OSError):
        tier.put("s-1", {"0.k": torch.ones(4096, dtype=torch.uint8)})
    monkeypatch.undo()
    assert list((tmp_path / "pages").iterdir()) == []


def test_a_copy_stored_by_a_put_that_failed_is_erased_with_its_subject(alice):
    tier = FlakyTier()
    m = make("int8", fp_window=16, tiers={"cpu": tier})
    seq = m.open(alice)
    write(m, seq, 70)
    tier.broken = {"put"}
    with pytest.raises(ConnectionError):
        m.offload(seq, "cpu", max_pages=1)
    tier.broken = {"put", "erase"}  # not even the cleanup gets through: the key is kept
    with pytest.raises(ConnectionError):
        m.offload(seq, "cpu", max_pages=1)
    assert len(tier.keys()) == 1 and m.stats().pages_offloaded == {}
    tier.broken = set()
    assert m.erase_user("acme", "alice").tier_copies == 1 and tier.keys() == []


def test_attention_mass_is_zeroed_when_its_sequence_goes(alice, bob):
    m = make("int8", evictor="h2o", evictor_options={"budget": 32, "sink": 4, "window": 8}, auto_compact=False)
    a, b = m.open(alice), m.open(bob)
    for seq in (a, b):
        write(m, seq, 40)
        for layer in range(2):
            m.attend(seq, layer, torch.randn(1, 4, 64).half())
    bufs = [m._seq(a).mass_buf, m._seq(b).mass_buf]
    assert all(x.abs().sum() > 0 for x in bufs)
    m.compact(a)  # the buffer it replaces
    assert bufs[0].abs().sum() == 0
    kept = m._seq(a).mass_buf
    m.erase_user("acme", "alice")
    m.free(b)
    assert kept.abs().sum() == 0 and bufs[1].abs().sum() == 0


SEALED = [p for p in TIERS if p.id != "cpu"]  # the tiers whose pages leave the process


def stored(tier, key) -> bytes:
    return tier._path(key).read_bytes() if isinstance(tier, DiskTier) else tier.r.get(tier.prefix + key)


def store(tier, key, data: bytes) -> None:
    if isinstance(tier, DiskTier):
        tier._path(key).write_bytes(data)
    else:
        tier.r.set(tier.prefix + key, data)


@pytest.mark.parametrize("factory", SEALED)
def test_pages_leave_the_process_sealed_under_its_own_key(factory, tmp_path):
    tier = factory(tmp_path)
    page = torch.arange(4096, dtype=torch.int32).to(torch.uint8).reshape(16, 256)
    try:
        tier.put("s1-a", {"0.k": page})
        data = stored(tier, "s1-a")
        assert page.numpy().tobytes()[:256] not in data  # no run of the page's bytes is stored as such
        assert torch.equal(tier.get("s1-a")["0.k"], page)
        # a process started later (or another one) has its own key: what a dead process left is
        # unreadable to it, and so to anyone else reading the disk or Redis
        with pytest.raises(TierError, match="does not open"):
            factory(tmp_path).get("s1-a")
        # moved under another key, or altered: refused, never unpickled
        tier.put("s1-b", {"0.k": page + 1})
        store(tier, "s1-b", data)
        with pytest.raises(TierError, match="does not open"):
            tier.get("s1-b")
        for bad in (data[:-1] + bytes([data[-1] ^ 1]), data[:5], b""):
            store(tier, "s1-a", bad)
            with pytest.raises(TierError, match="does not open"):
                tier.get("s1-a")
    finally:
        for key in ("s1-a", "s1-b"):
            tier.erase(key)


def test_a_copy_that_does_not_open_stays_in_its_tier_and_is_erased_with_its_subject(tmp_path, alice):
    tier = DiskTier(tmp_path / "pages")
    m = make("int8", fp_window=16, tiers={"disk": tier})
    seq = m.open(alice)
    write(m, seq, 70)
    m.offload(seq, "disk", max_pages=1)
    (key,) = tier.keys()
    free = free_pages(m)
    data = stored(tier, key)
    store(tier, key, data[:-1] + bytes([data[-1] ^ 1]))
    with pytest.raises(TierError):
        m.kv(seq, 1)
    assert tier.keys() == [key] and free_pages(m) == free and m.stats().pages_offloaded == {"disk": 1}
    assert m.erase_user("acme", "alice").tier_copies == 1 and tier.keys() == []


@pytest.mark.parametrize("factory", SEALED)
def test_a_tier_of_its_own_erases_what_an_earlier_run_left(factory, tmp_path):
    page = {"0.k": torch.ones(64, dtype=torch.uint8)}
    first = factory(tmp_path)
    first.put("s1-a", page)
    first.put("s1-b", page)
    if isinstance(first, DiskTier):  # a write a crash cut short
        (first.root / "s1-c.tmp").write_bytes(b"\x01" * 64)
    try:
        assert sorted(factory(tmp_path).keys()) == ["s1-a", "s1-b"]  # shared by default: left alone
        kind, where = (DiskTier, first.root) if isinstance(first, DiskTier) else (RedisTier, first.prefix)
        again = kind(where, clear_stale=True) if kind is DiskTier else kind(first.r, where, clear_stale=True)
        assert again.keys() == [] and first.keys() == []
        if kind is DiskTier:
            assert list(first.root.iterdir()) == []
    finally:
        for key in ("s1-a", "s1-b"):
            first.erase(key)
