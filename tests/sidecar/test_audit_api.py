"""The sidecar's side of the log's integrity, in process over SQLite and PostgreSQL: proofs
in hex, the store check for periodic runs, and a writer halted by a forged record."""

from __future__ import annotations

import asyncio
import json
import uuid

import pytest
from fastapi.testclient import TestClient
from kvguard.audit.errors import TamperedLogError
from kvguard.audit.keys import SigningKey
from kvguard.audit.merkle import verify_inclusion
from kvguard.audit.record import Record
from sqlalchemy import text

from kvguard.sidecar.app import create_app
from kvguard.sidecar.auth import create_token
from kvguard.sidecar.erasure import ErasureService, NewRequest
from kvguard.sidecar.logs import configure
from kvguard.sidecar.models import ErasureRequest
from kvguard.sidecar.service import Sidecar
from kvguard.sidecar.settings import Settings


@pytest.fixture
def settings(tmp_path, db_url, kek_dirs) -> Settings:
    return Settings(environment="development", data_dir=tmp_path / "data", database_url=db_url,
                    kek_dir=kek_dirs(db_url),
                    origin=f"test.kvguard/{uuid.uuid4().hex[:8]}", audit_sign_process=False)


def forge_tail(sc: Sidecar) -> int:
    """Insert, as superuser around the triggers, a record at the tail that claims the log's key."""
    seq, prev = sc.log.size, sc.store.record(sc.settings.origin, sc.log.size - 1).digest
    r = Record(sc.settings.origin, seq, "2025-01-31T12:00:00.000Z", "evict", {}, {"pages": [1]}, prev, sc.key.key_id)
    r = r.with_signature(SigningKey.generate().sign(r.signing_bytes()))
    with sc.store.write() as conn:
        if sc.store.dialect == "postgresql":
            conn.execute(text("SET LOCAL session_replication_role = replica"))
        conn.execute(text("INSERT INTO records (origin, seq, time_ms, op, key_id, prev, leaf_hash, sig, body) "
                          "VALUES (:o, :s, :t, :op, :k, :p, :h, :sig, :b)"),
                     {"o": r.origin, "s": seq, "t": r.time_ms, "op": r.op, "k": r.key_id, "p": r.prev,
                      "h": r.leaf_hash, "sig": r.sig, "b": r.leaf_bytes.decode()})
    return seq


def test_proofs_are_hex_and_the_check_endpoint_reports_to_metrics(settings):
    sc = Sidecar(settings)
    try:
        with sc.db() as db:
            token = create_token(db, "ops", ["admin"])
            db.commit()
        for i in range(5):
            sc.log.append("evict", {}, {"pages": [i]})
        with TestClient(create_app(sc)) as c:
            c.headers["Authorization"] = f"Bearer {token}"
            cp = c.get("/v1/audit/checkpoint").json()
            proof = c.get("/v1/audit/proofs/inclusion", params={"seq": 3, "tree_size": cp["tree_size"]}).json()
            leaf = sc.store.record(settings.origin, 3).leaf_hash
            verify_inclusion(3, cp["tree_size"], leaf, [bytes.fromhex(h) for h in proof["hashes"]],
                             bytes.fromhex(cp["root_hash"]))
            assert all(len(h) == 64 for h in c.get("/v1/audit/proofs/consistency", params={"first": 2}).json()["hashes"])

            ok = c.post("/v1/audit/check").json()
            assert ok["consistent"] and ok["records"] == 5
            assert "kvguard_audit_check_failed{" not in c.get("/metrics").text
            with sc.store.write() as conn:
                if sc.store.dialect == "postgresql":
                    conn.execute(text("SET LOCAL session_replication_role = replica"))
                else:
                    conn.execute(text("DROP TRIGGER records_no_update"))
                conn.execute(text("UPDATE records SET op = 'fetch' WHERE origin = :o AND seq = 2"),
                             {"o": settings.origin})
            bad = c.post("/v1/audit/check").json()
            assert not bad["consistent"]
            assert (bad["failure"]["record"], bad["failure"]["check"]) == (f"{settings.origin}#2", "columns")
            metrics = c.get("/metrics").text
            assert f'kvguard_audit_check_failed{{check="columns",origin="{settings.origin}",seq="2"}} 1.0' in metrics
            assert c.post("/v1/audit/check", headers={"Authorization": "Bearer nope"}).status_code == 401
    finally:
        sc.close()


def test_a_forged_tail_record_halts_the_sidecar_and_a_restart_refuses(settings, capsys):
    configure("json")
    sc = Sidecar(settings)
    try:
        sc.log.append("evict", {}, {"pages": [0]})
        seq = forge_tail(sc)
        record = f"{settings.origin}#{seq}"
        # an idle writer: the readiness probe has it verify the tail
        assert sc.readiness()["audit_writer"] == f"halted: record {record} fails signature"
        with pytest.raises(TamperedLogError) as err:
            sc.log.append("evict", {}, {"pages": [1]})
        assert err.value.failure.record == record
        with sc.db() as db:
            ingest_token = create_token(db, "pod", ["ingest"])
            db.commit()
        app = create_app(sc)
        with TestClient(app) as c:
            assert c.get("/readyz").status_code == 503
        with TestClient(app.state.ingest_app) as c:  # an event batch: refused with the record, never a 500
            r = c.post("/internal/v1/events", headers={"Authorization": f"Bearer {ingest_token}"},
                       json={"client": "pod", "instance": "c" * 16, "events": [
                           {"n": 0, "op": "free", "subject": {"tenant": "t", "user": "u", "session": "s"}}]})
            assert r.status_code == 503 and r.json()["record"] == record, r.text
        assert (f'kvguard_audit_writer_halted{{check="signature",origin="{settings.origin}",seq="{seq}"}} 1.0'
                in sc.metrics.render().decode())
        sc.registry.started -= sc.registry.live_s  # past the start's reconnect window
        service = ErasureService(sc)
        row, _ = service.create(NewRequest("acme", "u-1", None, "gdpr-art17", None), uuid.uuid4().hex, "tester")
        asyncio.run(service.run_pending())  # waits for the repair: not attempted, so not failed after three
        with sc.db() as db:
            assert (db.get(ErasureRequest, row.id).state, db.get(ErasureRequest, row.id).attempts) == ("received", 0)
        lines = [json.loads(x) for x in capsys.readouterr().err.splitlines() if x.startswith("{")]
        halted = [x for x in lines if x["event"].startswith("audit writer halted")]
        assert [(x["origin"], x["seq"], x["level"]) for x in halted] == [(settings.origin, seq, "critical")]
    finally:
        sc.close()
    with pytest.raises(TamperedLogError) as err:
        Sidecar(settings)
    assert err.value.failure.record == record
