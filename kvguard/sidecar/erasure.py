"""Erasure requests across the fleet: durable before acknowledged, idempotent, resumed
after a crash, carried out by every sidecar of the database for its own processes.

A request accepted by any sidecar is stored once, with a part for each sidecar of the
fleet (fleet.py). Each sidecar carries out its part: (1) every live inference process
it serves erases the subject's pages and answers once its own `erase` event is recorded
(pending → erased); (2) once every part has erased (or an operator excluded it, with a
reason), the coordinator destroys the subject's pseudonym secrets, once; (3) each
sidecar signs its own `erase` record in its own log, stating what its processes erased,
the secrets destroyed and the fleet (origins taking part, exclusions), and issues its
receipt (erased → done); (4) when every part is done the request completes, and its
receipt is the fleet receipt: every origin's receipt, checked offline together with
`audit.receipt.verify_fleet_receipt`.

What the processes acknowledged is saved with each part as it arrives, so a record
states what every attempt did. Parts run concurrently, so a process that never answers
holds up only the requests that need it. Nothing runs until the processes have had one
liveness window to reconnect after a start.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import json
import re
import time
import uuid
from dataclasses import dataclass

from sqlalchemy import select, update
from sqlalchemy.exc import IntegrityError

from kvguard.audit import ops
from kvguard.audit.canonical import MAX_SAFE_INTEGER, canonical, loads
from kvguard.audit.errors import AuditError
from kvguard.audit.fields import MAX_ARRAY
from kvguard.audit.models import RecordRow
from kvguard.audit.pseudonym import subject_data
from kvguard.audit.receipt import FLEET_RECEIPT_FORMAT
from kvguard.audit.record import Record

from ..errors import InputError
from . import outage
from .fleet import is_down, notify
from .logs import log
from .models import ErasurePart, ErasureRequest, FleetSidecar
from .service import Sidecar

BASES = {"gdpr-art17": "GDPR Art. 17", "pipl-art47": "PIPL Art. 47"}
DAY_MS = 86_400_000
MAX_ATTEMPTS = 3
POLL_S = 1.0  # every open part is looked at this often, announced or not
_UUID = re.compile(r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}")
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
        self._running: dict[str, asyncio.Task] = {}
        self._again: set[str] = set()
        self._only: set[str] = set()  # requests announced since the last round
        self._full = False  # a look at every open request is due
        self._wake = asyncio.Event()
        self._semaphore: tuple[asyncio.AbstractEventLoop, asyncio.Semaphore] | None = None

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
            db.flush()
            # a part for every sidecar of the fleet that has not left, down ones included: a
            # request waits for them, naming them, and is never complete without them
            origins = {m.origin for m in self.sc.fleet.members(db)} | {s.origin}
            db.add_all(ErasurePart(request_id=row.id, origin=o, state="pending", attempts=0, created_ms=now,
                                   updated_ms=now) for o in sorted(origins))
            notify(db, row.id)
            try:
                db.commit()  # durable before the 202
            except IntegrityError:  # the same key raced in: answer with the winner
                db.rollback()
                winner = db.scalar(select(ErasureRequest).where(ErasureRequest.idempotency_sha256 == idem))
                _same_body(winner, body_hmac)
                return winner, False
        self.sc.metrics.erasures_received.inc()
        log.info("erasure request stored", erasure_id=row.id, scope=row.scope, basis=row.legal_basis)
        self.wake(row.id)
        return row, True

    def get(self, request_id: str) -> ErasureRequest | None:
        with self.sc.db() as db:
            return db.get(ErasureRequest, request_id)

    # --- execution ------------------------------------------------------------------------------

    def wake(self, request_id: str | None = None) -> None:
        """Look at one request now, or with None at every open one (from any thread: the
        fleet's listener calls it with each announcement's request id)."""
        loop = self.sc.registry.loop
        if loop is not None and not loop.is_closed():
            loop.call_soon_threadsafe(self._note, request_id)

    def _note(self, request_id: str | None) -> None:
        if request_id is not None and _UUID.fullmatch(request_id):
            self._only.add(request_id)
        else:
            self._full = True
        self._wake.set()

    async def run_forever(self) -> None:
        """Carry out this sidecar's parts of open requests, including those a crash
        interrupted or that arrived while it was down; each runs on its own, so a process
        that never answers holds up only the requests that need it."""
        self.sc.fleet.listen(self.sc.settings.db_url, self.wake)
        next_full = 0.0
        while True:
            self._wake.clear()  # before the round: a change announced during it starts another
            # every open part once a second (the polling); in between, the announced requests only
            full = self._full or time.monotonic() >= next_full
            only, self._only, self._full = self._only, set(), False
            if full:
                next_full = time.monotonic() + POLL_S
            try:
                await self.run_pending(wait=False, only=None if full else only)
            except Exception as exc:  # noqa: BLE001 - keep the loop alive; the request records its error
                if outage.is_outage(exc):  # the database is away: try again, no traceback each second
                    outage.note("erasure loop", exc)
                else:
                    log.exception("erasure loop error")
            try:  # asyncio.timeout, not wait_for: Python 3.11's wait_for swallows a cancel that comes
                # as the wait ends (the loop then never stops)
                async with asyncio.timeout(max(0.0, next_full - time.monotonic())):
                    await self._wake.wait()
            except TimeoutError:
                pass

    async def heartbeat_forever(self) -> None:
        while True:
            await asyncio.sleep(self.sc.fleet.heartbeat_s)
            try:
                await asyncio.to_thread(self.sc.fleet.heartbeat)
            except Exception as exc:  # noqa: BLE001 - the database is away: the fleet sees this sidecar down
                outage.note("fleet heartbeat", exc)

    async def run_pending(self, wait: bool = True, only: set[str] | None = None) -> None:
        """Start an attempt at each of this sidecar's open parts (of the requests in `only`,
        when given) not already running, and with `wait` wait for them. A part whose attempt
        raises counts that attempt (and fails after the last) without keeping the others
        from running."""
        if self.sc.registry.reconnect_wait_s() > 0 or only is not None and not only:
            return  # right after a start: the processes may not have reconnected yet
        if self.sc.log.halted is not None:
            return  # nothing can be signed until the store is repaired: requests wait, no attempt counted
        query = select(ErasurePart.request_id).join(
            ErasureRequest, ErasureRequest.id == ErasurePart.request_id).where(
            ErasurePart.origin == self.sc.settings.origin,
            ErasurePart.state.in_(("pending", "erased", "done")),
            ErasureRequest.state.in_(("received", "executing"))).order_by(ErasureRequest.received_ms)
        if only is not None:
            query = query.where(ErasurePart.request_id.in_(sorted(only)))
        with self.sc.db() as db:
            ids = db.scalars(query).all()
        started = []
        for rid in ids:
            if rid in self._running:  # a change may have come after its attempt looked: look again after it
                self._again.add(rid)
            else:
                self._running[rid] = task = asyncio.create_task(self._attempt(rid), name=f"erasure-{rid}")
                started.append(task)
        if wait and started:
            await asyncio.gather(*started)

    def _slots(self) -> asyncio.Semaphore:
        loop = asyncio.get_running_loop()
        if self._semaphore is None or self._semaphore[0] is not loop:
            self._semaphore = (loop, asyncio.Semaphore(self.sc.settings.max_concurrent_erasures))
        return self._semaphore[1]

    async def _attempt(self, rid: str) -> None:
        try:
            async with self._slots():
                await self.execute(rid)
        except Exception as exc:  # noqa: BLE001 - one request's fault must not stop the others
            # the error's type (and the audit package's own message), never an exception's
            # text from elsewhere: it could carry a subject's ids
            error = f"{type(exc).__name__}: {exc}" if isinstance(exc, AuditError) else type(exc).__name__
            log.error("erasure attempt raised", erasure_id=rid, error=error)
            try:
                self._fail(rid, f"the attempt raised {error}")
            except Exception as again:  # noqa: BLE001 - e.g. the database is down: retried later
                log.error("could not record a failed erasure attempt", erasure_id=rid, error=type(again).__name__)
        finally:
            self._running.pop(rid, None)
            if rid in self._again:
                self._again.discard(rid)
                self._note(rid)

    async def execute(self, request_id: str) -> None:
        """This sidecar's part of one request, as far as the fleet lets it go now:
        (1) its processes erase → (2) the fleet's shredding, once, by the coordinator →
        (3) its own signed erase record → (4) the request completes once every part is done."""
        me = self.sc.settings.origin
        with self.sc.db() as db:
            row = db.get(ErasureRequest, request_id)
            part = db.get(ErasurePart, (request_id, me))
            if row is None or part is None or row.state in ("completed", "failed"):
                return
            if part.state == "pending":
                part.attempts += 1
                row.state, row.attempts = "executing", max(row.attempts, part.attempts)
                db.commit()  # the attempt counts, even when what follows raises
        # (1) every live inference process here that may hold the tenant's data erases and acknowledges
        if part.state == "pending" and not await self._erase_here(row, part):
            return
        # (2) crypto-shredding, once for the fleet, when every part has erased or is excluded
        await asyncio.to_thread(self._shred_if_ready, request_id)
        # (3) this origin's signed erase record and its receipt, once shredded
        await asyncio.to_thread(self._record_part, request_id)
        # (4) the fleet receipt, when every part is done
        await asyncio.to_thread(self._complete_if_ready, request_id)

    async def _erase_here(self, row: ErasureRequest, part: ErasurePart) -> bool:
        subject = self.sc.unseal(row.sealed_subject)
        scope, tenant, target = subject["scope"], subject["tenant"], subject["target"]
        cmd, targets = self.sc.registry.broadcast(scope, tenant, target, self.sc.tenant_index(tenant))
        acks = await self.sc.registry.wait_acks(cmd, targets, self.sc.settings.erasure_ack_timeout_s)
        processes = json.loads(part.processes_json) if part.processes_json else {}
        answered = _merge_acks(processes, acks, row.id)
        missing = set(targets) - answered
        with self.sc.db() as db:
            p = db.get(ErasurePart, (row.id, part.origin))
            if p.state != "pending":  # an operator excluded it meanwhile
                return False
            p.processes_json, p.updated_ms = json.dumps(processes), _now_ms()
            if not missing:
                p.state = "erased"
                notify(db, row.id)  # the coordinator may shred now
            db.commit()
        if missing:
            self._fail(row.id, f"{len(missing)} inference process(es) did not acknowledge in time "
                               "or sent an invalid acknowledgement")
            return False
        self._save_progress(row.id)
        return True

    def _shred_if_ready(self, request_id: str) -> None:
        """The coordinator (the origin that accepted the request, or the first origin left
        when it is excluded) destroys the subject's pseudonym secrets once every part has
        erased: never before, or a process's late erase event would be pseudonymized under
        a fresh secret."""
        with self.sc.db() as db:
            row = db.get(ErasureRequest, request_id)
            parts = _parts(db, request_id)
            if row.shredded_ms is not None or _coordinator(row, parts) != self.sc.settings.origin:
                return
            if any(p.state in ("pending", "failed") for p in parts):
                return
        subject = self.sc.unseal(row.sealed_subject)
        # counted before the WAL truncation that may still fail (a retry then truncates and destroys none)
        tags = self._shred(subject["scope"], subject["tenant"], subject["target"])
        with self.sc.db() as db:
            row = db.get(ErasureRequest, request_id)
            row.secrets_destroyed, row.shredded_ms = len(tags), _now_ms()
            row.shredded_tags = json.dumps(sorted(tags))
            notify(db, request_id)  # every origin may sign its record now
            db.commit()
        self.sc.store.truncate_wal()
        self._save_progress(request_id)

    def _record_part(self, request_id: str) -> None:
        me = self.sc.settings.origin
        with self.sc.db() as db:
            row = db.get(ErasureRequest, request_id)
            part = db.get(ErasurePart, (request_id, me))
            if part.state != "erased" or row.shredded_ms is None:
                return
            fleet = _fleet_details(_parts(db, request_id))
            part.attempts += 1
            row.attempts = max(row.attempts, part.attempts)
            db.commit()
            db.expunge(row)
            db.expunge(part)
        record = self._recorded(row, part) or self._erase_record(row, part, fleet)
        receipt = self._receipt(record.seq)
        with self.sc.db() as db:
            p = db.get(ErasurePart, (request_id, me))
            p.state, p.record_seq, p.receipt_json, p.updated_ms = "done", record.seq, json.dumps(receipt), _now_ms()
            notify(db, request_id)
            db.commit()
        self._save_progress(request_id)

    def _complete_if_ready(self, request_id: str) -> None:
        with self.sc.db() as db:
            row = db.get(ErasureRequest, request_id)
            parts = _parts(db, request_id)
            if row.state in ("completed", "failed") or any(p.state not in ("done", "excluded") for p in parts):
                return
            result = _result(row, parts)
            fleet = _fleet_details(parts)
            receipt = {"format": FLEET_RECEIPT_FORMAT, "request": request_id, **fleet,
                       "receipts": [json.loads(p.receipt_json) for p in parts if p.state == "done"]}
            # once, though every sidecar whose part is done may get here at the same time
            won = db.execute(update(ErasureRequest).where(
                ErasureRequest.id == request_id, ErasureRequest.state.in_(("received", "executing"))).values(
                state="completed", completed_ms=_now_ms(), result_json=json.dumps(result),
                receipt_json=json.dumps(receipt),
                sealed_subject=None,  # the raw ids are not kept past completion
            )).rowcount
            db.commit()
        if not won:
            return
        self.sc.metrics.erasures_completed.inc()
        if result["processes"]:
            log.info("erasure completed", erasure_id=request_id, origins=len(fleet["origins"]),
                     processes=len(result["processes"]))
        else:
            log.warning("erasure completed without any inference process", erasure_id=request_id)

    def result(self, row: ErasureRequest) -> dict | None:
        """What the request shows now: for an open one, its parts as they stand (origins
        pending, down or excluded named); once it ended, what was saved."""
        if row.state in ("completed", "failed"):
            return json.loads(row.result_json) if row.result_json else None
        with self.sc.db() as db:
            return _result(row, _parts(db, row.id), _down(db, self.sc.settings.fleet_deadline_s))

    def _save_progress(self, request_id: str) -> None:
        with self.sc.db() as db:
            row = db.get(ErasureRequest, request_id)
            row.result_json = json.dumps(_result(row, _parts(db, request_id)))
            db.commit()

    def _recorded(self, row: ErasureRequest, part: ErasurePart) -> Record | None:
        """This origin's erase record of the request if an earlier attempt wrote it: by the
        sequence number kept with its part or, after a crash before that was saved, by the
        request id its details carry."""
        origin = self.sc.settings.origin
        if part.record_seq is not None:
            return self.sc.store.record(origin, part.record_seq)
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
            db.get(ErasurePart, (request_id, self.sc.settings.origin)).record_seq = seq
            db.commit()

    def _erase_record(self, row: ErasureRequest, part: ErasurePart, fleet: dict) -> Record:
        # No transaction stays open while the log writer commits: on SQLite it would
        # hold the write lock the writer needs.
        acks = json.loads(part.processes_json) if part.processes_json else {}
        subject = {"tenant": row.tenant_pseudonym, row.scope: row.subject_pseudonym}
        details = {
            "request": row.id, "legal_basis": row.legal_basis, "scope": row.scope,
            "received": row.received_ms, "deadline": row.deadline_ms,
            "processes": sorted(acks),
            "process_erasures": [{"process": pid, **acks[pid]} for pid in sorted(acks)],
            "no_process_acknowledged": not acks,
            "pages_overwritten": _total(acks, "pages"),
            "bytes_overwritten": _total(acks, "bytes"),
            "tier_copies_erased": _total(acks, "tier_copies"),
            "shared_pages_released": _total(acks, "shared_pages"),
            "prefix_entries_removed": _total(acks, "prefix_entries"),
            "secrets_destroyed": row.secrets_destroyed or 0,
            # what `kvguard audit check` matches stored secrets against (audit.pseudonym.shred_tag);
            # a user seen with more sessions than an array holds keeps the first MAX_ARRAY
            "shredded": json.loads(row.shredded_tags or "[]")[:MAX_ARRAY],
            "fleet": fleet,
        }
        if row.reason_hmac:
            details["reason_hmac"] = row.reason_hmac
        record = self.sc.log.append(ops.ERASE, subject, details)
        self._save_record_seq(row.id, record.seq)
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
            part = db.get(ErasurePart, (request_id, self.sc.settings.origin))
            if part is None or part.state == "excluded" or row.state in ("completed", "failed"):
                return
            part.error, part.updated_ms = error, _now_ms()
            if part.attempts >= MAX_ATTEMPTS:
                part.state = "failed"
                row.state, row.error = "failed", error
            else:
                row.state, row.error = "received", error  # retried by the loop
            db.flush()
            row.result_json = json.dumps(_result(row, _parts(db, request_id)))
            notify(db, request_id)
            db.commit()
        log.warning("erasure attempt failed", erasure_id=request_id, error=error)


MAX_REASON = 200  # a record's strings hold at most 256 characters


def exclude(db, request_id: str, origin: str, reason: str) -> None:
    """Close one origin's part of an open request without it, for the reason given (a pod
    gone for good). Every erase record of the request states the exclusion and its reason.
    Refused once the origin's processes have erased (the request then waits for its record
    only), for the last origin taking part, and for a closed request."""
    reason = " ".join(reason.split())
    if not 0 < len(reason) <= MAX_REASON or not reason.isprintable():
        raise InputError(f"give a reason of 1 to {MAX_REASON} printable characters; it is stated in every "
                         "record of the request, so name no person")
    row = db.get(ErasureRequest, request_id)
    if row is None:
        raise InputError(f"no erasure request {request_id}")
    if row.state in ("completed", "failed"):
        raise InputError(f"request {request_id} is {row.state} already")
    part = db.get(ErasurePart, (request_id, origin))
    if part is None:
        known = ", ".join(p.origin for p in _parts(db, request_id))
        raise InputError(f"{origin} has no part in request {request_id} (its origins: {known})")
    if part.state == "excluded":
        return
    if part.state != "pending":
        raise InputError(f"{origin}'s processes have erased already ({part.state}): the request waits for its "
                         "signed record only; start its sidecar again with its data directory and signing key")
    if not any(p.state != "excluded" for p in _parts(db, request_id) if p.origin != origin):
        raise InputError(f"{origin} is the last origin taking part: some sidecar must sign the record")
    done = db.execute(update(ErasurePart).where(
        ErasurePart.request_id == request_id, ErasurePart.origin == origin, ErasurePart.state == "pending",
    ).values(state="excluded", excluded_reason=reason, updated_ms=_now_ms())).rowcount
    if done != 1:
        db.rollback()
        raise InputError(f"{origin}'s part changed meanwhile; look at the request again")
    notify(db, request_id)
    db.commit()
    log.warning("erasure part excluded", erasure_id=request_id, origin=origin)


def _parts(db, request_id: str) -> list[ErasurePart]:
    return list(db.scalars(select(ErasurePart).where(ErasurePart.request_id == request_id)
                           .order_by(ErasurePart.origin)))


def _coordinator(row: ErasureRequest, parts: list[ErasurePart]) -> str | None:
    """Who shreds: the origin that accepted the request, or the first other one not excluded."""
    taking_part = [p.origin for p in parts if p.state != "excluded"]
    return row.origin if row.origin in taking_part else min(taking_part, default=None)


def _fleet_details(parts: list[ErasurePart]) -> dict:
    """The fleet as every record of the request states it: the origins taking part, and the
    ones an operator excluded with their reasons."""
    return {"origins": [p.origin for p in parts if p.state != "excluded"],
            "excluded": [{"origin": p.origin, "reason": p.excluded_reason or ""}
                         for p in parts if p.state == "excluded"]}


def _down(db, deadline_s: float) -> set[str]:
    return {s.origin for s in db.scalars(select(FleetSidecar)) if is_down(s, deadline_s)}


def _result(row: ErasureRequest, parts: list[ErasurePart], down: set[str] | None = None) -> dict:
    processes: dict[str, dict] = {}
    origins = {}
    for p in parts:
        acks = json.loads(p.processes_json) if p.processes_json else {}
        if p.state != "excluded":
            processes.update(acks)
        entry = {"state": p.state, "processes": sorted(acks)}
        if p.record_seq is not None:
            entry["record_seq"] = p.record_seq
        if p.state == "excluded":
            entry["excluded_reason"] = p.excluded_reason
        elif p.error and p.state != "done":
            entry["error"] = p.error
        if down is not None and p.state in ("pending", "erased"):
            entry["sidecar_down"] = p.origin in down
        origins[p.origin] = entry
    result = {"processes": processes, "secrets_destroyed": row.secrets_destroyed or 0,
              "tiers": _tier_totals(processes), "no_process_acknowledged": not processes,
              "origins": origins,
              # what the request waits for: processes that have not erased; once shredded, records
              "pending_origins": [p.origin for p in parts if p.state == "pending"
                                  or p.state == "erased" and row.shredded_ms is not None]}
    if not processes:
        result["notice"] = NO_PROCESS_NOTICE
    return result


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
