"""Decode steps of a batch (append_step + attend_step) and the per-sequence layout they read:
a batch step does what its rows' own append + attend do (the same cache state exactly, the same
outputs to fp16's last bit: the batch sums in another order), and a step rebuilds nothing unless
a row's pages changed."""

from __future__ import annotations

import pytest
import torch

from kvguard.cache import CacheConfig, CacheManager
from kvguard.cache.manager import HOT, MAIN, PageList
from kvguard.errors import InputError, UnknownSequence
from kvguard.types import Subject
from tests.conftest import outlier_kv

LENGTHS = (37, 16, 70)  # a partly filled page, exactly one page, several pages


def make(**kw):
    cfg = CacheConfig(num_layers=2, num_kv_heads=2, head_dim=64, num_query_heads=4,
                      **({"num_pages": 48, "codec": "int8", "fp_sink": 4, "fp_window": 16} | kw))
    return CacheManager(cfg)


def opened(m, lengths=LENGTHS):
    seqs = []
    for i, n in enumerate(lengths):
        seq = m.open(Subject("acme", f"u{i}", f"s{i}"))
        k, v = outlier_kv(n, 2, 64, seed=i)
        for layer in range(2):
            assert m.append(seq, layer, k, v)
        seqs.append(seq)
    return seqs


def steps(m, seqs, n, batched, seed=7):
    g = torch.Generator().manual_seed(seed)
    outs = []
    for _ in range(n):
        k = torch.randn(len(seqs), 2, 64, generator=g).half()
        q = torch.randn(len(seqs), 4, 64, generator=g).half()
        for layer in range(2):
            if batched:
                assert m.append_step(seqs, layer, k, k)
                outs.append(m.attend_step(seqs, layer, q))
            else:
                for i, seq in enumerate(seqs):
                    assert m.append(seq, layer, k[i : i + 1], k[i : i + 1])
                outs.append(torch.cat([m.attend(seq, layer, q[i : i + 1]) for i, seq in enumerate(seqs)]))
    return torch.stack(outs)


@pytest.mark.parametrize("options", [{}, {"codec": "fp16", "fp_sink": 0, "fp_window": 0},
                                     {"evictor": "h2o", "evictor_options": {"budget": 48, "sink": 4, "window": 16}}])
def test_a_batch_step_is_its_rows_steps(options):
    # 20 steps: pages fill, get quantized, and (h2o) sequences are compacted along the way
    a, b = make(**options), make(**options)
    sa, sb = opened(a), opened(b)
    # one fp16 ulp apart at most (2**-10 relative): fp32 sums in the batch's order, then rounded
    torch.testing.assert_close(steps(a, sa, 20, batched=True), steps(b, sb, 20, batched=False),
                               rtol=2**-9, atol=2**-13)
    for x, y in zip(sa, sb):
        assert a.length(x) == b.length(y)
        for layer in range(2):
            assert all(torch.equal(p, q) for p, q in zip(a.kv(x, layer), b.kv(y, layer)))
        assert torch.equal(a._seq(x).mass, b._seq(y).mass)
    if "evictor" in options:
        assert a.stats().tokens_evicted > 0


def test_batch_step_refuses_bad_input():
    m = make()
    seqs = opened(m)
    k = torch.zeros(3, 2, 64, dtype=torch.float16)
    q = torch.zeros(3, 4, 64, dtype=torch.float16)
    with pytest.raises(InputError, match="non-empty list"):
        m.append_step([], 0, k, k)
    with pytest.raises(InputError, match="twice"):
        m.attend_step([seqs[0], seqs[0], seqs[1]], 0, q)
    with pytest.raises(UnknownSequence):
        m.append_step([seqs[0], seqs[1], 999], 0, k, k)
    with pytest.raises(InputError, match="2 sequences"):
        m.append_step(seqs[:2], 0, k, k)
    with pytest.raises(InputError, match=r"q must have shape \[2, 4, 64\]"):
        m.attend_step(seqs[:2], 0, q)
    with pytest.raises(InputError, match="layer"):
        m.attend_step(seqs, 2, q)
    empty = m.open(Subject("acme", "x", "y"))
    with pytest.raises(InputError, match="holds no position"):
        m.attend_step([empty], 0, q[:1])


def test_batch_step_without_pages_writes_nothing():
    m = make(codec="fp16", fp_sink=0, fp_window=0, num_pages=9)
    seqs = opened(m, (32, 16, 64))  # every row at a page boundary; 7 of 9 pages used
    k = torch.ones(3, 2, 64, dtype=torch.float16)
    before = [m.length(s) for s in seqs]
    assert not m.append_step(seqs, 0, k, k)  # three rows start a page, two are free
    assert [m.length(s) for s in seqs] == before
    assert m.append_step(seqs[:2], 0, k[:2], k[:2])


def test_layout_rebuilt_only_when_pages_change():
    m = make()
    seq = opened(m, (40,))[0]
    s = m._seq(seq)
    lay = m.block_tables.layout(s)
    assert lay.idx[HOT] == [i for i, r in enumerate(s.pages) if r.where == HOT]
    one = torch.zeros(1, 2, 64, dtype=torch.float16)
    for layer in range(2):
        m.append(seq, layer, one, one)  # token 41: same page
    assert m.block_tables.layout(s) is lay
    for _ in range(8):  # past token 48: a new page, and page 1 leaves the 16-bit window
        for layer in range(2):
            m.append(seq, layer, one, one)
    new = m.block_tables.layout(s)
    assert new is not lay
    assert new.idx[HOT] == [i for i, r in enumerate(s.pages) if r.where == HOT]
    assert new.idx[MAIN] == [i for i, r in enumerate(s.pages) if r.where == MAIN] == [1]


def test_page_list_versions_every_edit():
    pages = PageList([1, 2])
    seen = {pages.version}
    for edit in (lambda p: p.append(3), lambda p: p.extend([4]), lambda p: p.__setitem__(0, 9),
                 lambda p: p.pop(), lambda p: p.insert(0, 5), lambda p: p.sort()):
        edit(pages)
        assert pages.version not in seen
        seen.add(pages.version)
    m = make()
    s = m._seq(opened(m, (20,))[0])
    s.pages = list(s.pages)  # a plain list assigned is wrapped, with a new version
    assert isinstance(s.pages, PageList) and s.pages.version not in seen


def test_mass_grows_by_doubling():
    m = make(evictor="h2o", evictor_options={"budget": 4096, "sink": 4, "window": 16})
    seq = opened(m, (1,))[0]
    s = m._seq(seq)
    one = torch.zeros(1, 2, 64, dtype=torch.float16)
    sizes = set()
    for _ in range(300):
        for layer in range(2):
            m.append(seq, layer, one, one)
        sizes.add(s.mass_buf.shape[-1])
        assert s.mass.shape == (2, 2, m.length(seq))
    assert len(sizes) <= 10  # 2, 4, ..., 512: not one copy of the whole buffer per token


@pytest.mark.parametrize("mass_queries", [0, 3, 20])
def test_dense_attention_in_query_blocks_is_the_whole(monkeypatch, mass_queries):
    # a long prompt's scores are taken a block of queries at a time; the result is the same
    from kvguard.cache import attention

    g = torch.Generator().manual_seed(3)
    q = torch.randn(20, 4, 64, generator=g).half()
    k, v = (x.transpose(0, 1) for x in outlier_kv(50, 2, 64, seed=4))  # [H, L, D]
    whole = attention.dense_attention(q, k, v, mass_queries=mass_queries)
    monkeypatch.setattr(attention, "MAX_SCORES", 4 * 2 * 50 * 3)  # blocks of 3 queries, the last of 2
    blocks = attention.dense_attention(q, k, v, mass_queries=mass_queries)
    assert torch.allclose(blocks[0].float(), whole[0].float(), atol=1e-3)
    if mass_queries:
        assert torch.allclose(blocks[1], whole[1], atol=1e-5)
        assert torch.allclose(whole[1].sum(), torch.tensor(4.0 * mass_queries), atol=1e-3)
    else:
        assert blocks[1] is None and whole[1] is None


def chunks(m, seqs, batched, seed=9):
    """A chunk for every row, then one with padding on the left (a row with none); per row
    (append + attend) or as one batch (append_chunk + attend_chunk)."""
    g = torch.Generator().manual_seed(seed)
    outs = []
    for t, counts in ((30, [30, 30, 30]), (20, [20, 7, 0])):
        k = torch.randn(len(seqs), t, 2, 64, generator=g).half()
        q = torch.randn(len(seqs), t, 4, 64, generator=g).half()
        for layer in range(2):
            if batched:
                assert m.append_chunk(seqs, layer, k, k * 0.5, counts)
                outs.append(m.attend_chunk(seqs, layer, q, counts))
                continue
            out = torch.zeros(len(seqs), t, 4, 64, dtype=torch.float16)
            for i, (seq, n) in enumerate(zip(seqs, counts)):
                if n:
                    assert m.append(seq, layer, k[i, t - n:], k[i, t - n:] * 0.5)
                    out[i, t - n:] = m.attend(seq, layer, q[i, t - n:])
            outs.append(out)
    return torch.cat([o.flatten() for o in outs])


@pytest.mark.parametrize("options", [{}, {"evictor": "h2o", "evictor_options": {"budget": 48, "sink": 4,
                                                                                 "window": 16}}])
def test_a_batch_chunk_is_its_rows_chunks(options):
    a, b = make(**options), make(**options)
    sa, sb = opened(a, (37, 16, 5)), opened(b, (37, 16, 5))
    assert torch.equal(chunks(a, sa, batched=True), chunks(b, sb, batched=False))
    for x, y in zip(sa, sb):
        assert a.length(x) == b.length(y)
        for layer in range(2):
            assert all(torch.equal(p, q) for p, q in zip(a.kv(x, layer), b.kv(y, layer)))
        assert torch.equal(a._seq(x).mass, b._seq(y).mass)
    assert a.stats() == b.stats()


def test_batch_chunk_refuses_bad_input():
    m = make()
    seqs = opened(m)
    k = torch.zeros(3, 4, 2, 64, dtype=torch.float16)
    q = torch.zeros(3, 4, 4, 64, dtype=torch.float16)
    with pytest.raises(InputError, match="k must have shape"):
        m.append_chunk(seqs, 0, k[:2], k[:2])
    with pytest.raises(InputError, match="differ in shape"):
        m.append_chunk(seqs, 0, k, k[:, :2])
    with pytest.raises(InputError, match="counts must be 3 integers in"):
        m.append_chunk(seqs, 0, k, k, [4, 5, 0])
    with pytest.raises(InputError, match="counts must be 3 integers in"):
        m.attend_chunk(seqs, 0, q, [1, 1])
    with pytest.raises(InputError, match="q must have shape"):
        m.attend_chunk(seqs, 0, q[..., :32])
    with pytest.raises(InputError, match="holds 16 positions"):
        m.attend_chunk(seqs, 0, torch.zeros(3, 17, 4, 64, dtype=torch.float16))
    assert [m.length(s) for s in seqs] == list(LENGTHS)


def sharing_rows(m):
    """Row a writes 32 tokens and publishes them; row b opens on the same prompt, sharing a's
    two pages. Returns a, b and a's K, V."""
    prompt = list(range(32))
    k, v = outlier_kv(32, 2, 64, seed=3)
    a = m.open(Subject("acme", "u0", "s0"), tokens=prompt)
    for layer in range(2):
        assert m.append(a, layer, k, v)
    assert m.publish_prefix(a, prompt) == 2
    b = m.open(Subject("acme", "u1", "s1"), tokens=prompt)
    return a, b, k, v


def test_rows_that_share_prefix_pages_quantize_them_once_together(monkeypatch):
    # two rows share a published page; one chunk pushes it and a page of each row's own out of the
    # 16-bit window: one quantizing write per layer for all three pages, the shared page once and
    # still shared, and every row reads what rows quantized apart would read
    m, ref = make(num_pages=64), make(num_pages=64)
    a, b, k, v = sharing_rows(m)
    assert m.length(b) == 32
    shared = int(m._seq(b).pages[1].page)
    writes = []
    write = m.pools[MAIN].write
    monkeypatch.setattr(m.pools[MAIN], "write", lambda layer, pages, values: (writes.append(list(pages)),
                                                                              write(layer, pages, values))[1])
    kn, vn = outlier_kv(64, 2, 64, seed=4)
    for layer in range(2):
        assert m.append_chunk([a, b], layer, kn.reshape(2, 32, 2, 64), vn.reshape(2, 32, 2, 64))
    assert len(writes) == 2 and all(len(w) == 3 for w in writes)
    pa, pb = m._seq(a).pages, m._seq(b).pages
    assert pa[1] == pb[1] and pa[1].where == MAIN and m.pools[MAIN].ref[int(pa[1].page)] == 2
    assert pa[2].where == pb[2].where == MAIN and pa[2] != pb[2]
    assert m.pools[HOT].ref[shared] == 0 and not any(t[shared].view(torch.uint8).any()
                                                      for layer in m.pools[HOT].fields for t in layer.values())
    for i, seq in enumerate((a, b)):
        r = ref.open(Subject("acme", f"r{i}", f"r{i}"))
        for layer in range(2):
            assert ref.append(r, layer, k, v) and ref.append(r, layer, kn[32 * i: 32 * i + 32], vn[32 * i: 32 * i + 32])
        for layer in range(2):
            assert all(torch.equal(x, y) for x, y in zip(m.kv(seq, layer), ref.kv(r, layer)))


def test_a_shared_page_quantized_by_one_sharer_is_shared_by_the_next():
    # two sequences share a published 16-bit page and leave the window on different steps: the
    # second takes the first's codec copy instead of quantizing one of its own
    m = make(num_pages=64)
    a, b, _, _ = sharing_rows(m)
    kn, vn = outlier_kv(32, 2, 64, seed=4)
    for seq in (a, b):
        for layer in range(2):
            assert m.append(seq, layer, kn, vn)
    pa, pb = m._seq(a).pages, m._seq(b).pages
    assert pa[1] == pb[1] and pa[1].where == MAIN and m.pools[MAIN].ref[int(pa[1].page)] == 2
    assert pa[2].where == pb[2].where == MAIN and m.pools[MAIN].used_count == 3  # page 1 once, each row's page 2
    assert m.pools[HOT].ref[int(m._seq(b).pages[0].page)] == 2  # the sink page, shared and still 16-bit
