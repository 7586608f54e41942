"""Prometheus metrics of the sidecar, on a registry of its own.

Every label takes its values from a fixed set (an op, a state, a tier, a codec, a reason, an
HTTP status): no subject, pseudonym, process or token ever becomes a label, so the metrics can
be served without a token (the metrics listener, server.py).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from sqlalchemy import func, select
from sqlalchemy.orm import Session

from .models import ErasurePart, ErasureRequest, FleetSidecar
from .registry import Registry


class Metrics:
    def __init__(self, db: Callable[[], Session], registry: Registry, origin: str,
                 fleet_deadline_s: float = 30.0) -> None:
        self._db, self._clients, self._origin = db, registry, origin
        self._lock = threading.Lock()  # renders set shared gauges: one at a time
        self._scraped: tuple[float, bytes] = (float("-inf"), b"")
        self._deadline_ms = int(fleet_deadline_s * 1000)
        r = self.registry = CollectorRegistry()
        self.records = Counter("kvguard_audit_records_written", "Audit records signed and stored", ["op"],
                               registry=r)
        self.sign_latency = Histogram("kvguard_audit_write_seconds",
                                      "Time from an event batch's arrival to its records being durable",
                                      registry=r, buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1))
        self.events_refused = Counter("kvguard_ingest_events_refused",
                                      "Events recorded as ingest_error because they could not be recorded as "
                                      "sent", ["reason"], registry=r)
        self.batches_refused = Counter("kvguard_ingest_batches_refused",
                                       "Event batches answered with an error status (nothing of them recorded)",
                                       ["status"], registry=r)
        self.erasures_received = Counter("kvguard_erasure_requests_received", "Erasure requests stored",
                                         registry=r)
        self.erasures_completed = Counter("kvguard_erasure_requests_completed", "Erasure requests completed",
                                          registry=r)
        self.by_state = Gauge("kvguard_erasure_requests", "Erasure requests by state", ["state"], registry=r)
        self.overdue = Gauge("kvguard_erasure_requests_overdue", "Open erasure requests past their deadline",
                             registry=r)
        self.sidecars = Gauge("kvguard_fleet_sidecars", "Sidecars of the database that have not left, by "
                              "whether they heartbeat within their deadline (the same on every sidecar)",
                              ["state"], registry=r)
        self.parts_overdue = Gauge("kvguard_erasure_origins_overdue",
                                   "Open erasure requests' parts waiting for a sidecar that is down past its "
                                   "deadline (fleet-wide: the same on every sidecar, aggregate with max)",
                                   registry=r)
        self.pages = Gauge("kvguard_cache_pages", "KV pages held by connected processes", ["tier", "codec"],
                           registry=r)
        self.witness_cosigned = Gauge("kvguard_witness_cosigned_size",
                                      "Tree size of the latest checkpoint each witness cosigned", ["witness"],
                                      registry=r)
        self.witness_lag = Gauge("kvguard_witness_lag_records",
                                 "Records signed into checkpoints that a witness has not cosigned yet", ["witness"],
                                 registry=r)
        self.witness_ok = Gauge("kvguard_witness_ok", "1 if the last submission to a witness was cosigned",
                                ["witness"], registry=r)
        self.witness_failures = Counter("kvguard_witness_failures",
                                        "Checkpoint submissions a witness did not cosign, by reason (unreachable, "
                                        "inconsistent, rollback, bad_cosignature, http_<status>)",
                                        ["witness", "reason"], registry=r)
        self.processes = Gauge("kvguard_inference_processes_live", "Inference processes seen recently",
                               registry=r)
        self.audit_log = None  # the sidecar's AuditLog, once opened
        self.writer_halted = Gauge("kvguard_audit_writer_halted", "1 while the audit writer is stopped by a "
                                   "stored record that fails verification, labelled with that record",
                                   ["origin", "seq", "check"], registry=r)
        self.check_runs = Counter("kvguard_audit_check_runs", "Runs of the store check (POST /v1/audit/check) by "
                                  "result", ["result"], registry=r)
        self.check_last = Gauge("kvguard_audit_check_last_run_timestamp_seconds",
                                "When the last store check finished", registry=r)
        self.check_failure = Gauge("kvguard_audit_check_failed", "1 if the last store check found a failure, "
                                   "labelled with the first record it names; absent after a passing check",
                                   ["origin", "seq", "check"], registry=r)
        # a KEK older than its rotation period means rotation is stuck: shredded secrets stay
        # readable in WAL and backups past the bound docs/audit-format.md §6 states
        self.kek_age = Gauge("kvguard_kek_age_seconds", "Age of the key-encryption key that wraps new secrets",
                             registry=r)
        self.kek_rotations = Counter("kvguard_kek_rotations", "Key-encryption key rotations this sidecar did",
                                     registry=r)
        self.kek_created_ms: Callable[[], int | None] = lambda: None

    def scrape(self, max_age_s: float = 1.0) -> bytes:
        """The metrics for an unauthenticated scraper: rendered at most once per `max_age_s`,
        so that requests to an open port cannot turn into a stream of database queries."""
        with self._lock:
            at, body = self._scraped
            if time.monotonic() - at < max_age_s:
                return body
        body = self.render()
        with self._lock:
            self._scraped = (time.monotonic(), body)
        return body

    def render(self) -> bytes:
        with self._lock:
            return self._render()

    def _render(self) -> bytes:
        origin = self._origin
        with self._db() as db:
            counts = dict(db.execute(select(ErasureRequest.state, func.count()).where(
                ErasureRequest.origin == origin).group_by(ErasureRequest.state)).all())
            overdue = db.scalar(select(func.count()).select_from(ErasureRequest).where(
                ErasureRequest.origin == origin, ErasureRequest.state.in_(("received", "executing")),
                ErasureRequest.deadline_ms < int(time.time() * 1000)))
            now = int(time.time() * 1000)
            beats = db.scalars(select(FleetSidecar.heartbeat_ms).where(FleetSidecar.left_ms.is_(None))).all()
            waiting = db.scalar(select(func.count()).select_from(ErasurePart).join(
                FleetSidecar, FleetSidecar.origin == ErasurePart.origin).join(
                ErasureRequest, ErasureRequest.id == ErasurePart.request_id).where(
                ErasurePart.state.in_(("pending", "erased")), ErasureRequest.state.in_(("received", "executing")),
                FleetSidecar.heartbeat_ms < now - self._deadline_ms))
        down = sum(1 for b in beats if now - b > self._deadline_ms)
        self.sidecars.labels("live").set(len(beats) - down)
        self.sidecars.labels("down").set(down)
        self.parts_overdue.set(waiting or 0)
        for state in ("received", "executing", "completed", "failed"):
            self.by_state.labels(state).set(counts.get(state, 0))
        self.overdue.set(overdue or 0)
        created = self.kek_created_ms()
        self.kek_age.set(0 if created is None else max(0.0, time.time() - created / 1000))
        self.pages.clear()
        live = self._clients.live()
        self.processes.set(len(live))
        totals: dict[tuple[str, str], int] = {}
        for c in live:
            for (tier, codec), n in _pages(c.stats).items():
                totals[(tier, codec)] = totals.get((tier, codec), 0) + n
        for (tier, codec), n in totals.items():
            self.pages.labels(tier, codec).set(n)
        self.writer_halted.clear()
        halted = None if self.audit_log is None else self.audit_log.halted
        if halted is not None:
            f = halted.failure
            self.writer_halted.labels(f.origin, str(f.seq), f.check).set(1)
        return generate_latest(self.registry)

    def checked(self, failure) -> None:
        """Note a store check's result: None, or the VerificationError it raised."""
        self.check_last.set(time.time())
        self.check_failure.clear()
        if failure is None:
            self.check_runs.labels("consistent").inc()
        else:
            self.check_runs.labels("inconsistent").inc()
            self.check_failure.labels(failure.origin or "", str(failure.seq), failure.check).set(1)


TIERS = ("device", "cpu", "disk", "redis")
CODECS = ("fp16", "bf16", "int8", "int4", "fp8", "unknown")


def _pages(stats: dict) -> dict[tuple[str, str], int]:
    """Pages per (tier, codec) of one process's stats, as validated on ingest (api/ingest.py);
    anything else is left out, so the label sets stay those above whatever a process sent."""
    out: dict[tuple[str, str], int] = {}
    codec = stats.get("codec") or "unknown"
    codec = codec if codec in CODECS else "unknown"

    def add(tier, pool_codec, n) -> None:
        if tier in TIERS and type(n) is int and n >= 0:
            out[(tier, pool_codec)] = out.get((tier, pool_codec), 0) + n

    for pool, n in (stats.get("pages_used") or {}).items():
        add("device", "fp16" if pool == "hot" else codec, n)
    for tier, n in (stats.get("pages_offloaded") or {}).items():
        add(tier, codec, n)
    return out
