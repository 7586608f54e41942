"""Logs kept in memory, for the witness tests: checkpoints and add-checkpoint bodies."""

from __future__ import annotations

import base64

from kvguard.audit.checkpoint import Checkpoint
from kvguard.audit.keys import SigningKey
from kvguard.audit.merkle import leaf_hash
from kvguard.audit.tree import HashTree


class MemoryLog:
    """A log's tree and key without a database: checkpoints and add-checkpoint bodies."""

    def __init__(self, origin: str, key: SigningKey) -> None:
        self.origin, self.key, self.tree = origin, key, HashTree()

    def grow(self, n: int, tag: bytes = b"") -> MemoryLog:
        for _ in range(n):
            self.tree.append(leaf_hash(tag + self.tree.size.to_bytes(8, "big")))
        return self

    def note(self, size: int | None = None) -> str:
        size = self.tree.size if size is None else size
        return Checkpoint(self.origin, size, self.tree.root(size)).sign(self.key)

    def body(self, old: int, size: int | None = None) -> str:
        size = self.tree.size if size is None else size
        proof = [] if old in (0, size) else self.tree.consistency_proof(old, size)
        return f"old {old}\n" + "".join(base64.b64encode(h).decode() + "\n" for h in proof) + "\n" + self.note(size)
