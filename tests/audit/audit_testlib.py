"""Helpers shared by the audit tests (imported by conftest.py and test modules)."""

from __future__ import annotations

import pytest
from kvguard.audit.keys import SigningKey
from kvguard.audit.log import AuditLog, LogConfig
from kvguard.audit.store import AuditStore

# PostgreSQL runs are marked `postgres`, so `-m "not postgres"` (make test-fast) leaves them out.
BACKENDS = ["sqlite", pytest.param("postgresql", marks=pytest.mark.postgres)]


def open_log(store: AuditStore, origin: str, key: SigningKey, **config) -> AuditLog:
    """An AuditLog with checkpoints only when asked for (tests choose their sizes)."""
    defaults = {"checkpoint_every": 10**9, "checkpoint_interval_ms": 10**9, "cache_level": 2}
    return AuditLog(store, origin, key, LogConfig(**{**defaults, **config}))


def fill(log: AuditLog, n: int, op: str = "evict") -> list:
    return log.append_many([(op, {}, {"pages": [i], "bytes": 4096 * i}) for i in range(n)])


def read_bundle(path) -> dict[str, bytes]:
    import zipfile

    with zipfile.ZipFile(path) as zf:
        return {info.filename: zf.read(info) for info in zf.infolist()}


def write_bundle(path, members: dict[str, bytes], reseal_with: SigningKey | None = None) -> None:
    """Write members (in the dict's order); with `reseal_with`, recompute the manifest's digests
    and re-sign it, as someone holding the export key could, to reach the deeper checks."""
    import base64
    import hashlib
    import json
    import zipfile

    from kvguard.audit.bundle.dsse import sign_envelope

    if reseal_with is not None:
        envelope = json.loads(members["manifest.dsse.json"])
        statement = json.loads(base64.b64decode(envelope["payload"]))
        for subject in statement["subject"]:
            subject["digest"]["sha256"] = hashlib.sha256(members[subject["name"]]).hexdigest()
        members = {**members, "manifest.dsse.json": sign_envelope(statement, reseal_with)}
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as zf:
        for name, data in members.items():
            zf.writestr(name, data)
