"""The K/V split tier: keys on the device, cold values in host memory, read by score."""

from __future__ import annotations

import math

import pytest
import torch

from kvguard.cache import CacheConfig, CacheManager
from kvguard.cache import events as ev
from kvguard.cache.attention import dense_attention
from kvguard.cache.split import VALUES
from kvguard.cache.tiers import CpuTier
from kvguard.errors import ConfigError
from kvguard.types import Subject

SUBJECT = Subject("acme", "alice", "s1")
L, H, HQ, D, S, N = 2, 2, 4, 8, 4, 40  # layers, KV heads, query heads, head dim, page size, tokens


def make(split: dict | None, **options) -> CacheManager:
    opts = dict(num_layers=L, num_kv_heads=H, head_dim=D, num_query_heads=HQ, page_size=S, num_pages=64,
                dtype=torch.float32, kv_split=split) | options
    return CacheManager(CacheConfig(**opts), tiers={"cpu": CpuTier()})


def filled(m: CacheManager, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    k, v = torch.randn(L, N, H, D, generator=g), torch.randn(L, N, H, D, generator=g)
    k[:, 5] *= 4  # some pages matter more than others
    seq = m.open(SUBJECT)
    for layer in range(L):
        m.append(seq, layer, k[layer].to(m.cfg.dtype), v[layer].to(m.cfg.dtype))
    return seq, k, v


def query(seed: int = 1, t: int = 1) -> torch.Tensor:
    return torch.randn(t, HQ, D, generator=torch.Generator().manual_seed(seed))


def test_every_page_fetched_is_full_attention_exactly():
    m = make({"window": 8, "top_k": 1000})
    seq, k, v = filled(m)
    assert m.split_cold(seq) == (N - 8) // S  # every full page older than the window
    for layer in range(L):
        q = query(layer)
        ref, _ = dense_attention(q, k[layer].transpose(0, 1), v[layer].transpose(0, 1))
        assert torch.equal(m.attend(seq, layer, q), ref)


def test_with_int8_pages_every_page_fetched_equals_the_cache_without_split():
    plain, split = make(None, codec="int8", fp_window=8), make({"window": 8, "fraction": 1.0}, codec="int8",
                                                                fp_window=8)
    a, _, _ = filled(plain)
    b, _, _ = filled(split)
    assert split.split_cold(b) > 0
    pages = split.seqs.get(b).pages
    moved = sum(r.where == "split" for r in pages)
    assert moved == split.pools["split"].used_count > 0  # int8 pages in the split's pool
    assert plain.pools["main"].used_count - split.pools["main"].used_count == moved  # freed on the device
    assert split.pools["split"]._stacks["v"].device.type == "cpu"  # their values in host memory
    assert split.stats().bytes_held == plain.stats().bytes_held  # the same bytes, some elsewhere
    for layer in range(L):
        q = query(7 + layer, t=3)
        assert torch.equal(split.attend(b, layer, q), plain.attend(a, layer, q))


def hand(q, k, v, cold: list[int], pick, normalize: str = "read"):
    """The split's answer computed by hand: softmax over every key; of the cold pages, those that
    `pick` chooses by their largest mass over query heads keep their values, the others
    contribute nothing: with normalize "all" their weight stays in the softmax, with "read" the
    softmax is taken again over what was kept."""
    g = HQ // H
    out = torch.zeros(HQ, D)
    mass = torch.zeros(len(cold))
    probs = []
    for hq in range(HQ):
        p = torch.softmax(k[:, hq // g] @ q[0, hq] / math.sqrt(D), 0)  # [N]
        probs.append(p)
        for j, i in enumerate(cold):
            mass[j] = max(mass[j], p[i * S:(i + 1) * S].sum())
    kept = set(pick(mass))
    skipped = [i for j, i in enumerate(cold) if j not in kept]
    for hq in range(HQ):
        w = probs[hq].clone()
        for i in skipped:
            w[i * S:(i + 1) * S] = 0
        if normalize == "read":
            w = w / w.sum()
        out[hq] = w @ v[:, hq // g]
    return out[None], skipped


def test_fewer_pages_the_error_is_only_the_skipped_values():
    m = make({"window": 8, "top_k": 3})
    seq, k, v = filled(m)
    m.split_cold(seq)
    cold = list(range((N - 8) // S))
    q = query(3)
    got = m.attend(seq, 0, q)
    want, skipped = hand(q, k[0], v[0], cold, lambda mass: mass.topk(3).indices.tolist())
    assert len(skipped) == len(cold) - 3
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    full, _ = dense_attention(q, k[0].transpose(0, 1), v[0].transpose(0, 1))
    assert (got - full).abs().max() > 1e-4  # the skipped values were missed
    assert m.split.last_read == pytest.approx((N - len(skipped) * S) / N)


@pytest.mark.parametrize("normalize", ["read", "all"])
@pytest.mark.parametrize("rule, pick", [
    ({"fraction": 0.25}, lambda mass: mass.topk(2).indices.tolist()),  # ceil(0.25 * 8 cold pages) = 2
    ({"mass": 0.05}, lambda mass: (mass >= 0.05).nonzero().flatten().tolist()),
    ({"mass": 0.999}, lambda mass: []),  # no page holds that much: the window's values alone
    # the mass rule capped (the pages' masses here: 0.72, 0.41, 0.15, 0.12, 0.10, 0.10, 0.09, 0.09):
    # the threshold cuts into the top 4, and the cap into the 7 pages over 0.09
    ({"mass": 0.13, "top_k": 4}, lambda mass: [i for i in mass.topk(4).indices.tolist() if mass[i] >= 0.13]),
    ({"mass": 0.09, "top_k": 2}, lambda mass: mass.topk(2).indices.tolist()),
    # coverage: the least pages skipped while their masses sum to at most 1 - coverage
    ({"coverage": 0.8}, lambda mass: covers(mass, 0.2)),  # the two of 0.09 skipped
    ({"coverage": 0.6}, lambda mass: covers(mass, 0.4)),
    ({"coverage": 0.999}, lambda mass: list(range(len(mass)))),  # no page holds as little as 0.001
    ({"coverage": 0.6, "top_k": 2}, lambda mass: [i for i in mass.topk(2).indices.tolist() if i in covers(mass, 0.4)]),
])
def test_fraction_and_mass_threshold_pick_as_said(rule, pick, normalize):
    m = make({"window": 8, "normalize": normalize, **rule})
    seq, k, v = filled(m)
    m.split_cold(seq)
    q = query(3)
    got = m.attend(seq, 0, q)
    want, skipped = hand(q, k[0], v[0], list(range(8)), pick, normalize)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    assert m.split.last_read == pytest.approx((N - len(skipped) * S) / N)


def covers(mass: torch.Tensor, miss: float) -> list[int]:
    """The pages a coverage rule reads, by hand: from the least mass up, each value's pages
    skipped together while the running sum stays within `miss`."""
    skip, run = set(), 0.0
    for value in sorted(set(mass.tolist())):
        group = [i for i, m in enumerate(mass.tolist()) if m == value]
        run += value * len(group)
        if run > miss:
            break
        skip.update(group)
    assert 0 < len(skip) < len(mass) or miss < 0.01  # the rule cuts into these pages
    return [i for i in range(len(mass)) if i not in skip]


def test_coverage_bounds_what_every_query_head_leaves_unread():
    """Whatever the context, the pages a coverage rule skips hold at most 1 - coverage of each
    query head's softmax (the mass rule's skipped share grows with the pages)."""
    from kvguard.cache.picks import covering

    g = torch.Generator().manual_seed(5)
    for cold in (8, 300, 3000):
        share = torch.softmax(torch.randn(2, 3, 4, cold, generator=g) * 2, dim=-1)  # [H, g, T, cold]
        for miss in (0.01, 0.1):
            read = covering(share.amax(dim=(0, 1)), miss)  # [T, cold]
            left = (share * ~read).sum(dim=-1)  # [H, g, T]
            assert left.max() <= miss + 1e-6
            assert (~read).any() or cold == 8  # past a few pages the rule skips some


def test_offload_and_fetch_events_name_the_values():
    m = make({"window": 8, "top_k": 2})
    seq, k, v = filled(m)
    m.split_cold(seq)
    (off,) = m.events.take_events()
    assert isinstance(off, ev.PagesOffloaded) and off.fields == ("v",) and off.dst == "cpu"
    assert off.pages == tuple(f"split:{i}" for i in range(8)) and off.n_tokens == 32
    assert off.details()["fields"] == ["v"]
    assert off.bytes == 8 * L * H * S * D * 4  # the fp32 values of 8 pages in every layer
    m.attend(seq, 0, query(1))
    assert m.events.take_events() == []  # one fetch per step, after the last layer
    m.attend(seq, 1, query(2))
    (fetch,) = m.events.take_events()
    assert isinstance(fetch, ev.PagesFetched) and fetch.fields == ("v",) and fetch.src == "cpu"
    assert 2 <= len(fetch.pages) <= 4 and fetch.bytes == 2 * 2 * H * S * D * 4  # 2 pages in each of 2 layers
    # a read of whole pages brings every value back first: one fetch of all of them
    kk, vv = m.kv(seq, 0)
    assert torch.equal(vv, v[0].transpose(0, 1)) and torch.equal(kk, k[0].transpose(0, 1))
    (back,) = m.events.take_events()
    assert back.fields == ("v",) and back.pages == off.pages and back.bytes == off.bytes
    assert not m.split.away(m.seqs.get(seq)) and m.pools["split"].used_count == 0


def test_whole_page_moves_keep_their_records_as_they_were():
    m = make(None)
    seq, _, _ = filled(m)
    m.offload(seq, "cpu", 2)
    (off,) = m.events.take_events()
    assert "fields" not in off.details() and off.fields == ()


def test_split_pages_go_whole_to_a_lower_tier():
    m = make({"window": 8, "top_k": 1000})
    seq, k, v = filled(m)
    m.split_cold(seq)
    assert m.stats().pages_offloaded == {VALUES: 8}
    assert m.publish_prefix(seq, list(range(N))) == 10  # every full page, split ones too
    assert m.offload(seq, "cpu") == 10  # an idle sequence's split pages leave whole, keys too
    assert m.stats().pages_offloaded == {"cpu": 10} and m.pools["split"].used_count == 0
    q = query(2)
    ref, _ = dense_attention(q, k[0].transpose(0, 1), v[0].transpose(0, 1))
    assert torch.equal(m.attend(seq, 0, q), ref)  # fetched back where they were: split pages again
    assert m.pools["split"].used_count == 8


def test_sinks_and_the_16bit_window_stay_on_the_device():
    m = make({"window": 0, "top_k": 1000}, codec="int8", fp_sink=4, fp_window=16)
    seq, k, v = filled(m)
    assert m.split_cold(seq) == (N - 16) // S - 1  # the codec's pages; the sink page and the 16-bit window stay
    g = torch.Generator().manual_seed(4)
    k2, v2 = torch.randn(L, 8, H, D, generator=g), torch.randn(L, 8, H, D, generator=g)
    for layer in range(L):
        assert m.append(seq, layer, k2[layer], v2[layer])
    m.split_cold(seq)
    pages = m.seqs.get(seq).pages
    assert [r.where for r in pages] == ["hot"] + ["split"] * 7 + ["hot"] * 4  # quantized, then split
    plain = make(None, codec="int8", fp_sink=4, fp_window=16)
    a, _, _ = filled(plain)
    for layer in range(L):
        assert plain.append(a, layer, k2[layer], v2[layer])
    q = query(5)
    assert torch.equal(m.attend(seq, 1, q), plain.attend(a, 1, q))


def test_writes_split_at_each_steps_first_layer_and_prefetch_gives_the_same_answer():
    plain, m = make(None), make({"window": 8, "top_k": 1000})
    a, _, _ = filled(plain)
    b, _, _ = filled(m)
    g = torch.Generator().manual_seed(5)
    for _ in range(6):  # decode steps
        k, v, q = torch.randn(L, 1, H, D, generator=g), torch.randn(L, 1, H, D, generator=g), torch.randn(L, 1, HQ, D,
                                                                                                        generator=g)
        for layer in range(L):
            for mm, s in ((plain, a), (m, b)):
                assert mm.append(s, layer, k[layer], v[layer])
            assert torch.equal(m.attend(b, layer, q[layer]), plain.attend(a, layer, q[layer]))
    assert sum(r.where == "split" for r in m.seqs.get(b).pages) == (N + 6 - 8) // S


@pytest.mark.parametrize("how", ["session", "user", "free"])
def test_erasure_leaves_neither_keys_nor_values(how):
    m = make({"window": 8, "top_k": 2}, codec="int8")
    other = m.open(Subject("acme", "bob", "s2"))
    seq, _, _ = filled(m)
    m.attend(seq, 0, query(1))  # a read left half done: its fetch is reported before the erasure
    assert m.split_cold(seq) > 0
    assert m.pools["split"]._stacks["v"].any()
    m.events.take_events()
    if how == "session":
        event = m.erase_session("acme", "s1")
    elif how == "user":
        event = m.erase_user("acme", "alice")
    else:
        m.free(seq)
        event = m.events.take_events()[-1]
    assert event.tier_copies == 0 and m.pools["split"].used_count == 0
    for pool in m.pools.values():  # no page holds anything of it: host values and device keys overwritten
        for t in pool._stacks.values():
            assert not t.view(torch.uint8).any()
    assert m.sequences() == [other]


def test_config_checks():
    for bad in ({"window": 8}, {"top_k": 2, "fraction": 0.5}, {"top_k": 0}, {"fraction": 1.5}, {"mass": 1.0},
                {"window": -1, "top_k": 1}, {"top_k": 1, "bogus": 1}, {"top_k": 1, "normalize": "some"},
                {"coverage": 1.0}, {"coverage": 0}, {"coverage": 0.9, "mass": 0.01}, {"coverage": True}):
        with pytest.raises(ConfigError):
            make(bad)
    m = make(None)
    with pytest.raises(ConfigError, match="no K/V split"):
        m.split_cold(m.open(SUBJECT))


KD, KS, KN = 32, 16, 200  # the kernel path's shapes: head dim, page size, tokens


def kernel_pair(rule: dict, codec: str):
    """The same cache on the kernel path and on the reference path, two rows of different
    lengths filled alike (only the first long enough to split), their cold pages split."""
    def one(use_kernels):
        m = CacheManager(CacheConfig(num_layers=L, num_kv_heads=H, head_dim=KD, num_query_heads=6, page_size=KS,
                                     num_pages=64, dtype=torch.float16, codec=codec, fp_sink=0, fp_window=16,
                                     use_kernels=use_kernels, kv_split={"window": 32, **rule}))
        g = torch.Generator().manual_seed(11)
        rows = []
        for i, n in enumerate((KN, 40)):
            seq = m.open(Subject("acme", f"u{i}", f"s{i}"))
            k, v = torch.randn(L, n, H, KD, generator=g), torch.randn(L, n, H, KD, generator=g)
            k[:, 17::23] *= 3  # some pages matter more than others
            for layer in range(L):
                assert m.append(seq, layer, k[layer].half(), v[layer].half())
            rows.append(seq)
        assert m.split_cold(rows[0]) > 0 and m.split_cold(rows[1]) == 0
        m.events.take_events()
        return m, rows
    return one(True), one(False)


@pytest.mark.parametrize("codec", ["fp16", "int8"])
@pytest.mark.parametrize("rule", [{"top_k": 1000}, {"top_k": 3}, {"fraction": 0.5}, {"mass": 0.02},
                                  {"mass": 0.2, "top_k": 1000}, {"mass": 0.02, "top_k": 2},
                                  {"coverage": 0.9}, {"coverage": 0.9, "top_k": 2},
                                  {"top_k": 3, "keys": "int4"}, {"top_k": 3, "keys": "int4", "host_keys": True}])
def test_the_kernel_path_reads_what_the_reference_path_reads(codec, rule):
    """Decode steps of a batch on the kernel path (scores, picks and reads on the device,
    under Triton's interpreter here) give the reference path's answer and the same fetch
    events."""
    (km, krows), (rm, rrows) = kernel_pair(rule, codec)
    g = torch.Generator().manual_seed(12)
    for _ in range(3):
        k, v = torch.randn(L, 2, H, KD, generator=g).half(), torch.randn(L, 2, H, KD, generator=g).half()
        q = torch.randn(L, 2, 6, KD, generator=g).half()
        for layer in range(L):
            km.append_step(krows, layer, k[layer], v[layer])
            rm.append_step(rrows, layer, k[layer], v[layer])
            got, want = km.attend_step(krows, layer, q[layer]), rm.attend_step(rrows, layer, q[layer])
            torch.testing.assert_close(got.float(), want.float(), rtol=2e-3, atol=2e-3)
        km.split.drain()
        kf = [e for e in km.events.take_events() if isinstance(e, ev.PagesFetched)]
        rf = [e for e in rm.events.take_events() if isinstance(e, ev.PagesFetched)]
        assert [(e.seq, sorted(e.pages), e.bytes) for e in kf] == [(e.seq, sorted(e.pages), e.bytes) for e in rf]
        if rule == {"top_k": 1000}:
            assert kf and len(kf[0].pages) == km.pools["split"].used_count


@pytest.mark.parametrize("codec,rule", [("fp16", {"top_k": 1000}), ("int8", {"top_k": 3}),
                                        ("fp16", {"fraction": 0.5, "normalize": "all"}), ("int8", {"mass": 0.02}),
                                        ("int8", {"top_k": 3, "keys": "int4"}),
                                        ("int8", {"top_k": 3, "keys": "int4", "host_keys": True}),
                                        ("fp16", {"mass": 0.02, "fraction": 0.25}), ("int8", {"coverage": 0.9})])
def test_a_chunk_on_the_kernel_path_reads_what_the_reference_path_reads(codec, rule):
    """A chunk of queries (a prefill's, after the split moved the older pages) on the kernel
    path: each query picks its own split pages as a decode row does, the other pools take the
    prefill kernel; the answer is the reference path's, and the fetch names the same pages and
    bytes (each page some query picked, brought once into device memory)."""
    (km, krows), (rm, rrows) = kernel_pair(rule, codec)
    g = torch.Generator().manual_seed(15)
    t = 5
    k, v = torch.randn(L, 2 * t, H, KD, generator=g).half(), torch.randn(L, 2 * t, H, KD, generator=g).half()
    q = torch.randn(L, 2, t, 6, KD, generator=g).half()
    for layer in range(L):
        for m, rows in ((km, krows), (rm, rrows)):
            m.append_chunk(rows, layer, k[layer].view(2, t, H, KD), v[layer].view(2, t, H, KD))
        assert km.split.chunk_ready(km.seqs.get(krows[0]), layer, t)
        got, want = km.attend_chunk(krows, layer, q[layer]), rm.attend_chunk(rrows, layer, q[layer])
        torch.testing.assert_close(got.float(), want.float(), rtol=2e-3, atol=2e-3)
    km.split.drain()
    (kf,) = [e for e in km.events.take_events() if isinstance(e, ev.PagesFetched)]
    (rf,) = [e for e in rm.events.take_events() if isinstance(e, ev.PagesFetched)]
    assert (kf.seq, sorted(kf.pages), kf.bytes) == (rf.seq, sorted(rf.pages), rf.bytes)
    if rule.get("top_k") == 1000:  # every query reads every page: full attention, each page once a layer
        assert kf.bytes == L * km.pools["split"].used_count * km.split.page_value_bytes


def test_a_chunk_whose_picks_are_too_many_to_gather_reads_them_in_place(monkeypatch):
    """Past STAGE_BYTES of device memory the chunk's queries read their picks in host memory
    where they lie: the same answer, the same pages named, and every query's reads counted."""
    from kvguard.cache import split as split_module

    monkeypatch.setattr(split_module, "STAGE_BYTES", 0)
    (km, krows), (rm, rrows) = kernel_pair({"top_k": 3}, "int8")
    t = 5
    g = torch.Generator().manual_seed(16)
    k, v = torch.randn(L, 2 * t, H, KD, generator=g).half(), torch.randn(L, 2 * t, H, KD, generator=g).half()
    q = torch.randn(L, 2, t, 6, KD, generator=g).half()
    for layer in range(L):
        for m, rows in ((km, krows), (rm, rrows)):
            m.append_chunk(rows, layer, k[layer].view(2, t, H, KD), v[layer].view(2, t, H, KD))
        got, want = km.attend_chunk(krows, layer, q[layer]), rm.attend_chunk(rrows, layer, q[layer])
        torch.testing.assert_close(got.float(), want.float(), rtol=2e-3, atol=2e-3)
    km.split.drain()
    (kf,) = [e for e in km.events.take_events() if isinstance(e, ev.PagesFetched)]
    (rf,) = [e for e in rm.events.take_events() if isinstance(e, ev.PagesFetched)]
    assert sorted(kf.pages) == sorted(rf.pages)
    assert kf.bytes == L * t * 3 * km.split.page_value_bytes > rf.bytes  # 3 pages a query, read in place


def test_rows_read_one_by_one_are_reported_as_their_own():
    """A batch's rows attended one at a time, layer after layer (a model that runs its rows
    separately), are each reported once per step under their own sequence, as in a batch."""
    (km, krows), (rm, rrows) = kernel_pair({"top_k": 3}, "int8")
    k, v = torch.randn(2, L, 20, H, KD, generator=torch.Generator().manual_seed(13)).half()
    for layer in range(L):  # the second row grows past the split's window: both rows read split pages
        km.append(krows[1], layer, k[layer], v[layer])
        rm.append(rrows[1], layer, k[layer], v[layer])
    assert km.split_cold(krows[1]) == rm.split_cold(rrows[1]) == 1
    km.events.take_events(), rm.events.take_events()
    g = torch.Generator().manual_seed(14)
    for _ in range(2):
        q = torch.randn(L, 2, 6, KD, generator=g).half()
        for layer in range(L):
            for i, row in enumerate(krows):
                km.attend_step([row], layer, q[layer, i:i + 1])
            rm.attend_step(rrows, layer, q[layer])
        km.split.drain()
        kf = [(e.seq, sorted(e.pages), e.bytes) for e in km.events.take_events() if isinstance(e, ev.PagesFetched)]
        rf = [(e.seq, sorted(e.pages), e.bytes) for e in rm.events.take_events() if isinstance(e, ev.PagesFetched)]
        assert sorted(kf) == sorted(rf) and len(kf) == 2


def test_a_rule_set_after_construction_is_the_one_the_kernels_pick_by():
    """The split's rule may be replaced on a live cache (the benchmark times several rules on one
    fill): the kernels then pick by the new rule's mass or coverage, as the reference path does,
    not by the rule the cache was built with."""
    from kvguard.cache.config import KVSplit

    (km, krows), (rm, rrows) = kernel_pair({"top_k": 3}, "int8")
    for m in (km, rm):
        m.split.rule = KVSplit(window=32, coverage=0.5)
    g = torch.Generator().manual_seed(13)
    q = torch.randn(L, 2, 6, KD, generator=g).half()
    for layer in range(L):
        torch.testing.assert_close(km.attend_step(krows, layer, q[layer]).float(),
                                   rm.attend_step(rrows, layer, q[layer]).float(), rtol=2e-3, atol=2e-3)
    km.split.drain()
    kf = [sorted(e.pages) for e in km.events.take_events() if isinstance(e, ev.PagesFetched)]
    rf = [sorted(e.pages) for e in rm.events.take_events() if isinstance(e, ev.PagesFetched)]
    assert kf == rf and len(kf[0]) < km.pools["split"].used_count  # coverage 0.5 leaves pages unread


def test_the_kernel_path_reads_the_values_of_the_picked_pages_only():
    """Values of pages not picked are never read: poison them and the answer does not change."""
    (km, krows), _ = kernel_pair({"top_k": 2}, "int8")
    q = torch.randn(2, 6, KD, generator=torch.Generator().manual_seed(3)).half()
    before = km.attend_step(krows, 0, q)  # layer 0 of a step: what it read is still on the device
    chosen, count = km.split._reads[tuple(krows)][1][-1]
    assert count.tolist() == [2, 0]  # the second row has no split page
    read = set(chosen[0, :2].tolist())
    stack = km.pools["split"]._stacks["v"]
    others = [p for p in range(km.pools["split"].num_pages) if p not in read]
    stack[:, others] = 127  # every other split page's value codes
    torch.testing.assert_close(km.attend_step(krows, 0, q), before, rtol=0, atol=0)
    stack[:, sorted(read)] = 127
    assert not torch.equal(km.attend_step(krows, 0, q), before)
    # three reads of layer 0 and none of layer 1: each unfinished step is reported all the same
    km.free(krows[0])
    fetches = [e for e in km.events.take_events() if isinstance(e, ev.PagesFetched)]
    assert [sorted(e.pages) for e in fetches] == [sorted(f"split:{p}" for p in read)] * 3


def static_pair(rule: dict, codec: str, **options):
    """The same split cache twice on the kernel path, rows filled alike and split: one to step
    eagerly, one through a StaticStep."""
    def one():
        m = CacheManager(CacheConfig(num_layers=L, num_kv_heads=H, head_dim=KD, num_query_heads=6, page_size=KS,
                                     num_pages=64, dtype=torch.float16, codec=codec, fp_sink=0, fp_window=16,
                                     use_kernels=True, kv_split={"window": 32, **rule}, **options))
        g = torch.Generator().manual_seed(21)
        rows = []
        for i, n in enumerate((KN, 60)):
            seq = m.open(Subject("acme", f"u{i}", f"s{i}"))
            k, v = torch.randn(L, n, H, KD, generator=g), torch.randn(L, n, H, KD, generator=g)
            k[:, 17::23] *= 3
            for layer in range(L):
                assert m.append(seq, layer, k[layer].half(), v[layer].half())
            rows.append(seq)
        m.events.take_events()
        return m, rows
    return one(), one()


@pytest.mark.parametrize("codec,rule", [("fp16", {"top_k": 3}), ("int8", {"fraction": 0.5}),
                                        ("fp16", {"mass": 0.02}), ("int8", {"top_k": 3, "slots": 24}),
                                        ("int8", {"top_k": 3, "keys": "int4", "host_keys": True, "slots": 24}),
                                        ("int8", {"mass": 0.02, "top_k": 3, "slots": 24})])
def test_a_static_decode_step_reads_what_an_eager_step_reads(codec, rule):
    """Decode steps through StaticStep's fixed buffers (what a CUDA graph replays) give the
    eager kernel path's answers and fetch events, while pages move to the split between
    steps (the second row reaches the split's window during the steps)."""
    from kvguard.cache.step import StaticStep

    (em, erows), (sm, srows) = static_pair(rule, codec)
    step = StaticStep(sm, srows, KN + 40)
    # a static step quantizes the page that left the 16-bit window after its last layer, which
    # reads it in 16-bit; an eager step's last layer reads it in INT8
    tol = 2e-3 if codec == "fp16" else 1e-2
    g = torch.Generator().manual_seed(22)
    fetched, steps = 0, 5  # the short row (60 tokens) moves its second page at the 5th
    for _ in range(steps):
        k, v = torch.randn(L, 2, H, KD, generator=g).half(), torch.randn(L, 2, H, KD, generator=g).half()
        q = torch.randn(L, 2, 6, KD, generator=g).half()
        with step:
            got = []
            for layer in range(L):
                step.write(layer, k[layer], v[layer])
                got.append(step.attend(layer, q[layer]))
        for layer in range(L):
            em.append_step(erows, layer, k[layer], v[layer])
            want = em.attend_step(erows, layer, q[layer])
            torch.testing.assert_close(got[layer].float(), want.float(), rtol=tol, atol=tol)
        ef = [(e.seq, sorted(e.pages), e.bytes) for e in em.events.take_events() if isinstance(e, ev.PagesFetched)]
        sf = [(e.seq, sorted(e.pages), e.bytes) for e in sm.events.take_events() if isinstance(e, ev.PagesFetched)]
        assert sf == ef and (sf or "slots" in rule)  # with slots a step may read nothing over the bus
        fetched += len(sf)
    assert fetched
    assert [sm.length(r) for r in srows] == [em.length(r) for r in erows] == [KN + steps, 60 + steps]
    assert sm.pools["split"].used_count == em.pools["split"].used_count
    # the short row's second page moved to the split at the last step (its first one before)
    assert [r.where for r in sm.seqs.get(srows[1]).pages].count("split") == 2


def test_a_static_step_that_fails_midway_reports_the_values_its_layers_read():
    """A forward pass that fails after some layers: the lengths stay, and the values those
    layers read are in a fetch record (as an eager step's unfinished reads are)."""
    from kvguard.cache.step import StaticStep

    (em, erows), (sm, srows) = static_pair({"top_k": 3}, "int8")
    step = StaticStep(sm, srows, KN + 40)
    g = torch.Generator().manual_seed(23)
    k, v = torch.randn(2, H, KD, generator=g).half(), torch.randn(2, H, KD, generator=g).half()
    q = torch.randn(2, 6, KD, generator=g).half()
    with pytest.raises(RuntimeError, match="layer 1 failed"):
        with step:
            step.write(0, k, v)
            step.attend(0, q)
            raise RuntimeError("layer 1 failed")
    em.append_step(erows, 0, k, v)
    em.attend_step(erows, 0, q)
    em.split.flush(em.seqs.get(erows[0]))  # the eager step's unfinished reads
    sm.split.drain()
    ef = [(e.seq, sorted(e.pages), e.bytes) for e in em.events.take_events() if isinstance(e, ev.PagesFetched)]
    sf = [(e.seq, sorted(e.pages), e.bytes) for e in sm.events.take_events() if isinstance(e, ev.PagesFetched)]
    assert sf == ef and len(sf) == 2  # each row read split pages in layer 0
    assert [sm.length(r) for r in srows] == [KN, 60]


def test_a_static_decode_step_refuses_a_split_cache_whose_evictor_needs_mass():
    from kvguard.cache.step import StaticStep

    m = make({"window": 8, "top_k": 2}, dtype=torch.float16, use_kernels=True, evictor="h2o",
             evictor_options={"budget": 64, "sink": 4, "window": 8})
    seq, _, _ = filled(m)
    with pytest.raises(ConfigError, match="decodes eagerly"):
        StaticStep(m, [seq], 64)


@pytest.mark.parametrize("codec", ["fp16", "int8"])
def test_streamingllm_compaction_moves_split_pages_by_relinking_them(codec):
    """StreamingLLM past its budget drops a page's worth of old tokens each time: the pages
    after the sinks move whole, so the split's pages stay where they are (their values in host
    memory), none is brought home, and every answer is the cache's without the split."""
    opts = dict(codec=codec, evictor="streamingllm", evictor_options={"budget": 32, "sink": 2})
    if codec == "int8":
        opts["fp_window"] = 8
    plain, split = make(None, **opts), make({"window": 8, "fraction": 1.0}, **opts)
    seqs = [filled(m)[0] for m in (plain, split)]
    assert split.split_cold(seqs[1]) > 0
    before = {r.page for r in split.seqs.get(seqs[1]).pages if r.where == "split"}
    g = torch.Generator().manual_seed(9)
    split.events.take_events()
    for _ in range(3 * S):  # three compactions
        k, v = torch.randn(2, L, 1, H, D, generator=g)
        q = query(int(torch.randint(0, 1000, (1,), generator=g)))
        for layer in range(L):
            outs = []
            for m, seq in zip((plain, split), seqs):
                m.append_step([seq], layer, k[layer], v[layer])
                outs.append(m.attend_step([seq], layer, q))
            torch.testing.assert_close(outs[1], outs[0], rtol=1e-5, atol=1e-5)
    events = split.events.take_events()
    evicted = [e for e in events if isinstance(e, ev.TokensEvicted)]
    assert len(evicted) == 3 and all(e.kept == 32 for e in evicted)
    # a fetch a step for the values read (6 cold pages), and per compaction the two split pages
    # that are the sources of its new first page (the sinks' and the page the drop cuts) come
    # home: no other
    fetches = [e for e in events if isinstance(e, ev.PagesFetched)]
    assert sorted(len(e.pages) for e in fetches) == [2] * 3 + [6] * 3 * S
    after = {r.page for r in split.seqs.get(seqs[1]).pages if r.where == "split"}
    # of the 8 split pages the compactions freed the sink page, the pages dropped and each time
    # the page the drop cut (its last survivors join the sinks' new 16-bit page); 3 never moved
    assert len(before) == 8 and len(before & after) == 3


def test_a_prefix_offered_for_sharing_moves_to_the_split_and_is_shared_there():
    """A sequence's offered prompt pages move to the split as its others do, and the offer with
    them: a later sequence of the tenant shares the split pages (nothing copied), reads what
    the first one reads, and keeps them when the first is erased."""
    m = make({"window": 8, "fraction": 1.0}, prefix_sharing=True)
    tokens = list(range(N))
    first, k, v = filled(m)
    assert m.publish_prefix(first, tokens) == N // S
    assert m.split_cold(first) == 8  # offered pages too
    second = m.open(Subject("acme", "bob", "s2"), tokens)  # the same tenant, the same prompt
    assert m.length(second) == N and m.pools["split"].used_count == 8  # shared, not copied
    assert [r.where for r in m.seqs.get(second).pages] == ["split"] * 8 + ["hot"] * 2
    q = query(4)
    want = m.attend(first, 0, q)
    torch.testing.assert_close(m.attend(second, 0, q), want, rtol=0, atol=0)
    ref, _ = dense_attention(q, k[0].transpose(0, 1), v[0].transpose(0, 1))
    torch.testing.assert_close(want, ref, rtol=1e-5, atol=1e-5)
    m.erase_user("acme", "alice")  # alice's sequence goes; bob's shared pages stay, and read the same
    torch.testing.assert_close(m.attend(second, 0, q), want, rtol=0, atol=0)
    assert m.pools["split"].used_count == 8
    m.free(second)
    assert m.pools["split"].used_count == 0 and len(m.store.prefix) == 0
