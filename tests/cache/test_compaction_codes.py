"""Compaction adds no error where the layout allows: survivors keep their codes and scales."""

from __future__ import annotations

import pytest
import torch

from kvguard.cache import CacheConfig, CacheManager
from tests.conftest import outlier_kv


@pytest.mark.parametrize("codec", ["int8", "int4"])
def test_survivors_keep_their_codes_through_a_compaction(codec, alice):
    """Each KV head evicts a token of page 1, the largest key of many channels there, and all
    but one token of page 3. Codec pages 1-3 become 1-2: pages 1 and 2 keep their
    survivors and page 1's scales, and page 3's last survivor (small keys, they fit) fills page
    1's hole. Every survivor's value, and every key but that one's, decodes exactly as before.
    Requantizing the regrouped survivors (in position order, from 16-bit) rescaled page 1."""
    cfg = CacheConfig(num_layers=1, num_kv_heads=2, head_dim=64, num_pages=16, codec=codec, fp_sink=4,
                      fp_window=16, evictor="h2o", evictor_options={"budget": 64, "sink": 4, "window": 16},
                      auto_compact=False)
    m = CacheManager(cfg)
    seq = m.open(alice)
    k, v = outlier_kv(80, 2, 64, seed=21)
    k[16, 0] *= 2.0  # the token each head evicts from page 1
    k[17, 1] *= 2.0
    k[48:64] *= 0.25
    assert m.append(seq, 0, k, v)
    assert [r.where for r in m._seq(seq).pages] == ["hot", "main", "main", "main", "hot"]
    before_k, before_v = m.kv(seq, 0, torch.float32)
    s = m._seq(seq)
    s.mass_buf[..., :80] = 1.0
    s.mass_buf[0, 0, [16, *range(48, 63)]] = 0.0  # head 0 keeps 63 of page 3
    s.mass_buf[0, 1, [17, *range(49, 64)]] = 0.0  # head 1 keeps 48
    assert m.compact(seq).kept == 64
    assert [r.where for r in m._seq(seq).pages] == ["hot", "main", "main", "hot"]
    after_k, after_v = m.kv(seq, 0, torch.float32)
    for h, donor in ((0, 63), (1, 48)):
        # which token each codec slot holds: the nearest value (values are distinct random vectors)
        pos = torch.cdist(after_v[h, 16:48], before_v[h]).argmin(1)
        assert sorted(pos.tolist()) == sorted(set(range(16, 64)) - {16 + h} - set(range(48 + h, 63 + h)) | {donor})
        assert torch.equal(after_v[h, 16:48], before_v[h, pos])
        same = (after_k[h, 16:48] == before_k[h, pos]).all(-1)
        assert same[pos != donor].all(), f"head {h}: {(~same[pos != donor]).sum()} survivors' keys changed"


def test_whole_pages_go_first_then_single_tokens():
    """granularity page: of the slots between the sinks and the window, the page-aligned runs of
    page_size slots with the least summed score go first, as many as fit what must go; the rest
    is single tokens, the lowest of what is left."""
    from kvguard.compress.evictors import make_evictor

    e = make_evictor("h2o", budget=40, sink=4, window=8, granularity="page")
    mass = torch.rand(2, 3, 70) + 1.0
    mass[0, 0, 16:32] = 0.5  # page 1: the least mass of head (0, 0), though not its lowest tokens
    mass[0, 0, 40] = 0.01
    mass[1, 2, 32:48] = 0.1  # page 2 of head (1, 2)
    keep = e.select(70, mass, page_size=16)
    assert keep.shape == (2, 3, 40)
    for layer in range(2):
        for head in range(3):
            gone = sorted(set(range(70)) - set(keep[layer, head].tolist()))
            assert len(gone) == 30 and all(4 <= t < 62 for t in gone)
            pages = [p for p in range(4) if all(t in gone for t in range(p * 16, p * 16 + 16))]
            assert len(pages) == 1  # one whole page (30 // 16), then 14 single tokens
            if (layer, head) == (0, 0):
                assert pages == [1] and 40 not in keep[0, 0]  # the page, then the lowest token
            if (layer, head) == (1, 2):
                assert pages == [2]
    with pytest.raises(ValueError, match="granularity"):
        make_evictor("streamingllm", budget=40, sink=4, granularity="page")
    with pytest.raises(ValueError, match="granularity"):
        make_evictor("h2o", budget=40, sink=4, window=8, granularity="pages")


@pytest.mark.parametrize("codec", ["int8", "fp8", "int4"])
def test_dropping_whole_pages_requantizes_nothing_over_a_long_session(codec, alice):
    """H2O per head with granularity page, compacting each time the sequence passes its budget by
    a page, 12 times: every token held in codec pages decodes exactly as it did when first
    encoded (each page's codes and scales move whole), where dropping single tokens does not."""
    from kvguard.kernels import quantize as ref

    def run(granularity):
        cfg = CacheConfig(num_layers=2, num_kv_heads=2, head_dim=64, num_pages=64, codec=codec, fp_sink=4,
                          fp_window=16, evictor="h2o", auto_compact=False,
                          evictor_options={"budget": 96, "sink": 4, "window": 16, "granularity": granularity})
        m = CacheManager(cfg)
        seq = m.open(alice)
        k, v = outlier_kv(96 + 12 * 16, 2, 64, seed=5)
        g = torch.Generator().manual_seed(6)
        ids = torch.zeros(2, 2, 0, dtype=torch.long)  # the position each slot holds, per layer and head
        chosen = {}
        select = m.evictor.select
        m.evictor.select = lambda *a, **kw: chosen.setdefault("keep", select(*a, **kw))
        arrange = m.compactor.arrange
        m.compactor.arrange = lambda *a, **kw: chosen.__setitem__("keep", arrange(*a, **kw)) or chosen["keep"]
        lo = 0
        for _ in range(13):
            hi = 96 if lo == 0 else lo + 16
            for layer in range(2):
                assert m.append(seq, layer, k[lo:hi], v[lo:hi])
                m.attend(seq, layer, torch.randn(hi - lo, 2, 64, generator=g))
            ids = torch.cat([ids, torch.arange(lo, hi).expand(2, 2, -1)], -1)
            lo = hi
            if m.length(seq) >= 96 + 16:
                chosen.clear()
                assert m.compact(seq) is not None
                ids = ids.gather(-1, chosen["keep"])
        pages = [r.where == "main" for r in m._seq(seq).pages]
        main = torch.tensor(pages).repeat_interleave(16)[: ids.shape[-1]]
        n = k.shape[0] // 16 * 16
        once_k, _ = ref.decode_pages(m.codec.encode(k[:n].reshape(-1, 16, 2, 64).transpose(1, 2),
                                                    v[:n].reshape(-1, 16, 2, 64).transpose(1, 2)))
        once_k = once_k.transpose(1, 2).reshape(-1, 2, 64)
        same = []
        for layer in range(2):
            stored, _ = m.kv(seq, layer, torch.float32)
            for h in range(2):
                idx = ids[layer, h][main]
                same.append(torch.equal(stored[h][main], once_k[idx, h]))
        assert main.sum() >= 48  # codec pages held, several compactions' survivors among them
        return all(same)

    assert run("page")
    assert not run("token")
