"""Helpers shared by the audit tests (imported by conftest.py and test modules)."""

from __future__ import annotations

from audit.keys import SigningKey
from audit.log import AuditLog, LogConfig
from audit.store import AuditStore


def open_log(store: AuditStore, origin: str, key: SigningKey, **config) -> AuditLog:
    """An AuditLog with checkpoints only when asked for (tests choose their sizes)."""
    defaults = {"checkpoint_every": 10**9, "checkpoint_interval_ms": 10**9, "cache_level": 2}
    return AuditLog(store, origin, key, LogConfig(**{**defaults, **config}))


def fill(log: AuditLog, n: int, op: str = "evict") -> list:
    return log.append_many([(op, {}, {"pages": [i], "bytes": 4096 * i}) for i in range(n)])
