"""The K/V split with its keys in a smaller codec (kv_split.keys): INT4 keys beside INT8 values."""

from __future__ import annotations

import pytest
import torch
from kvguard.kernels import quantize as ref

from kvguard.cache import CacheConfig, CacheManager
from kvguard.cache import events as ev
from kvguard.cache.attention import dense_attention
from kvguard.errors import ConfigError
from kvguard.policy.schema import KvSplit, split_key
from kvguard.types import Subject

SUBJECT = Subject("acme", "alice", "s1")
L, H, HQ, D, S, N = 2, 2, 4, 32, 16, 200


def make(split: dict | None, codec: str = "int8") -> CacheManager:
    return CacheManager(CacheConfig(num_layers=L, num_kv_heads=H, head_dim=D, num_query_heads=HQ, page_size=S,
                                    num_pages=64, dtype=torch.float32, codec=codec, fp_sink=0, fp_window=16,
                                    kv_split=split))


def filled(m: CacheManager):
    g = torch.Generator().manual_seed(0)
    k, v = torch.randn(L, N, H, D, generator=g), torch.randn(L, N, H, D, generator=g)
    k[..., 3] *= 8  # an outlier channel, as real keys have
    seq = m.open(SUBJECT)
    for layer in range(L):
        assert m.append(seq, layer, k[layer], v[layer])
    return seq


def test_every_page_read_is_attention_over_the_int4_keys_and_int8_values():
    """With every page read, the split's answer is full attention over the keys it holds: those of
    the pages it took in encoded in INT4 from their INT8 codes, the others as the cache without the
    split holds them; the values are the INT8 ones."""
    plain, split = make(None), make({"window": 32, "fraction": 1.0, "keys": "int4"})
    a, b = filled(plain), filled(split)
    assert split.split_cold(b) == (N - 32) // S
    cold = [i for i, r in enumerate(split.seqs.get(b).pages) if r.where == "split"]
    assert len(cold) == (N - 32) // S
    for layer in range(L):
        k, v = plain.kv(a, layer)  # [H, N, D], INT8 pages dequantized (and the 16-bit window)
        want_k = k.clone()
        pages = k[:, : (cold[-1] + 1) * S].reshape(H, -1, S, D).transpose(0, 1)  # [pages, H, S, D]
        f = ref.encode_int4(pages, pages)
        want_k[:, : (cold[-1] + 1) * S] = ref.decode_keys(f).transpose(0, 1).reshape(H, -1, D)
        q = torch.randn(3, HQ, D, generator=torch.Generator().manual_seed(layer))
        want, _ = dense_attention(q, want_k, v, causal=False)
        torch.testing.assert_close(split.attend(b, layer, q, causal=False), want, rtol=1e-5, atol=1e-5)
        assert not torch.equal(want_k, k)  # the INT4 keys do differ from the INT8 ones


def test_the_device_keeps_fewer_bytes_and_the_recoding_is_recorded():
    m = make({"window": 32, "top_k": 2, "keys": "int4"})
    split, main = m.pools["split"], m.pools["main"]
    assert {n: t.dtype for n, t in split._stacks.items()} == {
        "k": torch.uint8, "k_scale": torch.float16, "k_zero": torch.float16, "v": torch.int8,
        "v_scale": torch.float16}
    key_bytes = split.page_bytes - split.value_bytes()
    assert key_bytes / (main.page_bytes - main.value_bytes()) == 384 / 576  # a page-head: 256 + 2 * 64 vs 512 + 64
    assert split.value_bytes() == main.value_bytes()
    seq = filled(m)
    assert m.split_cold(seq) > 0
    got = m.events.take_events()
    (recode,) = [e for e in got if isinstance(e, ev.PagesQuantized) and e.fields]
    (off,) = [e for e in got if isinstance(e, ev.PagesOffloaded)]
    assert recode.details()["fields"] == ["k"] and recode.codec == "int4" and recode.pages == off.pages
    n = len(off.pages)
    assert (recode.bytes, recode.bytes_before) == (n * key_bytes, n * (main.page_bytes - main.value_bytes()))
    assert got.index(recode) < got.index(off)
    # whole pages back on the device (what compaction and `kv` need): keys in INT8 again, recorded too
    m.kv(seq, 0)
    back = m.events.take_events()
    (fetch,) = [e for e in back if isinstance(e, ev.PagesFetched)]
    (requant,) = [e for e in back if isinstance(e, ev.PagesQuantized)]
    assert requant.codec == "int8" and requant.fields == ("k",) and len(requant.pages) == len(fetch.pages) == n
    assert all(p.startswith("main:") for p in requant.pages) and split.used_count == 0


def test_erasure_overwrites_the_int4_keys_and_the_values():
    m = make({"window": 32, "top_k": 2, "keys": "int4"})
    seq = filled(m)
    assert m.split_cold(seq) > 0
    assert m.pools["split"]._stacks["k"].any() and m.pools["split"]._stacks["v"].any()
    m.free(seq)
    for pool in m.pools.values():
        for t in pool._stacks.values():
            assert not t.view(torch.uint8).any()


def test_the_16bit_cache_may_split_int4_keys_too():
    m = make({"window": 32, "fraction": 1.0, "keys": "int4"}, codec="fp16")
    seq = filled(m)
    assert m.split_cold(seq) > 0
    assert m.pools["split"]._stacks["v"].dtype == torch.float32 and m.pools["split"]._stacks["k"].dtype == torch.uint8
    out = m.attend(seq, 0, torch.randn(1, HQ, D))
    assert torch.isfinite(out).all()


def test_keys_are_checked():
    for bad in ("int2", "fp16", 4):
        with pytest.raises(ConfigError, match="keys"):
            make({"window": 32, "top_k": 2, "keys": bad})
    same = make({"window": 32, "top_k": 2, "keys": "int8"})  # the cache's codec: nothing to recode
    assert same.pools["split"].codec == same.pools["main"].codec
    policy = KvSplit(window=128, fraction=0.05, keys="int4")
    assert policy.options() == {"window": 128, "fraction": 0.05, "keys": "int4"}
    assert split_key(policy.options()) == "kvsplit@5%/w128/k-int4"
    with pytest.raises(ValueError):
        KvSplit(window=128, fraction=0.05, keys="int3")


def test_int4_key_pages_go_to_a_lower_tier_and_come_back_as_they_were():
    from kvguard.cache.tiers import CpuTier

    m = CacheManager(CacheConfig(num_layers=L, num_kv_heads=H, head_dim=D, num_query_heads=HQ, page_size=S,
                                 num_pages=64, dtype=torch.float32, codec="int8", fp_sink=0, fp_window=16,
                                 kv_split={"window": 32, "fraction": 1.0, "keys": "int4"}),
                     tiers={"cpu": CpuTier()})
    seq = filled(m)
    assert m.split_cold(seq) > 0
    q = torch.randn(2, HQ, D, generator=torch.Generator().manual_seed(3))
    before = m.attend(seq, 1, q, causal=False)
    assert m.offload(seq, "cpu") > 0 and m.pools["split"].used_count == 0
    assert torch.equal(m.attend(seq, 1, q, causal=False), before)  # fetched back into the split's pool
    assert m.pools["split"].used_count > 0


def test_streamingllm_compaction_keeps_int4_key_pages_in_the_split_and_recodes_what_comes_home():
    """StreamingLLM drops a page's worth each time: split pages after the sinks move whole (their INT4
    keys unchanged); the pages a new 16-bit page is made from come home first, their keys back in INT8
    (a quantize record of their keys), and the answers stay the split's own over the kept tokens."""
    m = CacheManager(CacheConfig(num_layers=L, num_kv_heads=H, head_dim=D, num_query_heads=HQ, page_size=S,
                                 num_pages=64, dtype=torch.float32, codec="int8", fp_sink=0, fp_window=16,
                                 evictor="streamingllm", evictor_options={"budget": 184, "sink": 2},
                                 kv_split={"window": 32, "fraction": 1.0, "keys": "int4"}))
    seq = filled(m)  # 200 tokens: a page past the budget, compacted at the next step
    assert m.split_cold(seq) > 0
    kept = {r.page: m.pools["split"].fields[0]["k"][r.page].clone()
            for r in m.seqs.get(seq).pages if r.where == "split"}
    m.events.take_events()
    g = torch.Generator().manual_seed(4)
    for _ in range(2 * S):
        k, v = torch.randn(2, L, 1, H, D, generator=g)
        for layer in range(L):
            m.append_step([seq], layer, k[layer], v[layer])
            assert torch.isfinite(m.attend_step([seq], layer, torch.randn(1, HQ, D, generator=g))).all()
    events = m.events.take_events()
    evicted = [e.kept for e in events if isinstance(e, ev.TokensEvicted)]
    assert len(evicted) >= 2 and set(evicted) == {184}
    home = [e for e in events if isinstance(e, ev.PagesQuantized) and e.fields == ("k",) and e.codec == "int8"]
    assert home and all(p.startswith("main:") for e in home for p in e.pages)
    still = [r.page for r in m.seqs.get(seq).pages if r.where == "split" and r.page in kept]
    assert still and all(torch.equal(m.pools["split"].fields[0]["k"][p], kept[p]) for p in still)
