"""Erasure requests: durable before acknowledged, idempotent, resumed after a crash.

received → executing: every live inference process erases the subject's pages
(overwritten, prefix entries dropped) and answers once its own signed `erase`
event is recorded → the subject's pseudonym secrets are destroyed → one signed
`erase` record for the request, stating what each process erased and how many
secrets were destroyed → a signed checkpoint → the receipt (record, inclusion
proof, checkpoint) → completed.

What the processes acknowledged and the secrets destroyed are saved with the
request as each step ends, so an attempt resumed after a failure or a crash
signs what every attempt did, not only what was left to do. Nothing runs until
the processes have had one liveness window to reconnect after a start.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import json
import time
import uuid
from dataclasses import dataclass

from sqlalchemy import select
from sqlalchemy.exc import IntegrityError

from kvguard.audit import ops
from kvguard.audit.canonical import MAX_SAFE_INTEGER, canonical, loads
from kvguard.audit.errors import AuditError
from kvguard.audit.fields import MAX_ARRAY
from kvguard.audit.models import RecordRow
from kvguard.audit.pseudonym import subject_data
from kvguard.audit.record import Record

from ..errors import InputError
from . import outage
from .logs import log
from .models import ErasureRequest
from .service import Sidecar

BASES = {"gdpr-art17": "GDPR Art. 17", "pipl-art47": "PIPL Art. 47"}
DAY_MS = 86_400_000
MAX_ATTEMPTS = 3
# what a process acknowledges: counts, each a non-negative integer a record can hold
ACK_FIELDS = ("pages", "bytes", "sequences", "shared_pages", "tier_copies", "prefix_entries")
NO_PROCESS_NOTICE = ("no inference process acknowledged this erasure (none was live that may hold the tenant's "
                     "data): nothing held in an inference process's memory or lower tiers was erased by it; "
                     "only the subject's pseudonym secrets were destroyed")


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

    def body_hmac(self, key: bytes) -> str:
        """A keyed digest of the request's canonical body (RFC 8785), to tell a retry from
        another request under the same Idempotency-Key without keeping the ids."""
        body = {"tenant": self.tenant, "user": self.user, "session": self.session,
                "legal_basis": self.legal_basis, "reason": self.reason}
        return hmac.new(key, b"kvguard-idempotency\x00" + canonical(body), hashlib.sha256).hexdigest()


class IdempotencyKeyReused(InputError):
    """The Idempotency-Key names an earlier request with another body (answered 422)."""


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
        failed, for the record) and a new request takes it. The same key with another body
        raises IdempotencyKeyReused: the second subject would otherwise never be erased."""
        if (req.user is None) == (req.session is None):
            raise InputError("give exactly one of user or session")
        if req.legal_basis not in BASES:
            raise InputError(f"legal_basis must be one of {sorted(BASES)}")
        idem = hashlib.sha256(f"{principal_id}\x00{idempotency_key}".encode()).hexdigest()
        body_hmac = req.body_hmac(self.sc.idempotency_key)
        retired = None
        with self.sc.db() as db:
            existing = db.scalar(select(ErasureRequest).where(ErasureRequest.idempotency_sha256 == idem))
            if existing is not None:
                _same_body(existing, body_hmac)
                if not (renew_failed and existing.state == "failed"):
                    return existing, False
                retired = existing.id
        now = _now_ms()
        s = self.sc.settings
        deadline = now + (s.gdpr_deadline_days * DAY_MS if req.legal_basis == "gdpr-art17"
                          else s.pipl_deadline_hours * 3_600_000)
        tenant_p = self.sc.pseudonyms.pseudonym("tenant", req.tenant)
        subject_p = self.sc.pseudonyms.pseudonym(req.scope, req.target, tenant=req.tenant)
        # the reason may name the person: only an HMAC under the subject's secret, which this
        # request shreds, so no one can confirm a guessed reason afterwards
        reason_hmac = (self.sc.pseudonyms.reason_hmac(req.scope, req.target, req.reason, tenant=req.tenant)
                       if req.reason else None)
        row = ErasureRequest(
            id=str(uuid.uuid4()), origin=s.origin, idempotency_sha256=idem, body_hmac=body_hmac, scope=req.scope,
            legal_basis=req.legal_basis,
            reason_hmac=reason_hmac,
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
                winner = db.scalar(select(ErasureRequest).where(ErasureRequest.idempotency_sha256 == idem))
                _same_body(winner, body_hmac)
                return winner, False
        self.sc.metrics.erasures_received.inc()
        log.info("erasure request stored", erasure_id=row.id, scope=row.scope, basis=row.legal_basis)
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
            except Exception as exc:  # noqa: BLE001 - keep the loop alive; the request records its error
                if outage.is_outage(exc):  # the database is away: try again, no traceback each second
                    outage.note("erasure loop", exc)
                else:
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
        if self.sc.log.halted is not None:
            return  # nothing can be signed until the store is repaired: requests wait, no attempt counted
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
                log.error("erasure attempt raised", erasure_id=rid, error=error)
                try:
                    self._fail(rid, f"the attempt raised {error}")
                except Exception as again:  # noqa: BLE001 - e.g. the database is down: retried later
                    log.error("could not record a failed erasure attempt", erasure_id=rid,
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
        progress = json.loads(row.result_json) if row.result_json else {"processes": {}, "secrets_destroyed": 0}
        # a record written by an earlier attempt means every step before it is done
        record = await asyncio.to_thread(self._recorded, row)
        if record is None:
            subject = self.sc.unseal(row.sealed_subject)
            scope, tenant, target = subject["scope"], subject["tenant"], subject["target"]
            # (1) every live inference process that may hold the tenant's data erases and acknowledges
            cmd, targets = self.sc.registry.broadcast(scope, tenant, target, self.sc.tenant_index(tenant))
            acks = await self.sc.registry.wait_acks(cmd, targets, self.sc.settings.erasure_ack_timeout_s)
            answered = _merge_acks(progress["processes"], acks, request_id)
            self._save_progress(request_id, progress)
            missing = set(targets) - answered
            if missing:
                self._fail(request_id, f"{len(missing)} inference process(es) did not acknowledge in time "
                                       "or sent an invalid acknowledgement")
                return
            # (2) crypto-shred: the subject's pseudonym secrets, counted before the WAL
            # truncation that may still fail (a retry then truncates and destroys none)
            tags = await asyncio.to_thread(self._shred, scope, tenant, target)
            progress["secrets_destroyed"] += len(tags)
            progress["shredded"] = progress.get("shredded", []) + tags
            self._save_progress(request_id, progress)
            await asyncio.to_thread(self.sc.store.truncate_wal)
            # (3) one signed erase record for the request, attesting (1) and (2)
            record = await asyncio.to_thread(self._erase_record, request_id, progress)
        # (4) a signed checkpoint covering the record, and the receipt
        receipt = await asyncio.to_thread(self._receipt, record.seq)
        acks = progress["processes"]
        result = {"processes": acks, "secrets_destroyed": progress["secrets_destroyed"],
                  "tiers": _tier_totals(acks), "no_process_acknowledged": not acks}
        if not acks:
            result["notice"] = NO_PROCESS_NOTICE
        with self.sc.db() as db:
            row = db.get(ErasureRequest, request_id)
            row.state, row.completed_ms = "completed", _now_ms()
            row.result_json, row.receipt_json = json.dumps(result), json.dumps(receipt)
            row.sealed_subject = None  # the raw ids are not kept past completion
            db.commit()
        self.sc.metrics.erasures_completed.inc()
        if acks:
            log.info("erasure completed", erasure_id=request_id, record_seq=record.seq, processes=len(acks))
        else:
            log.warning("erasure completed without any inference process", erasure_id=request_id,
                        record_seq=record.seq)

    def _save_progress(self, request_id: str, progress: dict) -> None:
        with self.sc.db() as db:
            db.get(ErasureRequest, request_id).result_json = json.dumps(progress)
            db.commit()

    def _recorded(self, row: ErasureRequest) -> Record | None:
        """The request's erase record if an earlier attempt wrote it: by the sequence number
        kept with the request or, after a crash before that was saved, by the request id
        its details carry."""
        origin = self.sc.settings.origin
        if row.record_seq is not None:
            return self.sc.store.record(origin, row.record_seq)
        column = RecordRow.user_pseudonym if row.scope == "user" else RecordRow.session_pseudonym
        query = select(RecordRow.seq, RecordRow.body).where(
            RecordRow.origin == origin, RecordRow.op == ops.ERASE, column == row.subject_pseudonym
        ).order_by(RecordRow.seq)
        with self.sc.store.read() as conn:
            for seq, body in conn.execute(query):
                if loads(body)["details"].get("request") == row.id:
                    self._save_record_seq(row.id, seq)
                    return Record.from_leaf_bytes(body.encode("utf-8"))
        return None

    def _save_record_seq(self, request_id: str, seq: int) -> None:
        with self.sc.db() as db:
            db.get(ErasureRequest, request_id).record_seq = seq
            db.commit()

    def _erase_record(self, request_id: str, progress: dict) -> Record:
        # No transaction stays open while the log writer commits: on SQLite it would
        # hold the write lock the writer needs.
        with self.sc.db() as db:
            row = db.get(ErasureRequest, request_id)
            db.expunge(row)
        acks = progress["processes"]
        subject = {"tenant": row.tenant_pseudonym, row.scope: row.subject_pseudonym}
        details = {
            "request": request_id, "legal_basis": row.legal_basis, "scope": row.scope,
            "received": row.received_ms, "deadline": row.deadline_ms,
            "processes": sorted(acks),
            "process_erasures": [{"process": pid, **acks[pid]} for pid in sorted(acks)],
            "no_process_acknowledged": not acks,
            "pages_overwritten": _total(acks, "pages"),
            "bytes_overwritten": _total(acks, "bytes"),
            "tier_copies_erased": _total(acks, "tier_copies"),
            "shared_pages_released": _total(acks, "shared_pages"),
            "prefix_entries_removed": _total(acks, "prefix_entries"),
            "secrets_destroyed": progress["secrets_destroyed"],
            # what `kvguard audit check` matches stored secrets against (audit.pseudonym.shred_tag);
            # a user seen with more sessions than an array holds keeps the first MAX_ARRAY
            "shredded": sorted(progress.get("shredded", []))[:MAX_ARRAY],
        }
        if row.reason_hmac:
            details["reason_hmac"] = row.reason_hmac
        record = self.sc.log.append(ops.ERASE, subject, details)
        self._save_record_seq(request_id, record.seq)
        return record

    def _shred(self, scope: str, tenant: str, target: str) -> list[str]:
        """Delete the secrets; the shred tag of each one deleted (the caller truncates
        SQLite's WAL once, afterwards)."""
        p, store = self.sc.pseudonyms, self.sc.store
        found = [store.shred_subject_secret(p.index(subject_data(scope, target, tenant)), truncate_wal=False)]
        if scope == "user":  # every session the user was seen with goes too
            for session_idx in self.sc.ingest.sessions_of(tenant, target):
                found.append(store.shred_subject_secret(session_idx, truncate_wal=False))
            self.sc.ingest.forget_user(tenant, target)
        return [tag for tag in found if tag is not None]

    def _receipt(self, seq: int) -> dict:
        from kvguard.audit.receipt import make_receipt

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
        log.warning("erasure attempt failed", erasure_id=request_id, error=error)


def _same_body(existing: ErasureRequest, body_hmac: str) -> None:
    # a request stored before bodies were digested has none: it is taken as the same
    if existing.body_hmac is not None and not hmac.compare_digest(existing.body_hmac, body_hmac):
        raise IdempotencyKeyReused("this Idempotency-Key was already used for a request with another body; "
                                   "send a new key for a new request (the earlier request is unchanged)")


def _merge_acks(processes: dict[str, dict], acks: dict[str, dict], request_id: str) -> set[str]:
    """Add each valid acknowledgement to what its process acknowledged in earlier attempts;
    returns the processes whose acknowledgement counts. One that is not an object of
    non-negative integers a record can hold counts as no acknowledgement."""
    answered = set()
    for pid, ack in acks.items():
        before = processes.get(pid, dict.fromkeys(ACK_FIELDS, 0))
        if not isinstance(ack, dict) or not all(
                type(ack.get(f)) is int and 0 <= ack[f] and before[f] + ack[f] <= MAX_SAFE_INTEGER
                for f in ACK_FIELDS):
            log.warning("invalid erasure acknowledgement", erasure_id=request_id, process=pid)
            continue
        processes[pid] = {f: before[f] + ack[f] for f in ACK_FIELDS}
        answered.add(pid)
    return answered


def _total(acks: dict[str, dict], field: str) -> int:
    return sum(a[field] for a in acks.values())


def _tier_totals(acks: dict[str, dict]) -> dict[str, int]:
    return {
        "device_pages_overwritten": _total(acks, "pages"),
        "lower_tier_copies_erased": _total(acks, "tier_copies"),
    }
