"""The K/V split tier: keys on the device, cold values in CPU memory, fetched by score."""

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
    assert any(r.where == "main" and r.values for r in split.seqs.get(b).pages)  # int8 values in the store
    for layer in range(L):
        q = query(7 + layer, t=3)
        assert torch.equal(split.attend(b, layer, q), plain.attend(a, layer, q))


def hand(q, k, v, cold: list[int], pick):
    """The split's answer computed by hand: softmax over every key; of the cold pages, those that
    `pick` chooses by their largest mass over query heads keep their values, the others
    contribute nothing (their weight stays in the softmax)."""
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


@pytest.mark.parametrize("rule, pick", [
    ({"fraction": 0.25}, lambda mass: mass.topk(2).indices.tolist()),  # ceil(0.25 * 8 cold pages) = 2
    ({"mass": 0.05}, lambda mass: (mass >= 0.05).nonzero().flatten().tolist()),
    ({"mass": 0.999}, lambda mass: []),  # no page holds that much: the window's values alone
])
def test_fraction_and_mass_threshold_pick_as_said(rule, pick):
    m = make({"window": 8, **rule})
    seq, k, v = filled(m)
    m.split_cold(seq)
    q = query(3)
    got = m.attend(seq, 0, q)
    want, skipped = hand(q, k[0], v[0], list(range(8)), pick)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    assert m.split.last_read == pytest.approx((N - len(skipped) * S) / N)


def test_offload_and_fetch_events_name_the_values():
    m = make({"window": 8, "top_k": 2})
    seq, k, v = filled(m)
    m.split_cold(seq)
    (off,) = m.events.take_events()
    assert isinstance(off, ev.PagesOffloaded) and off.fields == ("v",) and off.dst == "cpu"
    assert off.pages == tuple(f"hot:{i}" for i in range(8)) and off.n_tokens == 32
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
    assert not m.split.values.keys()


def test_whole_page_moves_keep_their_records_as_they_were():
    m = make(None)
    seq, _, _ = filled(m)
    m.offload(seq, "cpu", 2)
    (off,) = m.events.take_events()
    assert "fields" not in off.details() and off.fields == ()


def test_split_pages_are_neither_offloaded_whole_nor_shared():
    m = make({"window": 8, "top_k": 1})
    seq, _, _ = filled(m)
    m.split_cold(seq)
    assert m.publish_prefix(seq, list(range(N))) == 2  # the window's full pages only
    assert m.offload(seq, "cpu") == 2  # the same: the older pages' values are away already
    assert m.stats().pages_offloaded == {VALUES: 8, "cpu": 2}


def test_a_16bit_page_whose_values_are_away_is_not_quantized():
    m = make({"window": 0, "top_k": 1}, codec="int8", fp_window=16)
    seq, k, v = filled(m)
    assert m.split_cold(seq) == N // S  # the 16-bit window's pages too (window 0)
    g = torch.Generator().manual_seed(4)
    k2, v2 = torch.randn(L, 8, H, D, generator=g), torch.randn(L, 8, H, D, generator=g)
    for layer in range(L):
        assert m.append(seq, layer, k2[layer], v2[layer])
    pages = m.seqs.get(seq).pages
    assert [r.where for r in pages[6:8]] == ["hot", "hot"]  # left the 16-bit window, values away: kept
    _, vv = m.kv(seq, 0)
    assert torch.equal(vv[:, 24:40], v[0, 24:40].transpose(0, 1))  # 16-bit values back as they were


def test_writes_split_at_each_steps_first_layer_and_prefetch_gives_the_same_answer():
    plain, m = make(None), make({"window": 8, "top_k": 1000})
    a, _, _ = filled(plain)
    b, _, _ = filled(m)
    m.split.prefetch = True  # the CUDA path's fetch-ahead, here synchronous
    g = torch.Generator().manual_seed(5)
    for _ in range(6):  # decode steps
        k, v, q = torch.randn(L, 1, H, D, generator=g), torch.randn(L, 1, H, D, generator=g), torch.randn(L, 1, HQ, D,
                                                                                                        generator=g)
        for layer in range(L):
            for mm, s in ((plain, a), (m, b)):
                assert mm.append(s, layer, k[layer], v[layer])
            assert torch.equal(m.attend(b, layer, q[layer]), plain.attend(a, layer, q[layer]))
    assert sum(r.values is not None for r in m.seqs.get(b).pages) == (N + 6 - 8) // S


@pytest.mark.parametrize("how", ["session", "user", "free"])
def test_erasure_leaves_neither_keys_nor_values(how):
    m = make({"window": 8, "top_k": 2}, codec="int8")
    other = m.open(Subject("acme", "bob", "s2"))
    seq, _, _ = filled(m)
    m.attend(seq, 0, query(1))  # a read left half done: its fetch is reported before the erasure
    assert m.split_cold(seq) > 0
    stored = [t for key in m.split.values.keys() for t in m.split.values.get(key).values()]
    assert stored and any(t.abs().sum() > 0 for t in stored)
    m.events.take_events()
    if how == "session":
        event = m.erase_session("acme", "s1")
    elif how == "user":
        event = m.erase_user("acme", "alice")
    else:
        m.free(seq)
        event = m.events.take_events()[-1]
    assert event.tier_copies == 8
    assert not m.split.values.keys()  # the CPU value store holds nothing of it
    assert all(not t.any() for t in stored)  # and what it held was overwritten
    for pool in m.pools.values():  # nor do the device pages: the keys are overwritten too
        for t in pool._stacks.values():
            assert not t.view(torch.uint8).any()
    assert m.sequences() == [other]


def test_config_checks():
    for bad in ({"window": 8}, {"top_k": 2, "fraction": 0.5}, {"top_k": 0}, {"fraction": 1.5}, {"mass": 1.0},
                {"window": -1, "top_k": 1}, {"top_k": 1, "bogus": 1}):
        with pytest.raises(ConfigError):
            make(bad)
    m = make(None)
    with pytest.raises(ConfigError, match="no K/V split"):
        m.split_cold(m.open(SUBJECT))


def test_on_the_kernel_path_a_split_sequence_is_read_through_the_split():
    """A batch step or chunk of a cache on the kernel path reads a split row through the split
    (the kernels read values in place): no kernel runs here, the answer is full attention's."""
    m = make({"window": 8, "top_k": 1000}, dtype=torch.float16, use_kernels=True)
    seq, k, v = filled(m)
    m.split_cold(seq)
    q = query(2).half()
    ref, _ = dense_attention(q, k[0].half().transpose(0, 1), v[0].half().transpose(0, 1))
    torch.testing.assert_close(m.attend_step([seq], 0, q), ref, rtol=1e-3, atol=1e-3)
    chunk = query(3, t=2).half()
    ref, _ = dense_attention(chunk, k[1].half().transpose(0, 1), v[1].half().transpose(0, 1))
    torch.testing.assert_close(m.attend_chunk([seq], 1, chunk[None])[0], ref, rtol=1e-3, atol=1e-3)


def test_a_static_decode_step_refuses_a_split_cache():
    from kvguard.cache.step import StaticStep

    m = make({"window": 8, "top_k": 2}, dtype=torch.float16, use_kernels=True)
    seq, _, _ = filled(m)
    with pytest.raises(ConfigError, match="decodes eagerly"):
        StaticStep(m, [seq], 64)
