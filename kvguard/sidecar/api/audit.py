"""Audit queries: records (filtered, paginated), the latest signed checkpoint, inclusion
and consistency proofs (hashes in hex, as docs/audit-format.md §4 writes them in JSON),
the log's public keys, and the store check for periodic runs."""

from __future__ import annotations

import threading
import time
from typing import Annotated, Literal

from fastapi import APIRouter, Query
from fastapi.responses import PlainTextResponse
from pydantic import BaseModel
from sqlalchemy import select

from kvguard.audit import ops
from kvguard.audit.canonical import loads
from kvguard.audit.models import RecordRow

from ..logs import log
from .deps import Admin, AuditRead, SidecarDep
from .problems import Problem, documented

router = APIRouter(prefix="/v1/audit", tags=["audit"], responses=documented(401, 403, 503))

Op = Literal[tuple(sorted(ops.OPS))]  # every op kvguard writes, no other
Pseudonym = Annotated[str, Query(pattern=r"^[0-9a-f]{32}$", description="a tenant, user or session pseudonym")]


class RecordPage(BaseModel):
    records: list[dict]
    next_after: int | None  # pass as `after` for the next page


@router.get("/records", response_model=RecordPage, summary="Signed records, oldest first")
def records(sidecar: SidecarDep, _: AuditRead,
            since_ms: Annotated[int | None, Query(ge=0, le=2**53)] = None,
            until_ms: Annotated[int | None, Query(ge=0, le=2**53)] = None,
            op: Op | None = None, pseudonym: Pseudonym | None = None,
            after: Annotated[int, Query(ge=-1, le=2**53)] = -1,
            limit: Annotated[int, Query(ge=1, le=1000)] = 100) -> RecordPage:
    q = select(RecordRow.seq, RecordRow.body).where(
        RecordRow.origin == sidecar.settings.origin, RecordRow.seq > after).order_by(RecordRow.seq).limit(limit + 1)
    if since_ms is not None:
        q = q.where(RecordRow.time_ms >= since_ms)
    if until_ms is not None:
        q = q.where(RecordRow.time_ms < until_ms)
    if op is not None:
        q = q.where(RecordRow.op == op)
    if pseudonym is not None:
        q = q.where((RecordRow.tenant_pseudonym == pseudonym) | (RecordRow.user_pseudonym == pseudonym)
                    | (RecordRow.session_pseudonym == pseudonym))
    with sidecar.engine.connect() as conn:
        rows = conn.execute(q).all()
    more = len(rows) > limit
    rows = rows[:limit]
    return RecordPage(records=[loads(body) for _, body in rows], next_after=rows[-1][0] if more else None)


class CheckpointOut(BaseModel):
    origin: str
    tree_size: int
    root_hash: str  # hex (the note itself carries it in base64, as C2SP checkpoints do)
    note: str  # the C2SP signed note


@router.get("/checkpoint", response_model=CheckpointOut, summary="The latest signed checkpoint")
def checkpoint(sidecar: SidecarDep, _: AuditRead) -> CheckpointOut:
    cp = sidecar.log.checkpoint()
    return CheckpointOut(origin=sidecar.settings.origin, tree_size=cp.size,
                         root_hash=cp.root.hex(), note=cp.note)


@router.get("/checkpoint.txt", response_class=PlainTextResponse, summary="The latest checkpoint as a signed note")
def checkpoint_note(sidecar: SidecarDep, _: AuditRead) -> str:
    return sidecar.log.checkpoint().note


class Proof(BaseModel):
    tree_size: int
    hashes: list[str]  # hex, RFC 9162 order


def _size(sidecar, size: int | None) -> int:
    current = sidecar.log.size
    if size is None:
        return current
    if size > current:
        raise Problem(422, "Unprocessable Content", f"tree_size {size} exceeds the log's size {current}")
    return size


@router.get("/proofs/inclusion", response_model=Proof, summary="Inclusion proof of one record (RFC 9162 2.1.3)")
def inclusion(sidecar: SidecarDep, _: AuditRead, seq: Annotated[int, Query(ge=0, le=2**53)],
              tree_size: Annotated[int | None, Query(ge=1, le=2**53)] = None) -> Proof:
    size = _size(sidecar, tree_size)
    if seq >= size:
        raise Problem(422, "Unprocessable Content", f"record {seq} is not in a tree of size {size}")
    return Proof(tree_size=size, hashes=[h.hex() for h in sidecar.log.inclusion_proof(seq, size)])


@router.get("/proofs/consistency", response_model=Proof, summary="Consistency proof between two sizes (RFC 9162 2.1.4)")
def consistency(sidecar: SidecarDep, _: AuditRead, first: Annotated[int, Query(ge=1, le=2**53)],
                second: Annotated[int | None, Query(ge=1, le=2**53)] = None) -> Proof:
    size = _size(sidecar, second)
    if first > size:
        raise Problem(422, "Unprocessable Content", f"first {first} is larger than second {size}")
    return Proof(tree_size=size,
                 hashes=[h.hex() for h in sidecar.log.consistency_proof(first, size)])


@router.get("/public-keys", summary="The log's public keys, with the record each is valid from")
def public_keys(sidecar: SidecarDep, _: AuditRead) -> list[dict]:
    return [{"key_id": k.key.key_id, "public_key_pem": k.key.to_pem(), "valid_from_seq": k.valid_from_seq}
            for k in sidecar.store.keys(sidecar.settings.origin)]


class CheckResult(BaseModel):
    consistent: bool
    origin: str
    records: int  # records checked (up to the failure, when one is found)
    seconds: float
    failure: dict | None = None  # check, message, origin, seq, record: the first failure


_checking = threading.Lock()


@router.post("/check", response_model=CheckResult, responses=documented(409),
             summary="Check this sidecar's log in the store (kvguard audit check), for periodic runs")
def check(sidecar: SidecarDep, _: Admin) -> CheckResult:
    """Every record's signature, chain, key, leaf hash and query columns, every checkpoint,
    the keys table against the rotation records, and that no subject secret an erase record
    destroyed is stored again. Answers 200 either way (`consistent`); the result also goes to
    the kvguard_audit_check_* metrics. One run at a time: 409 while one is running."""
    from kvguard.audit.check import check_store
    from kvguard.audit.errors import VerificationError

    if not _checking.acquire(blocking=False):
        raise Problem(409, "Conflict", "a store check is running; wait for its result (see /metrics)")
    origin, started, seen = sidecar.settings.origin, time.perf_counter(), [0]
    try:
        try:
            summary = check_store(sidecar.store, [origin], progress=lambda n: seen.__setitem__(0, seen[0] + n))
        except VerificationError as exc:
            sidecar.metrics.checked(exc)
            log.error("audit store check failed", origin=exc.origin, seq=exc.seq, check=exc.check,
                      reason=exc.message)
            return CheckResult(consistent=False, origin=origin, records=seen[0],
                               seconds=time.perf_counter() - started, failure=exc.to_dict())
        sidecar.metrics.checked(None)
        return CheckResult(consistent=True, origin=origin, records=summary.records, seconds=summary.seconds)
    finally:
        _checking.release()
