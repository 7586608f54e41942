"""The internal API of inference processes (served on the Unix socket only):
event batches in, erase commands out, acknowledgements back. Needs the `ingest` scope;
a client id belongs to the token that registered it (registry.py), others get 403. A
token bound to tenants sends events of those tenants only (403 for a batch naming
another) and gets their erase commands only."""

from __future__ import annotations

import asyncio
import time
from typing import Annotated, Any, Literal

from fastapi import APIRouter, Path, Query
from pydantic import BaseModel, ConfigDict, Field
from sqlalchemy.exc import SQLAlchemyError

from kvguard.audit.canonical import MAX_SAFE_INTEGER

from ..auth import authenticate, token_tenant
from ..logs import log
from .deps import Ingest, JsonBody, SidecarDep, StrictJsonRoute
from .problems import Problem, documented

router = APIRouter(prefix="/internal/v1", tags=["ingest"], responses=documented(401, 403, 503),
                   route_class=StrictJsonRoute)

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


Count = Annotated[int, Field(ge=0, le=MAX_SAFE_INTEGER)]


class CacheStats(BaseModel):
    """What a process reports of its cache: known pool, tier and codec names only, so the
    metrics' label sets stay small and fixed (metrics.py)."""

    model_config = ConfigDict(extra="forbid")
    codec: Literal["fp16", "bf16", "int8", "int4", "fp8"] | None = None
    # "split": the K/V split's pool (keys on the device); "cpu-values": its pages' values in host memory
    pages_used: dict[Literal["hot", "main", "split"], Count] = Field(default_factory=dict)
    pages_offloaded: dict[Literal["cpu", "disk", "redis", "cpu-values"], Count] = Field(default_factory=dict)
    tokens_held: Count = 0


class EventBatch(BaseModel):
    model_config = ConfigDict(extra="forbid")
    client: ClientId
    instance: Instance
    events: Annotated[list[WireEvent], Field(max_length=4096)] = Field(default_factory=list)
    stats: CacheStats | None = None
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
    if batch.stats is not None:
        client.stats = batch.stats.model_dump()
    if batch.sessions is not None:
        client.sessions = {(s.subject.tenant, s.subject.user, s.subject.session): s.opened_ms
                           for s in batch.sessions}
    numbers = sorted(e.n for e in batch.events)
    if len(set(numbers)) != len(numbers):
        raise Problem(422, "Unprocessable Content", "an event number repeats within the batch; nothing was recorded")
    async with client.lock:  # a client's batches one at a time: numbers are checked against the store's
        if not client.numbered:  # first batch of this run, or the last one failed: ask the store
            client.last_event_no = await asyncio.to_thread(sidecar.ingest.recorded_up_to, client.id)
            client.numbered = True
        last = client.last_event_no
        fresh = [e for e in sorted(batch.events, key=lambda e: e.n) if e.n > last]
        if not fresh:
            return BatchAck(recorded=0, up_to=last, seqs=[])
        if fresh[0].n != last + 1 or fresh[-1].n != last + len(fresh):
            # a gap would acknowledge events never sent (up_to covers every number below it)
            raise Problem(422, "Unprocessable Content", f"event numbers must follow on without a gap: the next "
                                                        f"event is {last + 1}; nothing was recorded",
                          next_event=last + 1)
        t0 = time.perf_counter()
        try:
            records, refused = await asyncio.to_thread(sidecar.ingest.record_batch, client.id,
                                                       [e.model_dump() for e in fresh])
        except BaseException:
            client.numbered = False  # stored in part, or whole with the answer lost: the store knows
            raise
        client.last_event_no = fresh[-1].n
        try:
            await asyncio.to_thread(sidecar.ingest.save_progress, client.id, client.last_event_no,
                                    records[-1].seq + 1)
        except SQLAlchemyError:
            client.numbered = False  # stored all the same: the next batch reads the records back
    sidecar.metrics.sign_latency.observe(time.perf_counter() - t0)
    for record in records:
        sidecar.metrics.records.labels(record.op).inc()
    for e in refused:  # recorded as ingest_error: the process has a bug to fix
        sidecar.metrics.events_refused.labels(e["reason"]).inc()
        log.error("event not recordable as sent", process=client.id, event_no=e["n"], op=e["op"],
                  reason=e["reason"])
    return BatchAck(recorded=len(records), up_to=fresh[-1].n, seqs=[r.seq for r in records],
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
async def goodbye(body: GoodbyeIn, sidecar: SidecarDep, principal: Ingest) -> dict:
    # on the event loop, as the command polls it may wake
    return {"left": sidecar.registry.leave(body.client, body.instance, principal.token_id)}


class KeyIn(BaseModel):
    model_config = ConfigDict(extra="forbid")
    token: Annotated[str, Field(min_length=1, max_length=200)]


class KeyOut(BaseModel):
    id: str
    scopes: list[str]
    tenant: str | None = None  # an infer token's tenant (raw, as erase commands carry it)


@router.post("/keys/check", response_model=KeyOut, summary="Who an end user's API key is (the inference server's "
             "bearer keys)", dependencies=[JsonBody], responses=documented(404, 415))
def check_key(body: KeyIn, sidecar: SidecarDep, principal: Ingest) -> KeyOut:
    """The scopes of a token that an inference server was sent, and the tenant of an `infer`
    token. Unknown, revoked or expired: 404. A tenant outside this ingest token's tenants is
    answered as unknown, so a process learns nothing of keys it does not serve."""
    with sidecar.db() as db:
        found = authenticate(db, body.token)
    if found is None:
        raise Problem(404, "Not Found", "no usable token")
    tenant = token_tenant(body.token) if "infer" in found.scopes else None
    if principal.tenants is not None and (tenant is None or sidecar.tenant_index(tenant) not in principal.tenants):
        raise Problem(404, "Not Found", "no usable token")
    return KeyOut(id=found.token_id, scopes=sorted(found.scopes), tenant=tenant)


class SaltIn(BaseModel):
    model_config = ConfigDict(extra="forbid")
    subject: WireSubject
    scope: Literal["tenant", "user", "session"]


@router.post("/salt", summary="The prefix-cache salt of a request's subject at a sharing scope (vLLM's "
             "cache_salt)", dependencies=[JsonBody], responses=documented(415))
def salt(body: SaltIn, sidecar: SidecarDep, principal: Ingest) -> dict:
    """A keyed hash under the secret of the subject at `scope` (its tenant, user or session):
    requests of one scope share prefix blocks, others never do, and after an erasure shreds the
    secret no request can reach the blocks cached under the old salt."""
    s = body.subject
    if principal.tenants is not None and sidecar.tenant_index(s.tenant) not in principal.tenants:
        raise Problem(403, "Forbidden", "this ingest token serves other tenants")
    raw = {"tenant": s.tenant, "user": s.user, "session": s.session}[body.scope]
    tenant = None if body.scope == "tenant" else s.tenant
    return {"salt": sidecar.pseudonyms.cache_salt(body.scope, raw, tenant=tenant)}
