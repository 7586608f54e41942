"""The static decode step (kvguard.cache.step.StaticStep) refuses what it cannot run, holds the
manager's lock from begin to end, and leaves nothing half done when a step fails. Its steps
against eager ones: tests/hf/test_graph.py (greedy decoding through it, on the kernel path)."""

from __future__ import annotations

import pytest
import torch

from kvguard.cache import CacheConfig, CacheManager
from kvguard.cache.step import StaticStep
from kvguard.errors import ConfigError, InputError, UnknownSequence
from kvguard.types import Subject


def manager(**kw):
    cfg = CacheConfig(num_layers=2, num_kv_heads=2, head_dim=64, num_query_heads=4, num_pages=16,
                      **({"use_kernels": True} | kw))
    return CacheManager(cfg)


def opened(m, lengths=(20, 5)):
    seqs = []
    for i, n in enumerate(lengths):
        seq = m.open(Subject("acme", f"u{i}", f"s{i}"))
        for layer in range(m.cfg.num_layers):
            m.append(seq, layer, torch.zeros(n, 2, 64, dtype=torch.float16), torch.zeros(n, 2, 64,
                                                                                      dtype=torch.float16))
        seqs.append(seq)
    return seqs


def test_static_step_refuses_what_it_cannot_run():
    with pytest.raises(ConfigError, match="kernel path"):
        StaticStep(manager(use_kernels=False), opened(manager(use_kernels=False)), 64)
    m = manager()
    seqs = opened(m)
    with pytest.raises(InputError, match="max_tokens"):
        StaticStep(m, seqs, 0)
    with pytest.raises(InputError, match="already holds 20"):
        StaticStep(m, seqs, 20)
    with pytest.raises(InputError, match="non-empty list"):
        StaticStep(m, [], 64)
    empty = m.open(Subject("acme", "carol", "s9"))
    with pytest.raises(InputError, match="prefill it first"):
        StaticStep(m, [empty], 64)
    m.append(seqs[1], 0, torch.zeros(1, 2, 64, dtype=torch.float16), torch.zeros(1, 2, 64, dtype=torch.float16))
    with pytest.raises(InputError, match="different numbers of tokens"):
        StaticStep(m, seqs, 64)


def test_static_step_holds_the_lock_and_refuses_a_full_step():
    m = manager()
    seqs = opened(m, (20, 5))
    step = StaticStep(m, seqs, 21)
    with step:  # the manager's lock is held from begin to end: an erasure on another thread waits
        assert m.lock._is_owned()
        with pytest.raises(InputError, match="begun already"):
            step.begin()
    assert not m.lock._is_owned()
    assert [m.length(s) for s in seqs] == [21, 6]
    with pytest.raises(InputError, match="would hold 22"):
        step.begin()
    assert not m.lock._is_owned()
    with pytest.raises(InputError, match="without begin"):
        step.end()


def test_a_failed_step_leaves_the_lengths_and_a_freed_row_is_refused():
    m = manager()
    seqs = opened(m)
    step = StaticStep(m, seqs, 64)
    with pytest.raises(RuntimeError, match="forward failed"):
        with step:
            raise RuntimeError("forward failed")
    assert [m.length(s) for s in seqs] == [20, 5] and not m.lock._is_owned()
    m.free(seqs[0])
    with pytest.raises(UnknownSequence):
        step.begin()
    assert not m.lock._is_owned()
