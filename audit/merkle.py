"""RFC 9162 Merkle tree hashing, proof verification and compact ranges (pure functions).

leaf = SHA-256(0x00 || leaf bytes), node = SHA-256(0x01 || left || right), the
empty tree's root is SHA-256(""). Verification follows RFC 9162 §2.1.3.2
(inclusion) and §2.1.4.2 (consistency) step by step.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Sequence

from .errors import VerificationError

EMPTY_ROOT = hashlib.sha256(b"").digest()


def leaf_hash(data: bytes) -> bytes:
    return hashlib.sha256(b"\x00" + data).digest()


def node_hash(left: bytes, right: bytes) -> bytes:
    return hashlib.sha256(b"\x01" + left + right).digest()


def split_point(n: int) -> int:
    """The largest power of two smaller than n (n >= 2): where RFC 9162 splits D[0:n]."""
    return 1 << ((n - 1).bit_length() - 1)


def root_from_inclusion(index: int, size: int, leaf: bytes, proof: Sequence[bytes]) -> bytes:
    """RFC 9162 §2.1.3.2 steps 1-4: the root an inclusion proof implies."""
    if index >= size:  # (1)
        raise VerificationError("inclusion", f"leaf index {index} is not below tree size {size}")
    fn, sn, r = index, size - 1, leaf  # (2), (3)
    for p in proof:  # (4)
        if len(p) != 32:
            raise VerificationError("inclusion", "proof node is not 32 bytes")
        if sn == 0:  # (4a)
            raise VerificationError("inclusion", "proof is longer than the path to the root")
        if fn & 1 or fn == sn:  # (4b)
            r = node_hash(p, r)
            if not fn & 1:
                while fn and not fn & 1:
                    fn >>= 1
                    sn >>= 1
        else:
            r = node_hash(r, p)
        fn >>= 1  # (4c)
        sn >>= 1
    if sn != 0:  # (5), first half
        raise VerificationError("inclusion", "proof is shorter than the path to the root")
    return r


def verify_inclusion(index: int, size: int, leaf: bytes, proof: Sequence[bytes], root: bytes) -> None:
    if root_from_inclusion(index, size, leaf, proof) != root:  # (5), second half
        raise VerificationError("inclusion", f"inclusion proof of leaf {index} does not reach the root")


def verify_consistency(
    size1: int, size2: int, root1: bytes, root2: bytes, proof: Sequence[bytes]
) -> None:
    """RFC 9162 §2.1.4.2, with the trivial cases (equal or empty sizes) handled first."""
    if size1 > size2:
        raise VerificationError("consistency", f"tree shrank from {size1} to {size2}")
    if size1 == size2 or size1 == 0:
        if proof:
            raise VerificationError("consistency", "proof must be empty for these sizes")
        if size1 == size2 and root1 != root2:
            raise VerificationError("consistency", f"two different roots for tree size {size1}")
        return
    if not proof:  # (1)
        raise VerificationError("consistency", "empty proof")
    if any(len(c) != 32 for c in proof):
        raise VerificationError("consistency", "proof node is not 32 bytes")
    path = list(proof)
    if size1 & (size1 - 1) == 0:  # (2) size1 is a power of two: its root is a node of the path
        path.insert(0, root1)
    fn, sn = size1 - 1, size2 - 1  # (3)
    while fn & 1:  # (4)
        fn >>= 1
        sn >>= 1
    fr = sr = path[0]  # (5)
    for c in path[1:]:  # (6)
        if sn == 0:  # (6a)
            raise VerificationError("consistency", "proof is longer than needed")
        if fn & 1 or fn == sn:  # (6b)
            fr = node_hash(c, fr)
            sr = node_hash(c, sr)
            if not fn & 1:
                while fn and not fn & 1:
                    fn >>= 1
                    sn >>= 1
        else:
            sr = node_hash(sr, c)
        fn >>= 1  # (6c)
        sn >>= 1
    if fr != root1 or sr != root2 or sn != 0:  # (7)
        raise VerificationError("consistency", f"proof does not link tree size {size1} to {size2}")


def decompose(start: int, end: int) -> list[tuple[int, int]]:
    """The aligned perfect subtrees (level, index) that cover [start, end), left to right,
    each as large as alignment allows. For start == 0 these are the binary digits of end."""
    nodes: list[tuple[int, int]] = []
    while start < end:
        level = (start & -start).bit_length() - 1 if start else (end.bit_length() - 1)
        while start + (1 << level) > end:
            level -= 1
        nodes.append((level, start >> level))
        start += 1 << level
    return nodes


class CompactRange:
    """The hashes of [0, size) kept as its O(log n) perfect subtrees; the root at any
    size is a right-to-left fold of them. Verifiers stream a log through one of these."""

    __slots__ = ("size", "_stack")

    def __init__(self, size: int = 0, hashes: Iterable[bytes] = ()) -> None:
        self._stack: list[tuple[int, bytes]] = []
        self.size = 0
        nodes = decompose(0, size)
        hashes = list(hashes)
        if len(hashes) != len(nodes):
            raise VerificationError("merkle_root", f"a compact range of size {size} has {len(nodes)} hashes")
        for (level, _), h in zip(nodes, hashes):
            self.append_node(level, h)

    def append_node(self, level: int, h: bytes) -> None:
        """Append a perfect subtree of 2**level leaves starting at `size` (must be aligned)."""
        if len(h) != 32:
            raise VerificationError("merkle_root", "a tree hash is not 32 bytes")
        if self.size & ((1 << level) - 1):
            raise ValueError(f"a level-{level} subtree cannot start at {self.size}")
        stack = self._stack
        self.size += 1 << level
        while stack and stack[-1][0] == level:  # merge with the left sibling, like a binary carry
            h = node_hash(stack.pop()[1], h)
            level += 1
        stack.append((level, h))

    def append_leaf(self, leaf: bytes) -> None:
        self.append_node(0, leaf)

    def hashes(self) -> list[bytes]:
        return [h for _, h in self._stack]

    def root(self) -> bytes:
        if not self._stack:
            return EMPTY_ROOT
        r = self._stack[-1][1]
        for _, h in reversed(self._stack[:-1]):
            r = node_hash(h, r)
        return r
