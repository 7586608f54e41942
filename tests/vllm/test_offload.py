"""kvguard's host tier under vLLM, without vLLM: the index the connector's scheduler side keeps
(least recently used, pinned slots, erasure by subject) and the INT8 copies its workers keep,
in both KV layouts vLLM uses (blocks first on the CPU, K/V first under FlashAttention)."""

from __future__ import annotations

import pytest
import torch

from kvguard.types import Subject
from kvguard.vllm.offload import HostIndex, HostStore
from kvguard.vllm.overwrite import block_dims

A = Subject("acme", "alice", "s1")
B = Subject("acme", "bob", "s2")


def test_the_index_finds_the_longest_run_from_the_first_hash_within_the_limit():
    idx = HostIndex(4)
    for key in (b"h1", b"h2", b"h4"):
        assert idx.put(key, frozenset({A})) is not None
    assert idx.match([b"h1", b"h2", b"h3", b"h4"], limit=10) == [idx.keys[b"h1"], idx.keys[b"h2"]]
    assert idx.match([b"h1", b"h2"], limit=1) == [idx.keys[b"h1"]]
    assert idx.match([b"h3", b"h4"], limit=10) == []  # a hit starts at the first hash or not at all
    assert idx.put(b"h1", frozenset({B})) is None  # held already: its owners join
    assert idx.owners[idx.keys[b"h1"]] == {A, B}


def test_a_full_index_replaces_its_least_recently_used_copy_but_never_a_pinned_one():
    idx = HostIndex(2)
    s1, _ = idx.put(b"h1", frozenset({A}))
    s2, _ = idx.put(b"h2", frozenset({B}))
    idx.use([s1])  # a step loads from h1: most recent, and pinned
    slot, replaced = idx.put(b"h3", frozenset({A}))
    assert slot == s2 and replaced == (s2, frozenset({B})) and b"h2" not in idx.keys
    idx.use([s2])  # both pinned now
    assert idx.put(b"h4", frozenset({A})) is None
    idx.unpin()
    slot, replaced = idx.put(b"h4", frozenset({A}))
    assert slot == s1 and replaced == (s1, frozenset({A}))


def test_an_erasure_drops_the_subjects_copies_and_leaves_shared_ones_to_the_others():
    idx = HostIndex(4)
    mine, _ = idx.put(b"h1", frozenset({A}))
    shared, _ = idx.put(b"h2", frozenset({A, B}))
    other, _ = idx.put(b"h3", frozenset({B}))
    dropped, kept = idx.erase(lambda s: s.user == "alice")
    assert dropped == [mine] and kept == 1
    assert idx.owners == {shared: {B}, other: {B}} and b"h1" not in idx.keys
    assert idx.match([b"h1"], 1) == []
    assert idx.put(b"h5", frozenset({A}))[0] == mine  # the freed slot is used again


def test_the_index_needs_a_slot():
    with pytest.raises(ValueError, match="at least one slot"):
        HostIndex(0)


@pytest.mark.parametrize("layout", ["cpu", "flash-attention"])
def test_copies_come_back_within_int8_error_and_a_drop_leaves_zeros(layout):
    """On the CPU backend a layer is [blocks, heads, block_size, K|V] (K and V side by side in
    the last dimension); under FlashAttention [2, blocks, block_size, heads, head_dim]. Keys are
    made 100x larger than values: a value sharing a key's scale would lose its precision."""
    torch.manual_seed(0)
    blocks, bs, heads, dim = 6, 4, 2, 8
    if layout == "cpu":
        k, v = torch.randn(blocks, heads, bs, dim) * 10, torch.randn(blocks, heads, bs, dim) * 0.1
        make = lambda: torch.cat([k, v], -1).to(torch.bfloat16)  # noqa: E731
    else:
        k, v = torch.randn(blocks, bs, heads, dim) * 10, torch.randn(blocks, bs, heads, dim) * 0.1
        make = lambda: torch.stack([k, v]).to(torch.bfloat16)  # noqa: E731
    caches = {f"layer{i}": make() for i in range(3)}
    layers = block_dims(caches, blocks)
    store = HostStore(layers, slots=3, group=dim)
    before = [t.select(d, 2).clone() for t, d in layers]
    store.save([(2, 1), (4, 0)])
    for t, d in layers:
        t.index_fill_(d, torch.tensor([2, 5]), 0)  # block 2 reused; block 5 gets slot 1's copy
    store.load([(1, 5)])
    for (t, d), want in zip(layers, before):
        got, want = t.select(d, 5).float(), want.float()
        groups = lambda x: x.unflatten(-1, (-1, dim))  # noqa: E731 - each head's K and V apart
        err = (groups(got) - groups(want)).abs().amax(-1) / groups(want).abs().amax(-1)
        assert float(err.max()) < 0.01
        assert float(t.select(d, 2).abs().max()) == 0.0
    assert store.drop([1]) == 0.0
    assert all(float(c[1].abs().max()) == 0 and float(s[1].abs().max()) == 0
               for c, s in zip(store.codes, store.scales))
    assert any(float(c[0].abs().max()) > 0 for c in store.codes)  # the other copy stays


@pytest.fixture(params=["disk", "redis"])
def lower_tier(request, tmp_path):
    from kvguard.cache.tiers import DiskTier, RedisTier

    if request.param == "disk":
        yield DiskTier(tmp_path / "tier", clear_stale=True)
        return
    import redis

    client = redis.Redis.from_url("redis://127.0.0.1:6379/0")
    try:
        client.ping()
    except redis.ConnectionError:
        pytest.skip("no Redis at 127.0.0.1:6379 (make services starts it)")
    tier = RedisTier(client, prefix=f"kvguard:test-vllm:{tmp_path.name}:", clear_stale=True)
    yield tier
    for key in tier.keys():
        tier.erase(key)


def test_a_sealed_tier_keeps_copies_loads_them_back_and_a_drop_removes_them(lower_tier):
    from kvguard.vllm.offload import TierStore

    torch.manual_seed(1)
    blocks, bs, heads, dim = 5, 4, 2, 8
    k, v = torch.randn(blocks, heads, bs, dim) * 10, torch.randn(blocks, heads, bs, dim) * 0.1
    caches = {f"layer{i}": torch.cat([k, v], -1).to(torch.bfloat16) for i in range(2)}
    layers = block_dims(caches, blocks)
    store = TierStore(layers, lower_tier, tag="w1", group=dim)
    want = [t.select(d, 1).float().clone() for t, d in layers]
    store.save([(1, 7), (3, 2)])
    assert sorted(lower_tier.keys()) == ["vllm-w1-s2", "vllm-w1-s7"]
    for t, d in layers:
        t.index_fill_(d, torch.tensor([1, 4]), 0)
    store.load([(7, 4)])
    for (t, d), w in zip(layers, want):
        got = t.select(d, 4).float().unflatten(-1, (-1, dim))
        w = w.unflatten(-1, (-1, dim))
        assert float(((got - w).abs().amax(-1) / w.abs().amax(-1)).max()) < 0.01
    assert store.drop([7]) == 0.0 and lower_tier.keys() == ["vllm-w1-s2"]


def test_the_tier_option_is_checked(monkeypatch):
    from kvguard.vllm.offload import REDIS_URL_ENV, check_tier, redis_url

    monkeypatch.delenv(REDIS_URL_ENV, raising=False)
    assert check_tier({}) == "cpu" and check_tier({"offload_tier": "disk", "offload_dir": "/x"}) == "disk"
    with pytest.raises(ValueError, match="one of"):
        check_tier({"offload_tier": "tape"})
    with pytest.raises(ValueError, match="needs offload_dir"):
        check_tier({"offload_tier": "disk"})
    with pytest.raises(ValueError, match="needs offload_redis"):
        check_tier({"offload_tier": "redis"})
    # a URL with a password comes from the environment (the chart's Secret), not vLLM's arguments
    monkeypatch.setenv(REDIS_URL_ENV, "redis://:pw@redis:6379/0")
    assert check_tier({"offload_tier": "redis"}) == "redis" and redis_url({}) == "redis://:pw@redis:6379/0"
    assert redis_url({"offload_redis": "redis://other:6379"}) == "redis://other:6379"
