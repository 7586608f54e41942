"""The erasure service in process, over SQLite and PostgreSQL."""

from __future__ import annotations

import time
import uuid

import pytest
from sqlalchemy import select

from kvguard.sidecar.erasure import ErasureService
from kvguard.sidecar.models import ErasureRequest
from kvguard.sidecar.retention import sweep
from kvguard.sidecar.service import Sidecar
from kvguard.sidecar.settings import Settings


@pytest.fixture
def make_sidecar(tmp_path, db_url):
    made = []

    def make(**settings) -> Sidecar:
        s = Settings(environment="development", data_dir=tmp_path / "data", database_url=db_url,
                     origin=f"test.kvguard/{uuid.uuid4().hex[:8]}", audit_sign_process=False,
                     erasure_ack_timeout_s=5, **settings)
        made.append(Sidecar(s))
        return made[-1]

    yield make
    for sc in made:
        sc.close()


# --- (3) retention, every time a session expires ----------------------------------------------------

def test_retention_erases_a_reused_session_again_and_renews_a_failed_request(make_sidecar):
    sc = make_sidecar(retention_max_age_s=1)
    service = ErasureService(sc)
    proc = sc.registry.touch("proc-a")
    now = time.time_ns() // 1_000_000
    proc.sessions = {("bank", "u-1", "s-1"): now - 5_000}
    assert sweep(sc, service) == 1
    assert sweep(sc, service) == 0  # the same expiry: the same request
    with sc.db() as db:
        first = db.scalar(select(ErasureRequest).where(ErasureRequest.origin == sc.settings.origin))
        first.state = "completed"
        db.commit()
    proc.sessions = {("bank", "u-2", "s-1"): now - 2_000}  # the id opened again, expired again
    assert sweep(sc, service) == 1
    with sc.db() as db:
        rows = db.scalars(select(ErasureRequest).where(ErasureRequest.origin == sc.settings.origin,
                                                       ErasureRequest.id != first.id)).all()
        assert len(rows) == 1 and rows[0].subject_pseudonym == first.subject_pseudonym
        rows[0].state, rows[0].attempts = "failed", 3
        db.commit()
        second = rows[0].id
    assert sweep(sc, service) == 1  # still held: a failed request is replaced, not left
    with sc.db() as db:
        states = {r.id: r.state for r in db.scalars(select(ErasureRequest).where(
            ErasureRequest.origin == sc.settings.origin))}
    assert len(states) == 3 and states[second] == "failed" and states[first.id] == "completed"
