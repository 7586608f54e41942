"""Erasure requests: POST stores one durably and answers 202; GET shows its state and,
once completed, the receipt that verifies offline."""

from __future__ import annotations

import json
import re
from typing import Annotated, Literal

from fastapi import APIRouter, Header, Path, Request, Response
from pydantic import BaseModel, ConfigDict, Field, model_validator

from ..erasure import NewRequest
from ..models import ErasureRequest
from .deps import ErasureRead, ErasureWrite, JsonBody, StrictJsonRoute
from .problems import Problem, documented

router = APIRouter(prefix="/v1/erasure-requests", tags=["erasure"], responses=documented(401, 403, 503),
                   route_class=StrictJsonRoute)

Id = Annotated[str, Field(min_length=1, max_length=256, pattern=r"^[^\x00-\x1f]+$")]


class ErasureIn(BaseModel):
    model_config = ConfigDict(extra="forbid")

    tenant: Id
    user: Id | None = None
    session: Id | None = None
    legal_basis: Literal["gdpr-art17", "pipl-art47"]
    reason: Annotated[str, Field(max_length=2000)] | None = None

    @model_validator(mode="after")
    def _one_target(self):
        if (self.user is None) == (self.session is None):
            raise ValueError("give exactly one of user or session")
        return self


class ErasureOut(BaseModel):
    id: str
    state: Literal["received", "executing", "completed", "failed"]
    scope: str
    legal_basis: str
    tenant_pseudonym: str
    subject_pseudonym: str
    received_ms: int
    deadline_ms: int
    completed_ms: int | None = None
    result: dict | None = None
    receipt: dict | None = None
    error: str | None = None


def _out(row: ErasureRequest, result: dict | None) -> ErasureOut:
    return ErasureOut(
        id=row.id, state=row.state, scope=row.scope, legal_basis=row.legal_basis,
        tenant_pseudonym=row.tenant_pseudonym, subject_pseudonym=row.subject_pseudonym,
        received_ms=row.received_ms, deadline_ms=row.deadline_ms, completed_ms=row.completed_ms,
        result=result,
        receipt=json.loads(row.receipt_json) if row.receipt_json else None, error=row.error)


@router.post("", status_code=202, response_model=ErasureOut, dependencies=[JsonBody],
             summary="Request the erasure of a user's or a session's data",
             description="Stored durably before the answer. The same Idempotency-Key with the same body "
                         "answers 200 with the earlier request; with another body, 422.",
             responses={200: {"description": "the request with this Idempotency-Key already exists"},
                        **documented(415)})
def create(body: ErasureIn, principal: ErasureWrite, request: Request, response: Response,
           idempotency_key: Annotated[str, Header(min_length=8, max_length=200)]) -> ErasureOut:
    service = request.app.state.erasure
    row, new = service.create(NewRequest(body.tenant, body.user, body.session, body.legal_basis, body.reason),
                              idempotency_key, principal.token_id)
    if not new:
        response.status_code = 200
    response.headers["Location"] = f"/v1/erasure-requests/{row.id}"
    return _out(row, service.result(row))


RequestId = Annotated[str, Path(max_length=36, description="the request's id, a UUID")]
UUID = re.compile(r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}")


@router.get("/{request_id}", response_model=ErasureOut, summary="An erasure request's state and receipt",
            responses=documented(404))
def read(request_id: RequestId, _: ErasureRead, request: Request) -> ErasureOut:
    # what is no request id names no request: never sent to the database (PostgreSQL refuses NUL)
    service = request.app.state.erasure
    row = service.get(request_id) if UUID.fullmatch(request_id) else None
    if row is None:
        raise Problem(404, "Not Found", "no erasure request with this id")
    out = _out(row, service.result(row))
    if out.receipt is not None:  # the witnesses' cosignatures arrive after the receipt is made
        out.receipt = _cosigned_fleet(request.app.state.sidecar, out.receipt)
    return out


def _cosigned_fleet(sidecar, receipt: dict) -> dict:
    """A fleet receipt with each origin's checkpoint carrying the cosignatures stored since."""
    if isinstance(receipt.get("receipts"), list):
        return {**receipt, "receipts": [_cosigned(sidecar, r) for r in receipt["receipts"]]}
    return _cosigned(sidecar, receipt)


def _cosigned(sidecar, receipt: dict) -> dict:
    from kvguard.audit.cosignature import with_cosignatures
    from kvguard.audit.cosigstore import cosignature_lines

    size = receipt["tree_size"]
    lines = cosignature_lines(sidecar.store, receipt["origin"], size, size).get(size, [])
    return {**receipt, "checkpoint": with_cosignatures(receipt["checkpoint"], lines)} if lines else receipt
