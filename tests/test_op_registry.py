"""One registry of record ops (kvguard.audit.ops), read by every layer: the cache's events
name its ops, the sidecar's ingest records exactly its event ops, the admin API filters by
exactly its ops, and the log signs no other (tests/audit/test_log.py)."""

from __future__ import annotations

from fastapi import FastAPI
from kvguard.audit import fields, ops

from kvguard.cache.events import CacheEvent
from kvguard.policy import PolicyDecision
from kvguard.sidecar.api.audit import router as audit_router
from kvguard.sidecar.ingest import _unrecordable


def event_classes(cls: type = CacheEvent) -> set[type]:
    out = set()
    for sub in cls.__subclasses__():
        out |= {sub} | event_classes(sub)
    return out


def test_every_event_class_names_an_event_op_and_every_event_op_has_one():
    classes = event_classes()
    assert PolicyDecision in classes  # the policy's decision is an event like the cache's
    assert {c.op for c in classes} == ops.EVENT_OPS
    assert ops.EVENT_OPS <= ops.OPS and ops.ERASE_OPS <= ops.OPS


def test_the_validator_knows_exactly_the_registry():
    assert fields.KNOWN_OPS == ops.OPS
    for op in ops.OPS:
        assert fields.check_known_op(op) == op and fields.check_op(op) == op


def test_ingest_records_exactly_the_event_ops():
    for op in ops.OPS | {"bogus"}:
        assert (_unrecordable(op, [{"pages": []}]) is None) == (op in ops.EVENT_OPS), op


def test_the_api_filter_accepts_exactly_the_registry():
    app = FastAPI()
    app.include_router(audit_router)
    params = app.openapi()["paths"]["/v1/audit/records"]["get"]["parameters"]
    (op,) = [p for p in params if p["name"] == "op"]
    schema = op["schema"]
    enum = next(s["enum"] for s in schema.get("anyOf", [schema]) if "enum" in s)
    assert sorted(enum) == sorted(ops.OPS)
