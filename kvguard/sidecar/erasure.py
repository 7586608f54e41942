"""Erasure requests: durable before acknowledged, idempotent, resumed after a crash.

received → executing: every live inference process erases the subject's pages
(overwritten, prefix entries dropped) and answers once its own signed `erase`
event is recorded → one signed `erase` record for the request → the subject's
pseudonym secrets are destroyed → a signed checkpoint → the receipt (record,
inclusion proof, checkpoint) → completed.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import time
import uuid
from dataclasses import dataclass

from sqlalchemy import select
from sqlalchemy.exc import IntegrityError

from audit.canonical import MAX_SAFE_INTEGER
from audit.errors import AuditError

from ..errors import InputError
from .logs import log
from .models import ErasureRequest
from .service import Sidecar

BASES = {"gdpr-art17": "GDPR Art. 17", "pipl-art47": "PIPL Art. 47"}
DAY_MS = 86_400_000
MAX_ATTEMPTS = 3
# what a process acknowledges: counts, each a non-negative integer a record can hold
ACK_FIELDS = ("pages", "bytes", "sequences", "shared_pages", "tier_copies", "prefix_entries")


def _now_ms() -> int:
    return time.time_ns() // 1_000_000


@dataclass(frozen=True)
class NewRequest:
    tenant: str
    user: str | None
    session: str | None
    legal_basis: str
    reason: str | None

    @property
    def scope(self) -> str:
        return "user" if self.user is not None else "session"

    @property
    def target(self) -> str:
        return self.user if self.user is not None else self.session  # type: ignore[return-value]


class ErasureService:
    def __init__(self, sidecar: Sidecar) -> None:
        self.sc = sidecar
        self._running: set[str] = set()
        self._wake = asyncio.Event()

    # --- intake ---------------------------------------------------------------------------------

    def create(self, req: NewRequest, idempotency_key: str, principal_id: str, *,
               renew_failed: bool = False) -> tuple[ErasureRequest, bool]:
        """Store the request durably and return it (and whether it is new). The same
        Idempotency-Key from the same principal returns the first request, unless that one
        failed and `renew_failed` is set: then the failed one gives up the key (it stays,
        failed, for the record) and a new request takes it."""
        if (req.user is None) == (req.session is None):
            raise InputError("give exactly one of user or session")
        if req.legal_basis not in BASES:
            raise InputError(f"legal_basis must be one of {sorted(BASES)}")
        idem = hashlib.sha256(f"{principal_id}\x00{idempotency_key}".encode()).hexdigest()
        retired = None
        with self.sc.db() as db:
            existing = db.scalar(select(ErasureRequest).where(ErasureRequest.idempotency_sha256 == idem))
            if existing is not None:
                if not (renew_failed and existing.state == "failed"):
                    return existing, False
                retired = existing.id
        now = _now_ms()
        s = self.sc.settings
        deadline = now + (s.gdpr_deadline_days * DAY_MS if req.legal_basis == "gdpr-art17"
                          else s.pipl_deadline_hours * 3_600_000)
        tenant_p = self.sc.pseudonyms.pseudonym("tenant", req.tenant)
        subject_p = self.sc.pseudonyms.pseudonym(req.scope, req.target, tenant=req.tenant)
        row = ErasureRequest(
            id=str(uuid.uuid4()), origin=s.origin, idempotency_sha256=idem, scope=req.scope,
            legal_basis=req.legal_basis,
            reason_sha256=hashlib.sha256(req.reason.encode()).hexdigest() if req.reason else None,
            tenant_pseudonym=tenant_p, subject_pseudonym=subject_p,
            sealed_subject=self.sc.seal({"tenant": req.tenant, "scope": req.scope, "target": req.target}),
            state="received", received_ms=now, deadline_ms=deadline, attempts=0)
        with self.sc.db() as db:
            if retired is not None:  # in the same transaction as the new request
                failed = db.get(ErasureRequest, retired)
                failed.idempotency_sha256 = hashlib.sha256(f"{idem}\x00retired\x00{retired}".encode()).hexdigest()
                db.flush()
            db.add(row)
            try:
                db.commit()  # durable before the 202
            except IntegrityError:  # the same key raced in: answer with the winner
                db.rollback()
                return db.scalar(select(ErasureRequest).where(ErasureRequest.idempotency_sha256 == idem)), False
        self.sc.metrics.erasures_received.inc()
        log.info("erasure request stored", request_id=row.id, scope=row.scope, basis=row.legal_basis)
        self._wake.set()
        return row, True

    def get(self, request_id: str) -> ErasureRequest | None:
        with self.sc.db() as db:
            return db.get(ErasureRequest, request_id)

    # --- execution ------------------------------------------------------------------------------

    async def run_forever(self) -> None:
        """Execute pending requests, including those a crash interrupted."""
        while True:
            try:
                await self.run_pending()
            except Exception:  # noqa: BLE001 - keep the loop alive; the request records its error
                log.exception("erasure loop error")
            self._wake.clear()
            try:
                await asyncio.wait_for(self._wake.wait(), 1.0)
            except TimeoutError:
                pass

    async def run_pending(self) -> None:
        """One attempt at every open request. A request whose attempt raises counts that
        attempt (and fails after the last) without keeping the others from running."""
        if self.sc.registry.reconnect_wait_s() > 0:
            return  # right after a start: the processes may not have reconnected yet
        with self.sc.db() as db:
            ids = db.scalars(select(ErasureRequest.id).where(
                ErasureRequest.origin == self.sc.settings.origin,
                ErasureRequest.state.in_(("received", "executing")))).all()
        for rid in ids:
            if rid in self._running:
                continue
            self._running.add(rid)
            try:
                await self.execute(rid)
            except Exception as exc:  # noqa: BLE001 - one request's fault must not stop the others
                # the error's type (and the audit package's own message), never an exception's
                # text from elsewhere: it could carry a subject's ids
                error = f"{type(exc).__name__}: {exc}" if isinstance(exc, AuditError) else type(exc).__name__
                log.error("erasure attempt raised", request_id=rid, error=error)
                try:
                    self._fail(rid, f"the attempt raised {error}")
                except Exception as again:  # noqa: BLE001 - e.g. the database is down: retried later
                    log.error("could not record a failed erasure attempt", request_id=rid,
                              error=type(again).__name__)
            finally:
                self._running.discard(rid)

    async def execute(self, request_id: str) -> None:
        with self.sc.db() as db:
            row = db.get(ErasureRequest, request_id)
            if row is None or row.state in ("completed", "failed"):
                return
            row.state, row.attempts = "executing", row.attempts + 1
            db.commit()  # the attempt counts, even when what follows raises
        subject = self.sc.unseal(row.sealed_subject)
        scope, tenant, target = subject["scope"], subject["tenant"], subject["target"]
        # (1) every live inference process erases and acknowledges
        cmd, targets = self.sc.registry.broadcast(scope, tenant, target)
        acks = _valid_acks(await self.sc.registry.wait_acks(cmd, targets, self.sc.settings.erasure_ack_timeout_s),
                           request_id)
        missing = set(targets) - set(acks)
        if missing:
            self._fail(request_id, f"{len(missing)} inference process(es) did not acknowledge in time "
                                   "or sent an invalid acknowledgement")
            return
        # (2) one signed erase record for the request (once, even when resumed)
        record = await asyncio.to_thread(self._erase_record, request_id, scope, acks)
        # (3) crypto-shred: the subject's pseudonym secrets
        shredded = self._shred(scope, tenant, target)
        # (4) a signed checkpoint covering the record, and the receipt
        receipt = await asyncio.to_thread(self._receipt, record.seq)
        result = {"processes": acks, "secrets_destroyed": shredded,
                  "tiers": _tier_totals(acks)}
        with self.sc.db() as db:
            row = db.get(ErasureRequest, request_id)
            row.state, row.completed_ms = "completed", _now_ms()
            row.result_json, row.receipt_json = json.dumps(result), json.dumps(receipt)
            row.sealed_subject = None  # the raw ids are not kept past completion
            db.commit()
        self.sc.metrics.erasures_completed.inc()
        log.info("erasure completed", request_id=request_id, record_seq=record.seq, processes=len(acks))

    def _erase_record(self, request_id: str, scope: str, acks: dict[str, dict]):
        # No transaction stays open while the log writer commits: on SQLite it would
        # hold the write lock the writer needs.
        with self.sc.db() as db:
            row = db.get(ErasureRequest, request_id)
            db.expunge(row)
        if row.record_seq is not None:
            return self.sc.store.record(self.sc.settings.origin, row.record_seq)
        subject = {"tenant": row.tenant_pseudonym, scope: row.subject_pseudonym}
        details = {
            "request": request_id, "legal_basis": row.legal_basis, "scope": row.scope,
            "received": row.received_ms, "deadline": row.deadline_ms,
            "processes": sorted(acks),
            "pages_overwritten": _total(acks, "pages"),
            "bytes_overwritten": _total(acks, "bytes"),
            "tier_copies_erased": _total(acks, "tier_copies"),
            "shared_pages_released": _total(acks, "shared_pages"),
            "prefix_entries_removed": _total(acks, "prefix_entries"),
        }
        if row.reason_sha256:
            details["reason_sha256"] = row.reason_sha256
        record = self.sc.log.append("erase", subject, details)
        with self.sc.db() as db:
            db.get(ErasureRequest, request_id).record_seq = record.seq
            db.commit()
        return record

    def _shred(self, scope: str, tenant: str, target: str) -> int:
        p = self.sc.pseudonyms
        n = int(p.shred(scope, target, tenant=tenant))
        if scope == "user":  # every session the user was seen with goes too
            for session_idx in self.sc.ingest.sessions_of(tenant, target):
                n += int(self.sc.store.delete_subject_secret(session_idx))
            self.sc.ingest.forget_user(tenant, target)
        return n

    def _receipt(self, seq: int) -> dict:
        from audit.receipt import make_receipt

        self.sc.log.checkpoint()
        return make_receipt(self.sc.log, seq)

    def _fail(self, request_id: str, error: str) -> None:
        with self.sc.db() as db:
            row = db.get(ErasureRequest, request_id)
            if row.attempts >= MAX_ATTEMPTS:
                row.state, row.error = "failed", error
            else:
                row.state, row.error = "received", error  # retried by the loop
            db.commit()
        log.warning("erasure attempt failed", request_id=request_id, error=error)


def _valid_acks(acks: dict[str, dict], request_id: str) -> dict[str, dict]:
    """The acknowledgements that are objects of non-negative integers a record can hold;
    any other counts as no acknowledgement from its process."""
    good = {}
    for pid, ack in acks.items():
        if isinstance(ack, dict) and all(type(ack.get(f)) is int and 0 <= ack[f] <= MAX_SAFE_INTEGER
                                         for f in ACK_FIELDS):
            good[pid] = {f: ack[f] for f in ACK_FIELDS}
        else:
            log.warning("invalid erasure acknowledgement", request_id=request_id, process=pid)
    return good


def _total(acks: dict[str, dict], field: str) -> int:
    return sum(a[field] for a in acks.values())


def _tier_totals(acks: dict[str, dict]) -> dict[str, int]:
    return {
        "device_pages_overwritten": _total(acks, "pages"),
        "lower_tier_copies_erased": _total(acks, "tier_copies"),
    }
