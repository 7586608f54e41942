"""The probe's deviation against an independent computation of ||O' - O|| / ||O||."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from kvguard.cache.attention import dense_attention
from kvguard.eval.probe import ProbeCache

from ..conftest import outlier_kv

CONFIG = SimpleNamespace(num_attention_heads=4, num_key_value_heads=2, head_dim=64, hidden_size=256,
                         num_hidden_layers=2, _attn_implementation="kvguard")


def step(cache, layer, q, k, v):
    """One layer's call as the attention function makes it: [1, H, T, D] tensors."""
    key, value = k.transpose(0, 1)[None], v.transpose(0, 1)[None]
    cache.layers[layer].update(key, value)
    return cache.attend(layer, q.transpose(0, 1)[None], key, value, None, None)[0]


def test_deviation_is_the_relative_error_of_the_attention_output(alice):
    # 64 prefix tokens fill pages 0-3, quantized once the last layer has them; the 8
    # scored tokens stay in the partly filled 16-bit page 4, as a decode step's own page does
    k, v = outlier_kv(72, 2, 64, seed=1, dtype=torch.float32)
    q = torch.randn(72, 4, 64, generator=torch.Generator().manual_seed(2))
    cache = ProbeCache(CONFIG, alice, codec="int8", num_pages=16, dtype=torch.float16)
    for layer in range(2):
        step(cache, layer, q[:64], k[:64], v[:64])  # the prefix: not scored
    cache.scoring = True
    outs = [step(cache, layer, q[64:], k[64:] * (layer + 1), v[64:]) for layer in range(2)]

    for layer, out in enumerate(outs):
        kk = torch.cat([k[:64], k[64:] * (layer + 1)]).half().transpose(0, 1)  # [H, L, D]
        vv = v.half().transpose(0, 1)
        want_ref, _ = dense_attention(q[64:], kk, vv)
        pk, pv = cache.manager.kv(cache.seqs[0], layer, dtype=torch.float32)  # what int8 pages hold
        want_out, _ = dense_attention(q[64:], pk, pv)
        torch.testing.assert_close(out, want_out)
        want = ((want_out - want_ref).norm() / want_ref.norm()).item()
        assert cache.deviation()[layer] == pytest.approx(want, rel=1e-6)
        assert 1e-4 < want < 0.05  # int8 is close, and not exact


def test_uncompressed_pages_deviate_by_exactly_zero(alice):
    k, v = outlier_kv(48, 2, 64, seed=3, dtype=torch.float32)
    q = torch.randn(48, 4, 64)
    cache = ProbeCache(CONFIG, alice, codec="fp16", num_pages=8, dtype=torch.float16)
    cache.scoring = True
    for layer in range(2):
        step(cache, layer, q, k, v)
    assert cache.deviation() == [0.0, 0.0]


def headwise_run(alice, merge: bool):
    """A HeadwiseCache (H2O per head, budget 24) given a 64-token prefix in 2 layers, then 8 scored
    tokens in layer 0: (q, k, v, the cache, the scored tokens' output)."""
    from kvguard.eval.headwise import HeadwiseCache

    k, v = outlier_kv(72, 2, 64, seed=5, dtype=torch.float32)
    q = torch.randn(72, 4, 64, generator=torch.Generator().manual_seed(6))
    spec = {"name": "h2o", "budget": 24, "sink": 4, "window": 8}
    cache = HeadwiseCache(CONFIG, alice, evictor=spec, merge=merge, num_pages=16, dtype=torch.float32)
    for layer in range(2):
        step(cache, layer, q[:64], k[:64], v[:64])  # the prefix, attended in full
    cache.scoring = True
    return q, k, v, cache, step(cache, 0, q[64:], k[64:], v[64:])


def prefix_mass(q, k, v):
    """Independently of the cache: k, v as [H, L, D] and each KV head's mass over the 64-token prefix [H, 64]."""
    kk, vv = k.transpose(0, 1), v.transpose(0, 1)
    qh = q[:64].reshape(64, 2, 2, 64).permute(1, 2, 0, 3)
    scores = torch.einsum("hgtd,hld->hgtl", qh, kk[:, :64]) / 8.0
    scores = scores.masked_fill(torch.ones(64, 64, dtype=torch.bool).triu(1), float("-inf"))
    return kk, vv, torch.softmax(scores, -1).sum((1, 2))


def test_headwise_heads_read_what_their_own_mass_keeps(alice):
    from kvguard.compress.evictors import make_evictor

    q, k, v, cache, out = headwise_run(alice, merge=False)
    # independently: each KV head's mass over the prefix, the evictor's choice per head
    kk, vv, mass = prefix_mass(q, k, v)
    evictor = make_evictor("h2o", budget=24, sink=4, window=8)
    for h in range(2):
        keep = torch.cat([evictor.select(64, mass[h]), torch.arange(64, 72)])
        want, _ = dense_attention(q[64:, 2 * h : 2 * h + 2], kk[h : h + 1, keep], vv[h : h + 1, keep])
        torch.testing.assert_close(out[:, 2 * h : 2 * h + 2], want, atol=1e-5, rtol=1e-4)
    assert cache.read and cache.read[0] < 0.5


def test_headwise_merge_reads_the_kept_tokens_with_the_evicted_values_merged_in(alice):
    from kvguard.compress.evictors import make_evictor
    from kvguard.eval.headwise import merge_values

    q, k, v, _, out = headwise_run(alice, merge=True)
    kk, vv, mass = prefix_mass(q, k, v)
    evictor = make_evictor("h2o", budget=24, sink=4, window=8)
    keep = torch.zeros(2, 64, dtype=torch.bool)
    for h in range(2):
        keep[h, evictor.select(64, mass[h])] = True
    merged = merge_values(kk[:, :64], vv[:, :64], mass, keep)
    for h in range(2):
        idx = torch.cat([keep[h].nonzero().flatten(), torch.arange(64, 72)])
        values = torch.cat([merged[h], vv[h, 64:]])[idx]
        want, _ = dense_attention(q[64:, 2 * h : 2 * h + 2], kk[h : h + 1, idx], values[None])
        torch.testing.assert_close(out[:, 2 * h : 2 * h + 2], want, atol=1e-5, rtol=1e-4)
    assert not torch.allclose(merged[keep], vv[:, :64][keep])  # something was merged


@pytest.mark.parametrize("scoring", ["mass", "value_aware"])
def test_headwise_simulation_matches_the_cache_that_evicts(alice, scoring):
    """The read-time simulation of a uniform budget reads exactly what the cache's own
    per-head compaction keeps, value-aware scoring included (its norms from the pages)."""
    from kvguard.eval.headwise import HeadwiseCache

    k, v = outlier_kv(72, 2, 64, seed=7, dtype=torch.float32)
    v[20:40] *= 8  # large values in the middle: value-aware scoring chooses differently
    q = torch.randn(72, 4, 64, generator=torch.Generator().manual_seed(8))
    spec = {"budget": 24, "sink": 4, "window": 8, "scoring": scoring}
    sim = HeadwiseCache(CONFIG, alice, evictor={"name": "h2o", **spec}, num_pages=16, dtype=torch.float32)
    real = ProbeCache(CONFIG, alice, evictor="h2o", evictor_options=spec, auto_compact=False, num_pages=16,
                      dtype=torch.float32)
    for layer in range(2):
        step(sim, layer, q[:64], k[:64], v[:64])
        step(real, layer, q[:64], k[:64], v[:64])
    assert real.manager.compact(real.seqs[0]).kept == 24
    sim.scoring = real.scoring = True
    for layer in range(2):
        torch.testing.assert_close(step(sim, layer, q[64:], k[64:], v[64:]), step(real, layer, q[64:], k[64:], v[64:]),
                                   atol=1e-5, rtol=1e-4)
    assert sim.deviation() == pytest.approx(real.deviation(), rel=1e-4)
    assert min(sim.deviation()) > 0


def test_headwise_evicts_in_global_layers_and_a_window_layer_keeps_its_window(alice):
    """Gemma 3's layout: layer 0 a 32-token sliding window, layer 1 global. Per-head H2O acts on
    layer 1 alone; layer 0 reads what the cache holds of its window, as without an evictor."""
    from kvguard.eval.headwise import HeadwiseCache

    config = SimpleNamespace(**vars(CONFIG), layer_types=["sliding_attention", "full_attention"], sliding_window=32)
    k, v = outlier_kv(72, 2, 64, seed=7, dtype=torch.float32)
    q = torch.randn(72, 4, 64, generator=torch.Generator().manual_seed(8))
    spec = {"name": "h2o", "budget": 24, "sink": 4, "window": 8}
    outs = {}
    for name, cache in (("plain", ProbeCache(config, alice, num_pages=16, dtype=torch.float32)),
                        ("h2o", HeadwiseCache(config, alice, evictor=spec, num_pages=16, dtype=torch.float32))):
        for layer in range(2):
            step(cache, layer, q[:64], k[:64], v[:64])
        cache.scoring = True
        outs[name] = [step(cache, layer, q[64:], k[64:], v[64:]) for layer in range(2)]
        if name == "h2o":
            assert cache.read[0] == 1.0 and cache.read[1] < 0.5, cache.read  # the window layer reads all
    torch.testing.assert_close(outs["h2o"][0], outs["plain"][0])
    assert not torch.allclose(outs["h2o"][1], outs["plain"][1], atol=1e-3)
