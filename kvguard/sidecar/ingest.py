"""Events from an inference process → pseudonymized, signed audit records.

The wire event is the cache event's op, its raw subject and its details. The
subject is replaced by keyed pseudonyms here, the edge where raw ids stop; the
details are the event's own non-identifying fields.
"""

from __future__ import annotations

from typing import Any

from sqlalchemy import select
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session, sessionmaker

from audit.log import AuditLog
from audit.pseudonym import Pseudonymizer, subject_data

from ..errors import InputError
from .models import SubjectLink

OPS = {"quantize", "evict", "offload", "fetch", "free", "erase", "policy"}
WILDCARD = "*"  # an erasure event names only the scope it erased


class Ingestor:
    def __init__(self, log: AuditLog, pseudonyms: Pseudonymizer, sessions: sessionmaker[Session]) -> None:
        self.log = log
        self.pseudonyms = pseudonyms
        self.sessions = sessions
        self._linked: set[tuple[bytes, bytes]] = set()

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
        user, session = raw.get("user"), raw.get("session")
        if user not in (None, WILDCARD) and session not in (None, WILDCARD):
            self.link(tenant, user, session)
        return out

    def link(self, tenant: str, user: str, session: str) -> None:
        """Remember that the session belongs to the user, by index only."""
        idx = self.pseudonyms.index
        pair = (idx(subject_data("user", user, tenant)), idx(subject_data("session", session, tenant)))
        if pair in self._linked:
            return
        with self.sessions() as db:
            if db.get(SubjectLink, pair) is None:
                db.add(SubjectLink(user_idx=pair[0], session_idx=pair[1]))
                try:
                    db.commit()
                except IntegrityError:  # another writer linked it first
                    db.rollback()
        self._linked.add(pair)

    def sessions_of(self, tenant: str, user: str) -> list[bytes]:
        user_idx = self.pseudonyms.index(subject_data("user", user, tenant))
        with self.sessions() as db:
            return list(db.scalars(select(SubjectLink.session_idx).where(SubjectLink.user_idx == user_idx)))

    def forget_user(self, tenant: str, user: str) -> None:
        user_idx = self.pseudonyms.index(subject_data("user", user, tenant))
        with self.sessions() as db:
            for link in db.scalars(select(SubjectLink).where(SubjectLink.user_idx == user_idx)):
                db.delete(link)
            db.commit()
        self._linked = {p for p in self._linked if p[0] != user_idx}

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
        return [record.seq for record in self.log.append_many(items)]
