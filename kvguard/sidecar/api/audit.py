"""Audit queries: records (filtered, paginated), the latest signed checkpoint, inclusion
and consistency proofs, and the log's public keys."""

from __future__ import annotations

import base64
from typing import Annotated, Literal

from fastapi import APIRouter, Query
from fastapi.responses import PlainTextResponse
from pydantic import BaseModel
from sqlalchemy import select

from kvguard.audit import ops
from kvguard.audit.canonical import loads
from kvguard.audit.models import RecordRow

from .deps import AuditRead, SidecarDep
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
    root_hash: str  # base64
    note: str  # the C2SP signed note


@router.get("/checkpoint", response_model=CheckpointOut, summary="The latest signed checkpoint")
def checkpoint(sidecar: SidecarDep, _: AuditRead) -> CheckpointOut:
    cp = sidecar.log.checkpoint()
    return CheckpointOut(origin=sidecar.settings.origin, tree_size=cp.size,
                         root_hash=base64.b64encode(cp.root).decode(), note=cp.note)


@router.get("/checkpoint.txt", response_class=PlainTextResponse, summary="The latest checkpoint as a signed note")
def checkpoint_note(sidecar: SidecarDep, _: AuditRead) -> str:
    return sidecar.log.checkpoint().note


class Proof(BaseModel):
    tree_size: int
    hashes: list[str]  # base64, RFC 9162 order


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
    return Proof(tree_size=size, hashes=[base64.b64encode(h).decode() for h in sidecar.log.inclusion_proof(seq, size)])


@router.get("/proofs/consistency", response_model=Proof, summary="Consistency proof between two sizes (RFC 9162 2.1.4)")
def consistency(sidecar: SidecarDep, _: AuditRead, first: Annotated[int, Query(ge=1, le=2**53)],
                second: Annotated[int | None, Query(ge=1, le=2**53)] = None) -> Proof:
    size = _size(sidecar, second)
    if first > size:
        raise Problem(422, "Unprocessable Content", f"first {first} is larger than second {size}")
    return Proof(tree_size=size,
                 hashes=[base64.b64encode(h).decode() for h in sidecar.log.consistency_proof(first, size)])


@router.get("/public-keys", summary="The log's public keys, with the record each is valid from")
def public_keys(sidecar: SidecarDep, _: AuditRead) -> list[dict]:
    return [{"key_id": k.key.key_id, "public_key_pem": k.key.to_pem(), "valid_from_seq": k.valid_from_seq}
            for k in sidecar.store.keys(sidecar.settings.origin)]
