"""Bad input gets a clear error naming the problem, and the cache stays consistent."""

from __future__ import annotations

import pytest
import torch

from kvguard.cache import CacheConfig, CacheManager
from kvguard.errors import ConfigError, InputError, UnknownSequence
from kvguard.types import SeqId, Subject


@pytest.fixture
def cache():
    return CacheManager(CacheConfig(num_layers=2, num_kv_heads=2, head_dim=64, num_query_heads=4, num_pages=4,
                                    codec="int8"))


def kv(t=3, h=2, d=64, dtype=torch.float16):
    return torch.randn(t, h, d).to(dtype), torch.randn(t, h, d).to(dtype)


@pytest.mark.parametrize("args, match", [
    (kv(h=3), r"shape \[T, 2, 64\]"),
    (kv(d=32), r"shape \[T, 2, 64\]"),
    (kv(t=0), r"T >= 1"),
    (kv(dtype=torch.float32), "dtype torch.float32"),
    ((torch.randn(3, 2, 64).half(), torch.randn(4, 2, 64).half()), "differ in shape"),
    ((torch.randn(3, 2, 64).half(), "v"), "must be a torch.Tensor"),
])
def test_bad_kv_is_refused_and_nothing_changes(cache, alice, args, match):
    seq = cache.open(alice)
    assert cache.append(seq, 0, *kv())
    before = cache.stats()
    with pytest.raises(InputError, match=match):
        cache.append(seq, 0, *args)
    assert cache.stats() == before and cache.length(seq) == 3


def test_bad_layer_and_query(cache, alice):
    seq = cache.open(alice)
    with pytest.raises(InputError, match="layer"):
        cache.append(seq, 2, *kv())
    cache.append(seq, 0, *kv())
    with pytest.raises(InputError, match=r"q must have shape \[T, 4, 64\]"):
        cache.attend(seq, 0, torch.randn(1, 2, 64).half())
    with pytest.raises(InputError, match="4 queries"):
        cache.attend(seq, 0, torch.randn(4, 4, 64).half())


def test_wrong_device_is_named(alice):
    cache = CacheManager(CacheConfig(num_layers=1, num_kv_heads=2, head_dim=64, num_pages=4, device="meta"))
    seq = cache.open(alice)
    with pytest.raises(InputError, match="is on cpu; this cache lives on meta"):
        cache.append(seq, 0, *kv())


def test_unknown_sequence(cache):
    for call in (lambda: cache.append(SeqId(99), 0, *kv()), lambda: cache.free(SeqId(99)),
                 lambda: cache.attend(SeqId(99), 0, torch.randn(1, 4, 64).half()), lambda: cache.length(SeqId(7))):
        with pytest.raises(UnknownSequence, match="not open"):
            call()


@pytest.mark.parametrize("kwargs, match", [
    ({"codec": "int3"}, "unknown codec 'int3'"),
    ({"evictor": "lru"}, "unknown evictor 'lru'"),
    ({"evictor": "h2o", "evictor_options": {"budget": 8, "sink": 4, "window": 8}}, "budget 8 is smaller"),
    ({"evictor": "h2o", "evictor_options": {"budget": 64, "colour": "red"}}, "bad options"),
    ({"num_query_heads": 3}, "not a multiple"),
    ({"page_size": 0}, "page_size must be a positive integer"),
    ({"dtype": "float64"}, "dtype must be one of"),
    ({"codec": "int4", "head_dim": 48}, "divisible"),
    ({"codec": "int4", "codec_options": {"group": 0}}, "group must be a positive integer, got 0"),
    ({"codec": "int4", "codec_options": {"group": -32}}, "group must be a positive integer"),
    ({"codec": "int4", "codec_options": {"group": "32"}}, "group must be a positive integer, got '32'"),
    ({"codec": "int4", "codec_options": {"group": 64}, "use_kernels": True}, "value groups of 32"),
])
def test_bad_config(kwargs, match):
    base = dict(num_layers=1, num_kv_heads=2, head_dim=64, num_pages=4)
    with pytest.raises(ConfigError, match=match):
        CacheManager(CacheConfig(**{**base, **kwargs}))


def test_out_of_pages_is_an_ordinary_outcome(cache, alice, bob):
    a, b = cache.open(alice), cache.open(bob)
    assert cache.append(a, 0, *kv(t=60))  # 4 pages of 16
    before = cache.stats()
    assert cache.append(b, 0, *kv(t=1)) is False
    assert cache.stats() == before and cache.length(b) == 0
    cache.free(a)
    assert cache.append(b, 0, *kv(t=1))


def test_subject_is_validated_and_redacted():
    with pytest.raises(ValueError, match="tenant"):
        Subject("", "u", "s")
    with pytest.raises(ValueError, match="user .* without NUL"):
        Subject("acme", "a\x00b", "s")
    s = Subject("acme", "alice@example.com", "sess")
    assert "alice" not in repr(s) and "alice" not in str(s)
