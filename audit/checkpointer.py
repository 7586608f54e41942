"""When the log writer issues a checkpoint, and the signed entry it stores.

A checkpoint is due once `every` records or `interval_ms` have passed since the
last one (and the tree grew); the writer also forces one before a key rotation
and on request (receipts). audit.log decides where it is stored: in the
transaction of the batch it covers, or on its own.
"""

from __future__ import annotations

from .checkpoint import Checkpoint
from .keys import SigningKey
from .store import CheckpointEntry


class Checkpointer:
    def __init__(self, origin: str, every: int, interval_ms: int, latest: CheckpointEntry | None,
                 now_ms: int) -> None:
        self.origin, self.every, self.interval_ms = origin, every, interval_ms
        self.latest, self.since_ms = latest, now_ms

    @property
    def size(self) -> int:
        """Tree size of the latest checkpoint (0 before the first)."""
        return 0 if self.latest is None else self.latest.size

    def due(self, size: int, now_ms: int) -> bool:
        return size > self.size and (size - self.size >= self.every
                                     or now_ms - self.since_ms >= self.interval_ms)

    def wait_s(self, now_ms: int) -> float:
        """Seconds until the interval elapses (for the writer's idle timer)."""
        return max(self.since_ms + self.interval_ms - now_ms, 0) / 1000

    def sign(self, key: SigningKey, size: int, root: bytes, now_ms: int) -> CheckpointEntry:
        note = Checkpoint(self.origin, size, root).sign(key)
        return CheckpointEntry(self.origin, size, root, now_ms, key.key_id, note)

    def issued(self, entry: CheckpointEntry) -> None:
        self.latest, self.since_ms = entry, entry.time_ms
