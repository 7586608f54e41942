"""kvguard's host tier under vLLM: blocks vLLM evicts from its prefix cache, kept as INT8 in host
memory and loaded back on a later prefix hit (the connector's `offload_blocks` option).

Scheduler side, HostIndex: which block hash each of the tier's slots holds and whose data it
is, least recently used first. Pure Python, tested without vLLM. The block hash is vLLM's own,
which chains the request's cache salt: a copy is found only by the prompts of the scope that
computed it, and never again once the subject's secret is shredded.

Worker side, HostStore: the slots themselves, in every layer a worker holds: int8 codes with
one scale per head-dim vector. The last dimension of vLLM's KV layouts is the head's: one
head_dim under FlashAttention, K then V of it (2 x head_dim) on the CPU backend, so it is cut
in groups of head_dim and a key never shares a scale with a value. Each tensor-parallel
worker keeps its shard under the slot numbers the scheduler side gave. TierStore keeps the
same codes in one of kvguard's sealed lower tiers instead (kvguard.cache.tiers: files of a
local directory or a Redis server, each block AES-GCM sealed under a key only that worker
holds), a block's layers together under the key of its slot and the worker's tag.
"""

from __future__ import annotations

import os
import socket
from collections import OrderedDict
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

from ..cache.tiers import DiskTier, RedisTier
from ..types import Subject


class HostIndex:
    """`slots` slots; a slot holds one block's copy under its hash, with the subjects whose
    tokens it holds. Slots a step is about to load from are pinned: no copy replaces them."""

    def __init__(self, slots: int) -> None:
        if slots < 1:
            raise ValueError(f"the host tier needs at least one slot, got {slots}")
        self.slots = slots
        self.keys: OrderedDict[bytes, int] = OrderedDict()  # hash -> slot, least recently used first
        self.owners: dict[int, frozenset[Subject]] = {}
        self.key_of: dict[int, bytes] = {}
        self.free = list(range(slots - 1, -1, -1))
        self.pinned: set[int] = set()

    def __len__(self) -> int:
        return len(self.keys)

    def match(self, hashes: Sequence[bytes], limit: int) -> list[int]:
        """The slots of the longest run of `hashes` held from the first, at most `limit`."""
        found = []
        for h in hashes[:max(0, limit)]:
            slot = self.keys.get(h)
            if slot is None:
                break
            found.append(slot)
        return found

    def use(self, slots: Sequence[int]) -> None:
        """Slots a step loads from: most recently used, and pinned until `unpin`."""
        for s in slots:
            self.keys.move_to_end(self.key_of[s])
        self.pinned.update(slots)

    def unpin(self) -> None:
        self.pinned.clear()

    def put(self, key: bytes, owners: frozenset[Subject]) -> tuple[int, tuple[int, frozenset[Subject]] | None] | None:
        """A slot for a copy of the block with this hash: (slot, (the slot, owners) of the copy it
        replaces, or None). None when the hash is held already (its owners joined) or every slot
        is pinned."""
        slot = self.keys.get(key)
        if slot is not None:
            self.owners[slot] = self.owners[slot] | owners
            self.keys.move_to_end(key)
            return None
        dropped = None
        if self.free:
            slot = self.free.pop()
        else:
            slot = next((s for s in self.keys.values() if s not in self.pinned), None)
            if slot is None:
                return None
            dropped = (slot, self.owners.pop(slot))
            del self.keys[self.key_of.pop(slot)]
        self.keys[key], self.key_of[slot], self.owners[slot] = slot, key, owners
        return slot, dropped

    def erase(self, match: Callable[[Subject], bool]) -> tuple[list[int], int]:
        """The copies holding a matching subject's tokens: those only it holds leave the tier
        (their slots, to overwrite); shared ones lose the subject (their count)."""
        dropped, shared = [], 0
        for slot, owners in list(self.owners.items()):
            rest = frozenset(o for o in owners if not match(o))
            if rest == owners:
                continue
            if rest:
                self.owners[slot] = rest
                shared += 1
                continue
            del self.owners[slot], self.keys[self.key_of.pop(slot)]
            self.free.append(slot)
            dropped.append(slot)
        return sorted(dropped), shared


def _groups(layers: list[tuple[torch.Tensor, int]], group: int | None) -> list[tuple[int, ...]]:
    """Each layer's block shape with its last dimension cut in groups of `group` (the head size;
    the whole last dimension when it does not divide it)."""
    shapes = []
    for t, dim in layers:
        shape = tuple(t.select(dim, 0).shape)
        g = group if group and shape[-1] % group == 0 else shape[-1]
        shapes.append((*shape[:-1], shape[-1] // g, g))
    return shapes


def _encode(t: torch.Tensor, dim: int, blocks: Sequence[int], shape: tuple[int, ...]):
    """The blocks' int8 codes and float16 scales (one per group), on the host."""
    idx = torch.tensor(blocks, dtype=torch.long, device=t.device)
    x = t.index_select(dim, idx).movedim(dim, 0).float().cpu().reshape(len(blocks), *shape)
    scale = x.abs().amax(-1, keepdim=True).div_(127.0).to(torch.float16)
    return (x / scale.float().clamp_min(1e-30)).round_().clamp_(-127, 127).to(torch.int8), scale


def _decode_into(t: torch.Tensor, dim: int, blocks: Sequence[int], codes: torch.Tensor, scales: torch.Tensor):
    x = (codes.float() * scales.float()).flatten(-2)
    idx = torch.tensor(blocks, dtype=torch.long, device=t.device)
    t.index_copy_(dim, idx, x.to(device=t.device, dtype=t.dtype).movedim(0, dim))


class HostStore:
    """The slots' data in one worker's memory: per layer int8 codes and a float16 scale per
    head-size group of the last dimension."""

    def __init__(self, layers: list[tuple[torch.Tensor, int]], slots: int, group: int | None = None) -> None:
        self.layers = layers
        self.shapes = _groups(layers, group)
        self.codes = [torch.zeros((slots, *shape), dtype=torch.int8) for shape in self.shapes]
        self.scales = [torch.zeros((slots, *shape[:-1], 1), dtype=torch.float16) for shape in self.shapes]

    def save(self, pairs: Sequence[tuple[int, int]]) -> None:
        """Copy (block, slot) pairs from the KV tensors into the tier, quantized."""
        if not pairs:
            return
        blocks, slots = zip(*pairs)
        for (t, dim), codes, scales, shape in zip(self.layers, self.codes, self.scales, self.shapes):
            q, scale = _encode(t, dim, blocks, shape)
            sl = torch.tensor(slots, dtype=torch.long)
            codes.index_copy_(0, sl, q)
            scales.index_copy_(0, sl, scale)

    def load(self, pairs: Sequence[tuple[int, int]]) -> None:
        """Copy (slot, block) pairs from the tier into the KV tensors, dequantized."""
        if not pairs:
            return
        slots, blocks = zip(*pairs)
        sl = torch.tensor(slots, dtype=torch.long)
        for (t, dim), codes, scales in zip(self.layers, self.codes, self.scales):
            _decode_into(t, dim, blocks, codes.index_select(0, sl), scales.index_select(0, sl))

    def drop(self, slots: Sequence[int]) -> float:
        """Overwrite `slots` with zeros; the largest magnitude then read from them (0.0: nothing left)."""
        if not slots:
            return 0.0
        sl = torch.tensor(slots, dtype=torch.long)
        peak = 0.0
        for codes, scales in zip(self.codes, self.scales):
            codes.index_fill_(0, sl, 0)
            scales.index_fill_(0, sl, 0)
            peak = max(peak, float(codes.index_select(0, sl).abs().amax()),
                       float(scales.index_select(0, sl).abs().amax()))
        return peak


class TierStore:
    """The slots' data in a sealed lower tier (a kvguard.cache.tiers.Tier): one entry a slot,
    every layer's codes and scales in it, under `vllm-<tag>-s<slot>` (tag: the worker's)."""

    def __init__(self, layers: list[tuple[torch.Tensor, int]], tier, tag: str = "0", group: int | None = None) -> None:
        self.layers, self.tier, self.tag = layers, tier, tag
        self.shapes = _groups(layers, group)

    def _key(self, slot: int) -> str:
        return f"vllm-{self.tag}-s{slot}"

    def save(self, pairs: Sequence[tuple[int, int]]) -> None:
        if not pairs:
            return
        blocks, slots = zip(*pairs)
        coded = [_encode(t, dim, blocks, shape) for (t, dim), shape in zip(self.layers, self.shapes)]
        for i, slot in enumerate(slots):
            blob = {}
            for n, (q, scale) in enumerate(coded):
                blob[f"c{n}"], blob[f"s{n}"] = q[i].clone(), scale[i].clone()
            self.tier.put(self._key(slot), blob)

    def load(self, pairs: Sequence[tuple[int, int]]) -> None:
        if not pairs:
            return
        blobs = [self.tier.get(self._key(slot)) for slot, _ in pairs]
        blocks = [block for _, block in pairs]
        for n, (t, dim) in enumerate(self.layers):  # every block of a layer in one copy
            _decode_into(t, dim, blocks, torch.stack([b[f"c{n}"] for b in blobs]),
                         torch.stack([b[f"s{n}"] for b in blobs]))

    def drop(self, slots: Sequence[int]) -> float:
        """Overwrite and remove the slots' entries; 1.0 when one can still be read after it."""
        left = 0.0
        for slot in slots:
            self.tier.erase(self._key(slot))
            try:
                self.tier.get(self._key(slot))
                left = 1.0
            except (KeyError, FileNotFoundError):
                pass
        return left


TIERS = ("cpu", "disk", "redis")
REDIS_URL_ENV = "KVGUARD_OFFLOAD_REDIS_URL"  # the Redis URL where a password must stay out of vLLM's arguments


def redis_url(extra: dict) -> str | None:
    return extra.get("offload_redis") or os.environ.get(REDIS_URL_ENV) or None


def make_store(layers: list[tuple[torch.Tensor, int]], slots: int, group: int | None, extra: dict):
    """The worker's store for the connector's extra config: `offload_tier` cpu (host memory, the
    default), disk (`offload_dir`: a directory of this pod's, each worker a folder of its own
    in it, emptied at start) or redis (`offload_redis`, or else the environment's
    KVGUARD_OFFLOAD_REDIS_URL: a URL; each worker a key prefix of its own, emptied at start)."""
    kind = extra.get("offload_tier", "cpu")
    if kind == "cpu":
        return HostStore(layers, slots, group)
    tag = str(os.getpid())
    if kind == "disk":
        return TierStore(layers, DiskTier(Path(extra["offload_dir"]) / f"worker-{tag}", clear_stale=True), tag, group)
    import redis  # only where the Redis tier is chosen

    tier = RedisTier(redis.Redis.from_url(redis_url(extra)),
                     prefix=f"kvguard:vllm:{socket.gethostname()}:{tag}:", clear_stale=True)
    return TierStore(layers, tier, tag, group)


def check_tier(extra: dict) -> str:
    """The tier the extra config names, or ValueError saying what is missing."""
    kind = extra.get("offload_tier", "cpu")
    if kind not in TIERS:
        raise ValueError(f"offload_tier is one of {TIERS}, got {kind!r}")
    if kind == "disk" and not extra.get("offload_dir"):
        raise ValueError("offload_tier disk needs offload_dir in kv_connector_extra_config")
    if kind == "redis" and not redis_url(extra):
        raise ValueError(f"offload_tier redis needs offload_redis in kv_connector_extra_config or {REDIS_URL_ENV} "
                         "in the environment")
    return kind
