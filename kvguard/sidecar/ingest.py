"""Events from an inference process → pseudonymized, signed audit records.

The wire event is the cache event's op, its raw subject and its details. The
subject is replaced by keyed pseudonyms here, the edge where raw ids stop; the
details are the event's own non-identifying fields.

An event becomes one record, or several when its page list is longer than a
record's array may be (`audit.fields.MAX_ARRAY`): parts that together list every
page (`split_pages`). An event that cannot be recorded as sent (an unknown op,
details outside the format) becomes an `ingest_error` record in its place, so one
bad event neither fails its batch nor goes unrecorded.
"""

from __future__ import annotations

import json
import time
from typing import Any

from sqlalchemy import select, update
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session, sessionmaker

from kvguard.audit import fields, ops
from kvguard.audit.errors import RecordFormatError
from kvguard.audit.log import AuditLog
from kvguard.audit.pseudonym import Pseudonymizer, subject_data
from kvguard.audit.record import Record

from .models import IngestProgress, SubjectLink

WILDCARD = "*"  # an erasure event names only the scope it erased
# What an operation touched, divided among the parts of a split event so that each sums to
# the operation's total; every other member of the details is repeated in each part.
COUNTS = ("n_tokens", "bytes", "bytes_before", "stored_bytes", "sequences", "shared_pages", "tier_copies",
          "prefix_entries")


def split_pages(details: dict[str, Any], limit: int = fields.MAX_ARRAY) -> list[dict[str, Any]]:
    """The details of the records of one event: the event's own, or, when its `pages` is longer
    than `limit`, parts of at most `limit` pages in order, numbered `part` 1..`parts`, with the
    COUNTS apportioned by pages (part i gets total*end_i//n - total*start_i//n)."""
    pages = details.get("pages")
    if not isinstance(pages, list) or len(pages) <= limit:
        return [details]
    total, parts = len(pages), -(-len(pages) // limit)
    out = []
    for i in range(parts):
        lo, hi = i * limit, min((i + 1) * limit, total)
        part = {**details, "pages": pages[lo:hi], "part": i + 1, "parts": parts}
        for key in COUNTS:
            value = details.get(key)
            if type(value) is int:
                part[key] = value * hi // total - value * lo // total
        out.append(part)
    return out


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

    def record_batch(self, process: str, events: list[dict[str, Any]]) -> tuple[list[Record], list[dict]]:
        """Append the records of a batch of events, in order; returns them once durable, and
        the events recorded as `ingest_error` instead ({"n", "op", "reason"})."""
        cache: dict = {}
        planned = []  # per event: the event, its subject's pseudonyms, its records' details
        for e in events:
            # the event's number in every record of it: what `recorded_up_to` reads back
            details = {**(e.get("details") or {}), "process": process, "event": e["n"]}
            planned.append((e, self.subject(e.get("subject") or {}, cache), split_pages(details)))
        if all(e["op"] in ops.EVENT_OPS and _nesting(e.get("details")) <= fields.MAX_DEPTH for e, _, _ in planned):
            try:  # the usual case: every record valid, checked once, by the log
                return self.log.append_many([(e["op"], subject, d) for e, subject, parts in planned
                                             for d in parts]), []
            except RecordFormatError:
                pass  # some event's details are outside the format: find which, below
        items, refused = [], []
        for e, subject, parts in planned:
            reason = _unrecordable(e["op"], parts)
            if reason is None:
                items.extend((e["op"], subject, d) for d in parts)
                continue
            # the operation happened: say so, without the details the format refuses
            refused.append({"n": e["n"], "op": e["op"], "reason": reason})
            items.append((ops.INGEST_ERROR, subject, {"process": process, "event": e["n"],
                                                      "event_op": e["op"], "reason": reason}))
        return self.log.append_many(items), refused


    # --- durable event numbers ------------------------------------------------------------------

    def recorded_up_to(self, process: str) -> int:
        """The highest event number n of the process start such that every event up to n is
        in the log (-1: none). The progress row says where its last known batch ended; records
        of the process after that belong to a batch whose acknowledgement was lost (a crash, a
        commit whose answer the database outage swallowed) and are read back here. An event
        counts only with every part of it stored."""
        origin = self.log.origin
        with self.sessions() as db:
            row = db.get(IngestProgress, (origin, process))
        if row is None:  # a new process start: the row first, so that none of its records precede it
            self.save_progress(process, -1, self.log.size)
            return -1
        last, start = row.last_event, row.log_size
        needle = f'"process":"{process}"'
        parts: dict[int, int] = {}  # event -> parts stored
        whole: set[int] = set()
        for _seq, body, _sig, _leaf in self.log.store.iter_bodies(origin, start):
            if needle not in body:
                continue
            details = json.loads(body)["details"]
            n = details.get("event")
            if details.get("process") != process or type(n) is not int:
                continue
            parts[n] = parts.get(n, 0) + 1
            if parts[n] >= details.get("parts", 1):
                whole.add(n)
        while last + 1 in whole:
            last += 1
        return last

    def save_progress(self, process: str, last_event: int, log_size: int) -> None:
        """Every event of the process up to `last_event` is stored, the last of them before `log_size`."""
        origin, now = self.log.origin, int(time.time() * 1000)
        values = {"last_event": last_event, "log_size": log_size, "updated_ms": now}
        with self.sessions() as db:
            done = db.execute(update(IngestProgress).where(IngestProgress.origin == origin,
                                                            IngestProgress.client == process).values(**values))
            if done.rowcount == 0:
                db.add(IngestProgress(origin=origin, client=process, **values))
            db.commit()


def _nesting(value: Any) -> int:
    """How deep arrays and objects nest in `value` (a scalar: 0), without recursion."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        v, depth = stack.pop()
        if isinstance(v, dict | list):
            deepest = max(deepest, depth)
            stack.extend((item, depth + 1) for item in (v.values() if isinstance(v, dict) else v))
    return deepest


def _unrecordable(op: str, parts: list[dict[str, Any]]) -> str | None:
    """Why an event cannot be recorded as sent, or None."""
    if op not in ops.EVENT_OPS:  # what an inference process may send (audit.ops)
        return "unknown_op"
    # arrays nest as deep as objects may (the format bounds objects only): a record nested
    # hundreds deep is signed, but no reader of the log can serialize it back
    if any(_nesting(d) > fields.MAX_DEPTH for d in parts):
        return "details"
    try:
        for d in parts:
            fields.check_details(d)
    except RecordFormatError:
        return "details"
    return None
