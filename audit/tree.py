"""The log's Merkle tree in memory: append, roots and proofs in O(log n) node lookups.

Complete aligned subtree hashes are cached per level in flat bytearrays (32 bytes
a node), from `cache_level` up. Below it, nodes are recomputed from the leaf
hashes of one bucket of 2**cache_level leaves, which a `leaf_source` (the store)
reads on demand; the unfinished last bucket stays in memory. With
cache_level=8 a million-leaf tree holds ~8k cached nodes (256 KiB); with
cache_level=0 every leaf hash is in memory and no source is needed.

Proof generation follows RFC 9162 §2.1.3.1 (PATH) and §2.1.4.1 (SUBPROOF).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence

from .merkle import EMPTY_ROOT, CompactRange, decompose, node_hash, split_point

# (start, end) -> leaf hashes of [start, end)
LeafSource = Callable[[int, int], Sequence[bytes]]


class HashTree:
    def __init__(self, cache_level: int = 0, leaf_source: LeafSource | None = None) -> None:
        if cache_level and leaf_source is None:
            raise ValueError("a tree that drops leaf hashes needs a leaf_source to read them back")
        self.cache_level = cache_level
        self._source = leaf_source
        self._levels: list[bytearray] = []  # _levels[k]: nodes of level cache_level + k
        self._tail: list[bytes] = []  # leaf hashes of the unfinished bucket
        self._buckets: OrderedDict[int, list[bytes]] = OrderedDict()  # LRU of full buckets read back
        self._lock = threading.RLock()  # proofs may be served while the writer appends
        self.size = 0

    # -- appending -----------------------------------------------------------------

    def append(self, leaf: bytes) -> None:
        with self._lock:
            self.size += 1
            if self.cache_level == 0:
                self._push(0, leaf)
                return
            self._tail.append(leaf)
            if len(self._tail) == 1 << self.cache_level:
                self._push(0, _perfect_root(self._tail))
                self._tail = []

    def extend(self, leaves: Iterable[bytes]) -> None:
        """append() for each leaf, with one lock round and whole buckets hashed at once."""
        with self._lock:
            if self.cache_level == 0:
                for leaf in leaves:
                    self.append(leaf)
                return
            width, tail = 1 << self.cache_level, self._tail
            for leaf in leaves:
                tail.append(leaf)
                self.size += 1
                if len(tail) == width:
                    self._push(0, _perfect_root(tail))
                    tail = self._tail = []

    def _push(self, k: int, h: bytes) -> None:
        while True:
            if k == len(self._levels):
                self._levels.append(bytearray())
            level = self._levels[k]
            level += h
            count = len(level) // 32
            if count % 2:
                return
            h = node_hash(bytes(level[-64:-32]), h)
            k += 1

    # -- reading -------------------------------------------------------------------

    def node(self, level: int, index: int) -> bytes:
        """Hash of the complete subtree of 2**level leaves starting at leaf index << level."""
        if level >= self.cache_level:
            k = level - self.cache_level
            return bytes(self._levels[k][index * 32 : index * 32 + 32])
        shift = self.cache_level - level
        leaves = self._bucket(index >> shift)
        start = (index - ((index >> shift) << shift)) << level
        return _perfect_root(leaves[start : start + (1 << level)])

    def _bucket(self, bucket: int) -> Sequence[bytes]:
        full = (self.size >> self.cache_level)
        if bucket == full:
            return self._tail
        cached = self._buckets.get(bucket)
        if cached is None:
            width = 1 << self.cache_level
            assert self._source is not None
            cached = list(self._source(bucket * width, (bucket + 1) * width))
            if len(cached) != width:
                raise RuntimeError(f"leaf source returned {len(cached)} hashes for bucket {bucket}")
            self._buckets[bucket] = cached
            if len(self._buckets) > 64:
                self._buckets.popitem(last=False)
        else:
            self._buckets.move_to_end(bucket)
        return cached

    def leaf(self, index: int) -> bytes:
        return self.node(0, index)

    def subtree(self, start: int, end: int) -> bytes:
        """MTH(D[start:end]) for the ranges RFC 9162's recursion produces."""
        if start == end:
            return EMPTY_ROOT
        nodes = decompose(start, end)
        r = self.node(*nodes[-1])
        for level, index in reversed(nodes[:-1]):
            r = node_hash(self.node(level, index), r)
        return r

    def root(self, size: int | None = None) -> bytes:
        with self._lock:
            size = self.size if size is None else self._check_size(size)
            return self.subtree(0, size)

    def root_with(self, leaves: Sequence[bytes]) -> bytes:
        """The root this tree would have with `leaves` appended, leaving the tree unchanged."""
        with self._lock:
            tail = CompactRange(self.size, [self.node(*n) for n in decompose(0, self.size)])
        for leaf in leaves:
            tail.append_leaf(leaf)
        return tail.root()

    def compact(self, start: int, end: int) -> list[bytes]:
        """Hashes of `decompose(start, end)`: what a bundle ships for the ranges around its records."""
        with self._lock:
            self._check_size(end)
            return [self.node(level, index) for level, index in decompose(start, end)]

    def _check_size(self, size: int) -> int:
        if not 0 <= size <= self.size:
            raise ValueError(f"tree size {size} is outside [0, {self.size}]")
        return size

    # -- proofs --------------------------------------------------------------------

    def inclusion_proof(self, index: int, size: int | None = None) -> list[bytes]:
        """RFC 9162 PATH(index, D[0:size])."""
        with self._lock:
            size = self.size if size is None else self._check_size(size)
            if not 0 <= index < size:
                raise ValueError(f"leaf {index} is not in a tree of size {size}")
            proof: list[bytes] = []
            start, end = 0, size
            while end - start > 1:
                k = split_point(end - start)
                if index - start < k:
                    proof.append(self.subtree(start + k, end))
                    end = start + k
                else:
                    proof.append(self.subtree(start, start + k))
                    start += k
            proof.reverse()  # collected root-down; the proof lists the leaf's sibling first
            return proof

    def consistency_proof(self, size1: int, size2: int | None = None) -> list[bytes]:
        """RFC 9162 PROOF(size1, D[0:size2]) = SUBPROOF(size1, D[0:size2], true)."""
        with self._lock:
            size2 = self.size if size2 is None else self._check_size(size2)
            if not 0 <= size1 <= size2:
                raise ValueError(f"no consistency proof from {size1} to {size2}")
            if size1 == 0 or size1 == size2:
                return []
            proof: list[bytes] = []
            m, start, end, complete = size1, 0, size2, True
            while True:
                n = end - start
                if m == n:
                    if not complete:
                        proof.append(self.subtree(start, end))
                    break
                k = split_point(n)
                if m <= k:
                    proof.append(self.subtree(start + k, end))
                    end = start + k
                else:
                    proof.append(self.subtree(start, start + k))
                    m -= k
                    start += k
                    complete = False
            proof.reverse()
            return proof


def _perfect_root(leaves: Sequence[bytes]) -> bytes:
    """Root of a power-of-two run of leaf hashes, pairing level by level."""
    level = list(leaves)
    while len(level) > 1:
        level = [node_hash(level[i], level[i + 1]) for i in range(0, len(level), 2)]
    return level[0]
