"""Events from an inference process → pseudonymized, signed audit records.

The wire event is the cache event's op, its raw subject and its details. The
subject is replaced by keyed pseudonyms here, the edge where raw ids stop; the
details are the event's own non-identifying fields.
"""

from __future__ import annotations

from typing import Any

from audit.log import AuditLog
from audit.pseudonym import Pseudonymizer

from ..errors import InputError

OPS = {"quantize", "evict", "offload", "fetch", "free", "erase", "policy"}
WILDCARD = "*"  # an erasure event names only the scope it erased


class Ingestor:
    def __init__(self, log: AuditLog, pseudonyms: Pseudonymizer) -> None:
        self.log = log
        self.pseudonyms = pseudonyms

    def subject(self, raw: dict[str, str], cache: dict) -> dict[str, str]:
        """Pseudonyms of a raw subject; `cache` lives for one batch only, so a subject
        shredded meanwhile is never served from memory later."""
        tenant = raw.get("tenant")
        out = {}
        for kind in ("tenant", "user", "session"):
            value = raw.get(kind)
            if value is None or value == WILDCARD:
                continue
            key = (kind, tenant, value)
            if key not in cache:
                cache[key] = self.pseudonyms.pseudonym(kind, value, tenant=None if kind == "tenant" else tenant)
            out[kind] = cache[key]
        return out

    def record_batch(self, client_id: str, events: list[dict[str, Any]]) -> list[int]:
        """Append one record per event; returns their sequence numbers once durable."""
        cache: dict = {}
        items = []
        for e in events:
            op = e.get("op")
            if op not in OPS:
                raise InputError(f"unknown event op {op!r}")
            details = dict(e.get("details") or {})
            details["process"] = client_id
            items.append((op, self.subject(e.get("subject") or {}, cache), details))
        futures = [self.log.submit(op, subject, details) for op, subject, details in items]
        return [f.result().seq for f in futures]
