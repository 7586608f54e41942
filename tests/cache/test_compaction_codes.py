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
