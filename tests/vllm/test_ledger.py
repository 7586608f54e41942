"""The block ledger of kvguard's vLLM connector, without vLLM: which subject each block holds,
what is recorded, what must be overwritten; and the connector's version check."""

from __future__ import annotations

import pytest

from kvguard.types import Subject
from kvguard.vllm import check_version
from kvguard.vllm.ledger import BlockLedger

A = Subject("acme", "alice", "s1")
B = Subject("acme", "bob", "s2")


def ops(ledger: BlockLedger) -> list[tuple[str, tuple[str, ...]]]:
    out = [(e.op, e.pages) for e in ledger.events]
    ledger.events.clear()
    return out


def test_a_request_stores_grows_and_frees_its_blocks():
    led = BlockLedger(block_size=32, block_bytes=1000)
    assert led.admit("r1", A, [1, 2, 3], hits=0) == []
    led.grow("r1", [4])
    assert ops(led) == [("open", ()), ("store", ("vllm:1", "vllm:2", "vllm:3")), ("store", ("vllm:4",))]
    # blocks 1-3 stay in vLLM's prefix cache (hashed); the partial block 4 has no hash: overwritten now
    assert led.finish("r1", cached=lambda b: b < 4) == [4]
    [(op, pages)] = ops(led)
    assert op == "free" and pages == ("vllm:4",)
    assert set(led.owners) == {1, 2, 3}


def test_a_prefix_hit_shares_blocks_and_a_reused_block_is_evicted_and_overwritten():
    led = BlockLedger(32, 1000)
    led.admit("r1", A, [1, 2], 0)
    led.finish("r1", cached=lambda b: True)
    led.admit("r2", B, [1, 2, 5], hits=2)  # bob's prompt starts as alice's: her two blocks, shared
    assert led.owners[1] == {A, B} and led.owners[5] == {B}
    led.finish("r2", cached=lambda b: True)
    ops(led)
    # vLLM reuses block 2 for a new request of bob: alice's and bob's data there is evicted
    assert led.admit("r3", B, [2], 0) == [2]
    evicted = [e for e in led.events if e.op == "evict"]
    assert {e.subject for e in evicted} == {A, B} and all(e.pages == ("vllm:2",) for e in evicted)
    assert led.owners[2] == {B}
    assert led.reused == [(2, frozenset({A, B}))]  # what the connector may copy to its host tier first


def test_erasure_waits_for_running_requests_and_keeps_blocks_others_hold():
    led = BlockLedger(32, 1000)
    led.admit("r1", A, [1, 2, 3], 0)
    assert led.erase("user", "acme", "alice", in_use=lambda b: False) is None  # her request still runs
    led.finish("r1", cached=lambda b: True)
    led.admit("r2", B, [1, 7], hits=1)  # bob holds block 1 now
    e = led.erase("user", "acme", "alice", in_use=lambda b: b in (1, 7))
    assert e.overwritten == [2, 3] and e.shared == 1
    assert led.owners[1] == {B} and 2 not in led.owners and 3 not in led.owners
    # a session erasure finds only that session's blocks
    led.finish("r2", cached=lambda b: True)
    e = led.erase("session", "acme", "s2", in_use=lambda b: False)
    assert e.overwritten == [1, 7] and led.owners == {}


@pytest.mark.parametrize("version,ok", [("0.32.0", True), ("0.32.5+cpu", True), ("0.31.2", False),
                                        ("0.33.0", False), ("1.0.0", False), ("dev", False)])
def test_only_the_tested_vllm_versions_load(version, ok):
    if ok:
        check_version(version)
    else:
        with pytest.raises(RuntimeError, match=r"tested with vLLM 0\.32\.x only; this is vLLM"):
            check_version(version)


def test_a_block_a_running_request_holds_is_shared_never_reused():
    led = BlockLedger(32, 1000)
    led.admit("r1", A, [1, 2], 0)
    # bob's request is given block 2 while alice's still holds it (vLLM shares a cached block): no
    # eviction, nothing overwritten, both own it
    assert led.grow("r1", []) == [] and led.admit("r2", B, [9], 0) == []
    assert led.grow("r2", [2]) == [] and led.owners[2] == {A, B}
    assert not [e for e in led.events if e.op == "evict"]
    # alice's request is preempted and resumed with block 1 found again: nothing overwritten
    assert led.admit("r1", A, [1, 5], hits=1) == [] and led.held == {1: 1, 5: 1, 9: 1, 2: 1}


@pytest.mark.parametrize("device", ["cpu", "cuda"])
@pytest.mark.parametrize("layout", ["cpu", "flash"])
def test_blocks_are_overwritten_in_every_layer_whatever_the_layout(layout, device):
    import torch

    from kvguard.vllm.overwrite import block_dims, overwrite

    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs a CUDA device (run on the GPU machine)")
    blocks, shape = 10, ((10, 2, 32, 3, 8) if layout == "cpu" else (2, 10, 32, 3, 8))
    caches = {f"layer.{i}": torch.randn(shape, dtype=torch.bfloat16, device=device) for i in range(3)}
    before = {k: v.clone() for k, v in caches.items()}
    layers = block_dims(caches, blocks)
    assert overwrite(layers, [1, 7]) == 0.0
    for (t, dim), old in zip(layers, before.values()):
        kept = torch.tensor([b for b in range(blocks) if b not in (1, 7)], device=device)
        assert torch.equal(t.index_select(dim, kept), old.index_select(dim, kept))
        assert not t.index_select(dim, torch.tensor([1, 7], device=device)).any()
    with pytest.raises(RuntimeError, match="no dimension of 11 blocks"):
        block_dims(caches, 11)
