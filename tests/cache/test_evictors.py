"""Every evictor through the same checks: sinks, window, budget, pages really freed."""

from __future__ import annotations

import pytest
import torch

from kvguard.cache import CacheConfig, CacheManager
from kvguard.compress.evictors import EVICTORS
from kvguard.errors import ConfigError
from tests.conftest import outlier_kv

EVICTOR_MATRIX = [
    {"name": "streamingllm", "options": {"budget": 48, "sink": 4, "window": 0}},
    {"name": "h2o", "options": {"budget": 48, "sink": 4, "window": 16}},
    {"name": "snapkv", "options": {"budget": 48, "sink": 4, "window": 16, "observe": 8}},
]


def test_matrix_covers_every_evictor():
    assert {e["name"] for e in EVICTOR_MATRIX} == set(EVICTORS)


def build(case, codec="fp16", **kw):
    cfg = CacheConfig(num_layers=2, num_kv_heads=2, head_dim=64, num_query_heads=4, num_pages=64, codec=codec,
                      evictor=case["name"], evictor_options=case["options"], **kw)
    return CacheManager(cfg)


def fill(m, seq, k, v, *, chunk=None):
    """Prefill then decode one token at a time, attending after each write like a model."""
    n = k.shape[0]
    q = torch.randn(n, 4, 64, generator=torch.Generator().manual_seed(9)).half()
    steps = [(0, chunk)] + [(i, i + 1) for i in range(chunk, n)] if chunk else [(0, n)]
    for lo, hi in steps:
        for layer in range(2):
            assert m.append(seq, layer, k[lo:hi], v[lo:hi])
            m.attend(seq, layer, q[lo:hi])


@pytest.mark.parametrize("case", EVICTOR_MATRIX, ids=lambda c: c["name"])
@pytest.mark.parametrize("codec", ["fp16", "int8"])
def test_compaction_keeps_sinks_window_and_budget(case, codec, alice):
    m = build(case, codec, auto_compact=False, fp_sink=4)
    seq = m.open(alice)
    k, v = outlier_kv(150, 2, 64, seed=5)
    fill(m, seq, k, v, chunk=100)
    pages_before = m.stats().pages_used
    m.events.take_events()
    ev = m.compact(seq)
    budget, sink = case["options"]["budget"], case["options"]["sink"]
    window = budget - sink if case["name"] == "streamingllm" else case["options"]["window"]
    assert ev is not None and ev.op == "evict"
    assert m.length(seq) == budget and ev.kept == budget and ev.n_tokens == 150 - budget
    kk, vv = m.kv(seq, 0, dtype=torch.float32)
    tol = 1e-3 if codec == "fp16" else 0.05
    ref_k = k.float().transpose(0, 1)
    # sinks kept first, the window kept last, in order
    assert torch.allclose(kk[:, :sink], ref_k[:, :sink], atol=tol * 20)
    assert torch.allclose(kk[:, -window:], ref_k[:, -window:], atol=tol * 20)
    # the freed pages are back in the pool; the sequence holds just what the budget needs
    after = m.stats()
    held = {f"{r.where}:{r.page}" for r in m._seq(seq).pages}
    assert sum(after.pages_used.values()) == -(-budget // 16) < sum(pages_before.values())
    assert not held & set(ev.pages)
    assert all(m.pools[p].free_count + m.pools[p].used_count == 64 for p in m.pools)
    evs = m.events.take_events()
    written = [f"{r.where}:{r.page}" for r in m._seq(seq).pages if r.where == "main"]
    # survivors written into codec pages are reported as quantized, just before the eviction
    assert [e.op for e in evs] == (["quantize", "evict"] if written else ["evict"])
    assert not written or list(evs[0].pages) == written


@pytest.mark.parametrize("case", EVICTOR_MATRIX, ids=lambda c: c["name"])
def test_auto_compaction_bounds_memory(case, alice):
    m = build(case)
    seq = m.open(alice)
    k, v = outlier_kv(300, 2, 64, seed=6)
    fill(m, seq, k, v, chunk=32)
    budget = case["options"]["budget"]
    assert m.length(seq) < budget + 16
    assert m.stats().tokens_evicted == 300 - m.length(seq)


def test_h2o_keeps_heavy_hitters(alice):
    """A key that every query attends to survives; StreamingLLM drops it."""
    k, v = outlier_kv(120, 2, 64, seed=7)
    g = torch.Generator().manual_seed(8)
    u = torch.randn(64, generator=g)
    q = (torch.randn(120, 4, 64, generator=g) + 2 * u).half()
    k[40] = (u / u.norm() * 40).half()  # every query attends to key 40
    kept = {}
    for case in EVICTOR_MATRIX[:2]:
        m = build(case, auto_compact=False)
        seq = m.open(alice)
        for i in range(120):
            for layer in range(2):
                m.append(seq, layer, k[i : i + 1], v[i : i + 1])
                m.attend(seq, layer, q[i : i + 1])
        m.compact(seq)
        kk, _ = m.kv(seq, 0)
        kept[case["name"]] = any(torch.equal(kk[:, j], k[40]) for j in range(kk.shape[1]))
    assert kept == {"streamingllm": False, "h2o": True}


@pytest.mark.parametrize("name", sorted(EVICTORS))
def test_budget_smaller_than_sink_plus_window_is_refused(name):
    # streamingllm's window is what the budget leaves, so only a budget below its sinks is short
    budget = 3 if name == "streamingllm" else 10
    with pytest.raises(ConfigError, match="budget"):
        build({"name": name, "options": {"budget": budget, "sink": 4, "window": 16}})


@pytest.mark.parametrize("case", EVICTOR_MATRIX[1:], ids=lambda c: c["name"])
def test_per_head_compaction_keeps_each_heads_own_positions(case, alice):
    """H2O and SnapKV choose per layer and KV head: each head's surviving K/V are exactly
    the original K/V at that head's chosen positions, in order, and heads differ."""
    m = build(case, auto_compact=False)
    seq = m.open(alice)
    k, v = outlier_kv(150, 2, 64, seed=11)
    g = torch.Generator().manual_seed(12)
    q = torch.randn(150, 4, 64, generator=g).half()
    # a different heavy key per KV head: queries of group h lean on key 40 + 30 h
    for h in range(2):
        u = torch.randn(64, generator=g)
        k[40 + 30 * h, h] = (u / u.norm() * 40).half()
        q[:, 2 * h : 2 * h + 2] = (q[:, 2 * h : 2 * h + 2].float() + 2 * u).half()
    for lo, hi in [(0, 100)] + [(i, i + 1) for i in range(100, 150)]:
        for layer in range(2):
            m.append(seq, layer, k[lo:hi], v[lo:hi])
            m.attend(seq, layer, q[lo:hi])
    mass = m._seq(seq).mass.clone()
    keep = m.evictor.select(150, mass)
    assert keep.shape == (2, 2, 48)
    assert not torch.equal(keep[:, 0], keep[:, 1])  # the heads chose differently
    assert m.compact(seq).kept == 48
    for layer in range(2):
        kk, vv = m.kv(seq, layer)
        for h in range(2):
            assert torch.equal(kk[h], k[keep[layer, h], h]) and torch.equal(vv[h], v[keep[layer, h], h])
            assert (40 + 30 * h) in keep[layer, h].tolist()
    # H2O's mass travels with its tokens; SnapKV's votes start again after a compaction
    after = m._seq(seq).mass
    assert torch.equal(after, torch.zeros_like(after) if m.evictor.fresh_votes else mass.gather(-1, keep))


def test_one_keep_set_when_asked(alice):
    case = {"name": "h2o", "options": {"budget": 48, "sink": 4, "window": 16, "per_head": False}}
    m = build(case, auto_compact=False)
    seq = m.open(alice)
    k, v = outlier_kv(120, 2, 64, seed=13)
    fill(m, seq, k, v, chunk=100)
    keep = m.evictor.select(120, m._seq(seq).mass)
    assert keep.shape == (48,)
    m.compact(seq)
    kk, _ = m.kv(seq, 1)
    assert torch.equal(kk, k[keep].transpose(0, 1))


def test_per_head_must_be_a_boolean():
    with pytest.raises(ConfigError, match="per_head"):
        build({"name": "h2o", "options": {"budget": 48, "sink": 4, "window": 16, "per_head": "yes"}})


def test_snapkv_decode_queries_vote_after_a_compaction(alice):
    m = build(EVICTOR_MATRIX[2], auto_compact=False)
    seq = m.open(alice)
    k, v = outlier_kv(130, 2, 64, seed=14)
    fill(m, seq, k[:120], v[:120], chunk=100)
    m.compact(seq)
    assert m._seq(seq).mass.abs().sum() == 0
    q = torch.randn(1, 4, 64, generator=torch.Generator().manual_seed(15)).half()
    for layer in range(2):
        m.append(seq, layer, k[120:121], v[120:121])
        m.attend(seq, layer, q)
    mass = m._seq(seq).mass
    assert mass.shape == (2, 2, 49) and torch.allclose(mass.sum(-1), torch.full((2, 2), 2.0))  # group of 2 queries


def test_append_when_auto_compaction_cannot_fetch_offloaded_pages():
    # a sequence over its budget whose pages are all offloaded, with every 16-bit page taken by
    # others: compacting it first needs its pages back, and there is no room for them. The append
    # compacts nothing and, with no page for its token either, writes nothing and returns False;
    # an explicit compact says why (OutOfPages), as attend does
    from kvguard.cache.tiers import CpuTier
    from kvguard.errors import OutOfPages
    from kvguard.types import Subject

    cfg = CacheConfig(num_layers=2, num_kv_heads=1, head_dim=32, num_pages=8, page_size=4, codec="fp16",
                      fp_sink=0, fp_window=0, evictor="h2o", evictor_options={"budget": 8, "sink": 2, "window": 4})
    m = CacheManager(cfg, tiers={"cpu": CpuTier()})

    def fill(seq, n):
        k = torch.randn(n, 1, 32).half()
        return all(m.append(seq, layer, k, k) for layer in range(2))

    a = m.open(Subject("t", "a", "a"))
    assert fill(a, 12) and m.offload(a, "cpu") == 3
    for i, n in enumerate((11, 11, 8)):  # 3 + 3 + 2 pages: the pool is full
        assert fill(m.open(Subject("t", f"o{i}", f"o{i}")), n)
    assert m.pools["hot"].free_count == 0
    before = list(m._seq(a).pages)
    assert m.append(a, 0, torch.randn(1, 1, 32).half(), torch.randn(1, 1, 32).half()) is False
    assert m._seq(a).pages == before and m.length(a) == 12
    with pytest.raises(OutOfPages, match="fetch"):
        m.compact(a)


def test_streamingllm_takes_a_budget_below_the_default_window():
    # its window is what the budget leaves after the sinks, whatever window the options carry
    ev = EVICTORS["streamingllm"](budget=32, sink=4)
    keep = ev.select(100, torch.zeros(100))
    assert keep.tolist() == [0, 1, 2, 3] + list(range(72, 100))
    assert EVICTORS["streamingllm"](budget=32, sink=4, window=1000).window == 28
    with pytest.raises(ValueError, match="budget 3 is smaller than sink 4"):
        EVICTORS["streamingllm"](budget=3, sink=4)
