"""A running sidecar re-checks the store it relies on every audit_state_check_s: a key row an
attacker adds while it runs halts its writer, and /readyz says so, naming the check. Without a
witness, /readyz says what goes uncaught (a rollback together with its checkpoints)."""

from __future__ import annotations

import json
import time
import uuid

from kvguard.audit.store import AuditStore

from ..audit.test_attacks import ATTACKER, tamper
from .conftest import start_server
from .test_reliability import batch, event


def test_a_key_row_added_while_the_sidecar_runs_halts_it_at_the_next_state_check(tmp_path, db_url):
    server = start_server(tmp_path, db_url, extra_env={"KVGUARD_AUDIT_STATE_CHECK_S": "0.5"})
    try:
        with server.client(None) as http:
            ready = http.get("/readyz").json()
            assert ready["status"] == "ready"
            assert "no witness is configured" in ready["witness_warning"]

            with server.client("ingest") as sock:  # a first record: the writer checks keys once it has one
                r = sock.post("/internal/v1/events", json=batch(uuid.uuid4().hex[:16], [event(0)]))
                assert r.status_code == 200, r.text
            origin, pub = server.env["KVGUARD_ORIGIN"], ATTACKER.public_key
            store = AuditStore(server.db_url)  # the owner's URL: as superuser, triggers bypassed
            try:
                tamper(store, "INSERT INTO keys (origin, key_id, public_key, valid_from_seq, rotation_seq, "
                       "created_ms) VALUES (:o, :k, :p, 1001, 1000, 0)", o=origin, k=pub.key_id, p=pub.raw)
            finally:
                store.dispose()

            deadline = time.monotonic() + 20
            while (r := http.get("/readyz")).status_code == 200 and time.monotonic() < deadline:
                time.sleep(0.2)
            assert r.status_code == 503, r.text
            assert r.json()["checks"]["audit_writer"] == f"halted: record {origin}#1000 fails keys"
            assert "no witness is configured" in r.json()["witness_warning"]
    finally:
        server.stop()
    lines = [json.loads(line) for line in (tmp_path / "serve.log").read_text().splitlines() if line.startswith("{")]
    assert any("keys" in json.dumps(line) and line.get("level") in ("error", "critical") for line in lines), \
        [line.get("event") for line in lines]
