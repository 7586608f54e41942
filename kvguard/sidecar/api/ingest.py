"""The internal API of inference processes (served on the Unix socket only):
event batches in, erase commands out, acknowledgements back. Needs the `ingest` scope;
a client id belongs to the token that registered it (registry.py), others get 403. A
token bound to tenants sends events of those tenants only (403 for a batch naming
another) and gets their erase commands only."""

from __future__ import annotations

import asyncio
import time
from typing import Annotated, Any

from fastapi import APIRouter, Path, Query
from pydantic import BaseModel, ConfigDict, Field

from kvguard.audit.canonical import MAX_SAFE_INTEGER

from ..logs import log
from .deps import Ingest, JsonBody, SidecarDep
from .problems import Problem, documented

router = APIRouter(prefix="/internal/v1", tags=["ingest"], responses=documented(401, 403, 503))

ClientId = Annotated[str, Field(pattern=r"^[A-Za-z0-9._-]{1,64}$")]
# Drawn by the process at each start: its event numbers and commands are its own (registry.py).
Instance = Annotated[str, Field(pattern=r"^[0-9a-f]{16,32}$")]
Name = Annotated[str, Field(min_length=1, max_length=256, pattern=r"^[^\x00]+$")]  # NUL: the pseudonyms' separator


class WireSubject(BaseModel):
    model_config = ConfigDict(extra="forbid")
    tenant: Name
    user: Name
    session: Name


class WireEvent(BaseModel):
    model_config = ConfigDict(extra="forbid")
    # the process's event number, to drop resent duplicates; an ingest_error record names it
    n: Annotated[int, Field(ge=0, le=MAX_SAFE_INTEGER)]
    op: Annotated[str, Field(pattern=r"^[a-z_]{1,32}$")]
    subject: WireSubject
    details: dict[str, Any] = Field(default_factory=dict)


class OpenSession(BaseModel):
    model_config = ConfigDict(extra="forbid")
    subject: WireSubject
    opened_ms: Annotated[int, Field(ge=0)]


class EventBatch(BaseModel):
    model_config = ConfigDict(extra="forbid")
    client: ClientId
    instance: Instance
    events: Annotated[list[WireEvent], Field(max_length=4096)] = Field(default_factory=list)
    stats: dict[str, Any] = Field(default_factory=dict)
    sessions: Annotated[list[OpenSession], Field(max_length=100_000)] | None = None


class BatchAck(BaseModel):
    recorded: int  # records written: one per event, more for an event split into parts
    up_to: int  # every event numbered up to this is durable
    seqs: list[int]
    refused: list[int] = Field(default_factory=list)  # events recorded as `ingest_error`, by number


@router.post("/events", response_model=BatchAck, summary="Record a batch of cache events",
             dependencies=[JsonBody], responses=documented(415))
async def events(batch: EventBatch, sidecar: SidecarDep, principal: Ingest) -> BatchAck:
    if principal.tenants is not None:
        named = {e.subject.tenant for e in batch.events} | {s.subject.tenant for s in batch.sessions or ()}
        others = [t for t in named if sidecar.tenant_index(t) not in principal.tenants]
        if others:  # nothing of the batch is recorded; the detail names no tenant
            raise Problem(403, "Forbidden", f"{len(others)} tenant(s) named in the batch are not among this "
                                            "ingest token's tenants; nothing was recorded")
    client = sidecar.registry.touch(batch.client, batch.instance, principal.token_id, principal.tenants)
    client.stats = batch.stats or client.stats
    if batch.sessions is not None:
        client.sessions = {(s.subject.tenant, s.subject.user, s.subject.session): s.opened_ms
                           for s in batch.sessions}
    fresh = [e for e in sorted(batch.events, key=lambda e: e.n) if e.n > client.last_event_no]
    if not fresh:
        return BatchAck(recorded=0, up_to=client.last_event_no, seqs=[])
    t0 = time.perf_counter()
    records, refused = await asyncio.to_thread(sidecar.ingest.record_batch, client.id,
                                               [e.model_dump() for e in fresh])
    sidecar.metrics.sign_latency.observe(time.perf_counter() - t0)
    for record in records:
        sidecar.metrics.records.labels(record.op).inc()
    for e in refused:  # recorded as ingest_error: the process has a bug to fix
        sidecar.metrics.events_refused.labels(e["reason"]).inc()
        log.error("event not recordable as sent", process=client.id, event_no=e["n"], op=e["op"],
                  reason=e["reason"])
    client.last_event_no = fresh[-1].n
    return BatchAck(recorded=len(records), up_to=client.last_event_no, seqs=[r.seq for r in records],
                    refused=[e["n"] for e in refused])


@router.get("/commands", summary="Wait for erase commands (long poll)")
async def commands(sidecar: SidecarDep, principal: Ingest,
                   client: Annotated[str, Query(pattern=r"^[A-Za-z0-9._-]{1,64}$")],
                   instance: Annotated[str, Query(pattern=r"^[0-9a-f]{16,32}$")],
                   wait: Annotated[float, Query(ge=0, le=30)] = 10.0) -> list[dict]:
    return await sidecar.registry.take_commands(client, instance, principal.token_id, wait, principal.tenants)


class AckIn(BaseModel):
    model_config = ConfigDict(extra="forbid")
    client: ClientId
    instance: Instance
    result: dict[str, Any]


@router.post("/commands/{command_id}/ack", summary="Acknowledge an executed command",
             dependencies=[JsonBody], responses=documented(415))
def ack(command_id: Annotated[str, Path(pattern=r"^[0-9a-f]{32}$")], body: AckIn, sidecar: SidecarDep,
        principal: Ingest) -> dict:
    return {"accepted": sidecar.registry.ack(body.client, body.instance, principal.token_id, command_id,
                                             body.result)}


class GoodbyeIn(BaseModel):
    model_config = ConfigDict(extra="forbid")
    client: ClientId
    instance: Instance


@router.post("/goodbye", summary="A process closing cleanly: no longer live, erasures do not wait for it",
             dependencies=[JsonBody], responses=documented(415))
def goodbye(body: GoodbyeIn, sidecar: SidecarDep, principal: Ingest) -> dict:
    return {"left": sidecar.registry.leave(body.client, body.instance, principal.token_id)}
