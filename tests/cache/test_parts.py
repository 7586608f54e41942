"""The cache's parts behind CacheManager: each a small module with one job, reached through its
public surface, each event built in one place, and the manager's events going to the queue it
holds at the moment."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch

from kvguard.cache import CacheConfig, CacheManager, EventQueue
from kvguard.cache import events as ev
from kvguard.cache.pages import HOT, MAIN, PageRef
from kvguard.cache.tiers import CpuTier
from kvguard.errors import InputError

CACHE = Path(__file__).resolve().parents[2] / "kvguard" / "cache"
EVENTS = [name for name, obj in vars(ev).items()
          if isinstance(obj, type) and issubclass(obj, ev.CacheEvent) and obj is not ev.CacheEvent]


def trees():
    return {path.name: ast.parse(path.read_text(), str(path)) for path in sorted(CACHE.glob("*.py"))}


def make(**kw):
    opts = dict(num_layers=2, num_kv_heads=2, head_dim=64, num_query_heads=4, num_pages=16, codec="int8")
    return CacheManager(CacheConfig(**{**opts, **kw}))


def kv(t, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(t, 2, 64, generator=g).half(), torch.randn(t, 2, 64, generator=g).half()


def fill(m, seq, t, seed=0):
    for layer in range(m.cfg.num_layers):
        assert m.append(seq, layer, *kv(t, seed))


def test_every_event_is_built_in_one_place():
    # BlocksStored is the vLLM connector's (kvguard/vllm/ledger.py): the cache itself never builds it
    built = {name: [] for name in EVENTS if name != "BlocksStored"}
    for file, tree in trees().items():
        for node in ast.walk(tree):
            if isinstance(node, ast.Call):
                f = node.func
                name = f.attr if isinstance(f, ast.Attribute) else getattr(f, "id", None)
                if name in built:
                    built[name].append(f"{file}:{node.lineno}")
    assert all(len(places) == 1 for places in built.values()), built


def test_the_static_step_uses_no_private_name_of_the_manager():
    """step.py reaches the manager's parts through their public methods only."""
    tree = trees()["step.py"]
    private = [f"{node.attr} (line {node.lineno})" for node in ast.walk(tree)
               if isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__")
               and not (isinstance(node.value, ast.Name) and node.value.id == "self")]
    assert not private, private


def test_modules_stay_small():
    sizes = {path.name: len(path.read_text().splitlines()) for path in CACHE.glob("*.py")}
    assert max(sizes.values()) < 400, sizes


def test_events_go_to_the_queue_the_manager_holds_now(alice):
    """A consumer may hand a running cache its own queue: every part emits into that one."""
    m = make(num_pages=16, evictor="streamingllm", evictor_options={"budget": 32, "sink": 4}, auto_compact=False)
    m.tiers["cpu"] = CpuTier()
    m.events = mine = EventQueue()
    seq = m.open(alice)
    fill(m, seq, 64)
    assert m.compact(seq) is not None
    assert m.offload(seq, "cpu", max_pages=1) == 1
    m.kv(seq, 0)
    m.free(seq)
    m.erase_user("acme", "alice")
    ops = {e.op for e in mine.take_events()}
    assert ops == {"quantize", "evict", "offload", "fetch", "free", "erase"}


def test_release_refs_frees_in_page_order_and_counts_what_others_share(alice, bob):
    m = make(num_pages=8, codec="fp16")
    store, hot = m.store, m.pools[HOT]
    mine = hot.allocate(3, alice)
    hot.share(mine[1], bob)
    away = PageRef("cpu", "key", HOT)  # in a tier: not a device page to release
    refs = [PageRef(HOT, mine[2], HOT), away, PageRef(HOT, mine[0], HOT), PageRef(HOT, mine[1], HOT)]
    freed, shared = store.release_refs(refs, alice)
    assert freed == [f"hot:{mine[2]}", f"hot:{mine[0]}"] and shared == 1
    assert hot.ref[mine[1]] == 1 and hot.owners[mine[1]] == {bob: 1}


def test_release_refs_frees_a_page_held_twice_once(alice):
    m = make(num_pages=8, codec="fp16")
    hot = m.pools[HOT]
    [p] = hot.allocate(1, alice)
    hot.share(p, alice)
    freed, shared = m.store.release_refs([PageRef(HOT, p, HOT), PageRef(HOT, p, HOT)], alice)
    assert freed == [f"hot:{p}"] and shared == 1 and hot.free_count == 8


def test_a_compaction_reports_its_requantized_pages_as_a_quantize_does(alice):
    m = make(num_pages=32, evictor="streamingllm", evictor_options={"budget": 64, "sink": 4}, auto_compact=False)
    seq = m.open(alice)
    fill(m, seq, 128)
    m.events.take_events()
    m.compact(seq)
    quantized, evicted = m.events.take_events()
    assert isinstance(quantized, ev.PagesQuantized) and isinstance(evicted, ev.TokensEvicted)
    assert quantized.pages and all(p.startswith(f"{MAIN}:") for p in quantized.pages)
    n = len(quantized.pages)
    assert (quantized.n_tokens, quantized.bytes, quantized.bytes_before, quantized.codec) == (
        n * 16, n * m.pools[MAIN].page_bytes, n * m.pools[HOT].page_bytes, "int8")


@pytest.mark.parametrize("layer", [2, -1, "0"])
def test_attend_and_kv_refuse_a_layer_the_cache_does_not_have(alice, layer):
    m = make()
    seq = m.open(alice)
    fill(m, seq, 3)
    with pytest.raises(InputError, match="layer must be an integer"):
        m.attend(seq, layer, torch.randn(1, 4, 64).half())
    with pytest.raises(InputError, match="layer must be an integer"):
        m.kv(seq, layer)


def test_a_batch_is_open_sequences_each_named_once(alice, bob):
    m = make()
    a, b = m.open(alice), m.open(bob)
    assert [s.id for s in m.seqs.batch([b, a])] == [b, a]
    assert [s.id for s in m.seqs.owned_by(lambda s: s.user == "bob")] == [b]
    with pytest.raises(InputError, match="non-empty list"):
        m.seqs.batch(str(a))
    m.free(a)
    assert m.seqs.ids() == [b] == m.sequences()

