"""The K/V split with the cache's keys kept in host memory too (kv_split.host_keys): the device's
INT4 keys pick the pages, and a query attends over those it read with their INT8 keys."""

from __future__ import annotations

import pytest
import torch
from kvguard.kernels import quantize as ref

from kvguard.cache import CacheConfig, CacheManager
from kvguard.cache import events as ev
from kvguard.cache.attention import block_scores
from kvguard.cache.tiers import CpuTier
from kvguard.errors import ConfigError
from kvguard.policy.schema import KvSplit, split_key
from kvguard.types import Subject

SUBJECT = Subject("acme", "alice", "s1")
L, H, HQ, D, S, N, W = 2, 2, 4, 32, 16, 200, 32
HOST = {"keys": "int4", "host_keys": True}


def make(split: dict | None, dtype=torch.float32, kernels: bool = False) -> CacheManager:
    return CacheManager(CacheConfig(num_layers=L, num_kv_heads=H, head_dim=D, num_query_heads=HQ, page_size=S,
                                    num_pages=64, dtype=dtype, codec="int8", fp_sink=0, fp_window=16,
                                    use_kernels=kernels, kv_split=split), tiers={"cpu": CpuTier()})


def filled(m: CacheManager, dtype=torch.float32):
    g = torch.Generator().manual_seed(0)
    k, v = torch.randn(L, N, H, D, generator=g), torch.randn(L, N, H, D, generator=g)
    k[..., 3] *= 8  # an outlier channel, as real keys have
    k[:, 40:56] *= 2.5  # a page that draws attention
    seq = m.open(SUBJECT)
    for layer in range(L):
        assert m.append(seq, layer, k[layer].to(dtype), v[layer].to(dtype))
    return seq


def test_every_page_read_is_the_cache_without_the_split():
    """Read in full, the split answers as the INT8 cache does: the INT4 keys only pick."""
    plain, split = make(None), make({"window": W, "fraction": 1.0} | HOST)
    a, b = filled(plain), filled(split)
    assert split.split_cold(b) == (N - W) // S
    g = torch.Generator().manual_seed(1)
    for layer in range(L):
        q = torch.randn(3, HQ, D, generator=g)
        torch.testing.assert_close(split.attend(b, layer, q, causal=False), plain.attend(a, layer, q, causal=False),
                                   rtol=1e-5, atol=1e-5)


def test_the_int4_keys_pick_and_the_int8_keys_attend():
    """An independent computation: each query's pages by the softmax over the INT4 keys (the
    largest share over its query heads), then its softmax over the window's and the picked pages'
    INT8 keys."""
    plain, split = make(None), make({"window": W, "top_k": 2} | HOST)
    a, b = filled(plain), filled(split)
    cold = split.split_cold(b)
    g = torch.Generator().manual_seed(2)
    for layer in range(L):
        k8, v = plain.kv(a, layer)  # [H, N, D]
        pages = k8[:, : cold * S].reshape(H, cold, S, D).transpose(0, 1)
        k4 = k8.clone()
        k4[:, : cold * S] = ref.decode_keys(ref.encode_int4(pages, pages)).transpose(0, 1).reshape(H, -1, D)
        q = torch.randn(3, HQ, D, generator=g)
        probs = torch.softmax(block_scores(q, k4, 0, 3, False, None), dim=-1)  # [H, g, T, N]
        share = probs[..., : cold * S].unflatten(-1, (cold, S)).sum(-1).amax(dim=(0, 1))  # [T, cold]
        keep = torch.ones(3, N, dtype=torch.bool)
        keep[:, : cold * S] = False
        for t, top in enumerate(share.topk(2, dim=-1).indices):
            for p in top.tolist():
                keep[t, p * S:(p + 1) * S] = True
        scores = block_scores(q, k8, 0, 3, False, None).masked_fill(~keep, -torch.inf)
        want = torch.einsum("hgtl,hld->thgd", torch.softmax(scores, -1), v).reshape(3, HQ, D)
        torch.testing.assert_close(split.attend(b, layer, q, causal=False), want, rtol=1e-5, atol=1e-5)
        # the same picks over the INT4 keys answer otherwise: the INT8 keys are what it attends with
        four = torch.einsum("hgtl,hld->thgd", torch.softmax(block_scores(q, k4, 0, 3, False, None)
                                                             .masked_fill(~keep, -torch.inf), -1), v).reshape(3, HQ, D)
        assert not torch.allclose(four, want, rtol=1e-5, atol=1e-5)


def test_layout_events_and_the_way_back():
    """The exact keys are host fields read with the values; settle offloads and a read fetches
    both halves; back on the device the keys are the INT8 codes they were, with no quantize."""
    plain, m = make(None), make({"window": W, "top_k": 2} | HOST)
    pool, main = m.pools["split"], m.pools["main"]
    assert pool.value_fields() == ["v", "v_scale", "xk", "xk_scale"]
    assert pool.value_bytes() == main.page_bytes
    seq, a = filled(m), filled(plain)
    first = [r.page for r in m.seqs.get(seq).pages]
    before = [main.fields[layer]["k"].clone() for layer in range(L)]
    n = m.split_cold(seq)
    got = m.events.take_events()
    (off,) = [e for e in got if isinstance(e, ev.PagesOffloaded)]
    (recode,) = [e for e in got if isinstance(e, ev.PagesQuantized) and e.fields]
    assert off.details()["fields"] == ["k", "v"] and len(off.pages) == n and recode.codec == "int4"
    assert off.bytes == n * main.page_bytes
    m.attend(seq, 0, torch.randn(1, HQ, D))
    m.attend(seq, 1, torch.randn(1, HQ, D))
    (fetch,) = [e for e in m.events.take_events() if isinstance(e, ev.PagesFetched)]
    assert fetch.details()["fields"] == ["k", "v"] and fetch.bytes == 2 * 2 * main.page_bytes // L
    for layer in range(L):
        torch.testing.assert_close(m.kv(seq, layer), plain.kv(a, layer), rtol=0, atol=0)
    back = m.events.take_events()
    assert [e for e in back if isinstance(e, ev.PagesFetched)]
    assert not [e for e in back if isinstance(e, ev.PagesQuantized)]  # no key was encoded again
    assert pool.used_count == 0
    now = [r.page for r in m.seqs.get(seq).pages[:n]]
    assert all(r.where == "main" for r in m.seqs.get(seq).pages[:n])
    for layer in range(L):  # the INT8 codes as first encoded
        assert torch.equal(main.fields[layer]["k"][now], before[layer][first[:n]])


def test_erasure_and_tiers_cover_the_exact_keys():
    m = make({"window": W, "top_k": 2} | HOST)
    seq = filled(m)
    assert m.split_cold(seq) > 0
    pool = m.pools["split"]
    assert pool._stacks["xk"].any()
    q = torch.randn(2, HQ, D, generator=torch.Generator().manual_seed(3))
    before = m.attend(seq, 1, q, causal=False)
    assert m.offload(seq, "cpu") > 0 and pool.used_count == 0
    assert not pool._stacks["xk"].any()  # wiped as it left
    assert torch.equal(m.attend(seq, 1, q, causal=False), before)  # back with its exact keys
    m.free(seq)
    for p in m.pools.values():
        for t in p._stacks.values():
            assert not t.view(torch.uint8).any()


def test_the_kernel_path_reads_the_exact_keys_as_the_reference_path_does():
    """Decode steps through the kernels (interpreted on the CPU): the INT4 keys pick on the device,
    the picked pages' INT8 keys and values are read in place or from slots. Read in full, the
    step is the INT8 cache's kernel step; with top_k, the dense path's within fp16 rounding;
    with slots, the same bit for bit."""
    pytest.importorskip("triton")
    from kvguard.kernels._checks import interpreting

    if not interpreting():
        pytest.skip("the kernels run on the CPU only under TRITON_INTERPRET=1")
    full, top = {"window": W, "fraction": 1.0} | HOST, {"window": W, "top_k": 2} | HOST
    caches = [make(None, torch.float16, True), make(full, torch.float16, True),
              make(full | {"host_keys": False}, torch.float16, True),
              make(top, torch.float16), make(top, torch.float16, True), make(top | {"slots": 8}, torch.float16, True)]
    rows = [filled(m, torch.float16) for m in caches]
    for m, seq in zip(caches[1:], rows[1:]):
        assert m.split_cold(seq) == (N - W) // S
    g = torch.Generator().manual_seed(5)
    for _ in range(3):
        k, v = torch.randn(L, 1, H, D, generator=g).half(), torch.randn(L, 1, H, D, generator=g).half()
        q = torch.randn(L, 1, HQ, D, generator=g).half()
        for layer in range(L):
            outs = []
            for m, seq in zip(caches, rows):
                m.append_step([seq], layer, k[layer], v[layer])
                outs.append(m.attend_step([seq], layer, q[layer]).float())
            plain, host, int4, dense, kern, slots = outs
            torch.testing.assert_close(host, plain, rtol=0, atol=1e-3)
            assert (int4 - plain).abs().max() > 20 * (host - plain).abs().max()  # the INT4 keys attended
            torch.testing.assert_close(kern, dense, rtol=2e-3, atol=5e-3)
            torch.testing.assert_close(slots, kern, rtol=0, atol=0)


def test_host_keys_is_checked():
    for bad in ({"keys": None, "host_keys": True}, {"keys": "int8", "host_keys": True},
                {"keys": "int4", "host_keys": True, "normalize": "all"}, {"keys": "int4", "host_keys": 1}):
        with pytest.raises(ConfigError, match="host_keys"):
            make({"window": W, "top_k": 2} | {k: v for k, v in bad.items() if v is not None})
    policy = KvSplit(window=128, fraction=0.05, keys="int4", host_keys=True)
    assert policy.options() == {"window": 128, "fraction": 0.05, "keys": "int4", "host_keys": True}
    assert split_key(policy.options()) == "kvsplit@5%/w128/k-int4+host"
    for bad in ({"host_keys": True}, {"host_keys": True, "keys": "int4", "normalize": "all"},
                {"host_keys": "yes", "keys": "int4"}):
        with pytest.raises(ValueError):
            KvSplit(window=128, fraction=0.05, **bad)
