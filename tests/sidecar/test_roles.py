"""Database roles on PostgreSQL: migrations by the owner (`kvguard db upgrade`), the sidecar as a
runtime role granted as docs/operations-roles.md says, and what that role cannot do."""

from __future__ import annotations

import re
import time
import uuid

import psycopg
import pytest
import sqlalchemy as sa
from kvguard.audit.store import make_engine
from sqlalchemy.orm import Session

from kvguard.cli import main
from kvguard.sidecar import roles
from kvguard.sidecar.auth import create_token
from tests.sidecar.conftest import PG_ADMIN, ROOT, drop_pg_database, runtime_url, start_server


@pytest.fixture
def owned_database():
    """A database owned by a non-superuser role `<db>_owner`, as docs/operations-roles.md sets up."""
    name = f"kvguard_roles_{uuid.uuid4().hex[:10]}"
    owner = f"{name}_owner"
    admin = sa.create_engine(PG_ADMIN, isolation_level="AUTOCOMMIT")
    with admin.connect() as c:
        c.execute(sa.text(f"CREATE ROLE {owner} LOGIN"))
        c.execute(sa.text(f"CREATE DATABASE {name} OWNER {owner}"))
    try:
        yield name, f"postgresql+psycopg://{owner}@127.0.0.1:5432/{name}"
    finally:
        drop_pg_database(name)
        with admin.connect() as c:
            c.execute(sa.text(f"DROP ROLE IF EXISTS {owner}"))
        admin.dispose()


def test_the_documented_grants_are_what_db_grant_runs():
    doc = (ROOT / "docs" / "operations-roles.md").read_text()
    block = re.search(r"<!-- grants: kvguard_rt -->\n```sql\n(.*?)```", doc, re.S).group(1)
    assert block == roles.grant_sql("kvguard_rt")
    with pytest.raises(ValueError, match="not a plain role name"):
        roles.grant_sql("x; DROP TABLE records")


def test_runtime_role_serves_but_cannot_touch_the_triggers(tmp_path, owned_database, monkeypatch, capsys):
    name, owner_url = owned_database
    # in process: each `python -m kvguard` costs seconds of imports on a busy machine
    monkeypatch.setenv("KVGUARD_DATABASE_URL", owner_url)
    monkeypatch.setenv("KVGUARD_DATA_DIR", str(tmp_path / "ops"))
    monkeypatch.setenv("KVGUARD_PORT", "0")
    # (1) the owner migrates: a line per migration, and nothing to do the second time
    assert main(["db", "upgrade"]) == 0
    out = capsys.readouterr().out
    assert f"as role {name}_owner, which will own the tables" in out
    assert re.search(r"\[1/\d+\] 0001 .* done", out) and "0122" in out
    assert main(["db", "upgrade"]) == 0 and "nothing to do" in capsys.readouterr().out
    engine = make_engine(owner_url)  # a migration that adds a table says what the runtime role may do
    with engine.connect() as conn:
        assert roles.tables_without_grant(conn) == []
    engine.dispose()

    # (2) production refuses to serve as the owner, and as a superuser, naming role and fix
    for url, why in ((owner_url, f"role {name}_owner: it owns"),
                     (owner_url.replace(f"{name}_owner@", "postgres@"), "role postgres: it is a superuser")):
        monkeypatch.setenv("KVGUARD_DATABASE_URL", url)
        assert main(["serve"]) == 1
        err = capsys.readouterr().err
        assert why in err and "kvguard db grant ROLE" in err, err[-2000:]

    # (3) a runtime role granted as documented runs the sidecar: tokens, an erasure (shreds a
    # secret, updates the request), a KEK rotation (re-wraps), a signing-key rotation
    runtime = f"{name}_rt"
    runtime_db = runtime_url(owner_url)
    engine = make_engine(runtime_db)
    with Session(engine) as db:
        tokens = {scope: create_token(db, scope, [scope]) for scope in ("admin", "erasure:write")}
    engine.dispose()
    server = start_server(tmp_path, owner_url, tokens=tokens, extra_env={"KVGUARD_INFERENCE_LIVE_S": "0.2"})
    try:
        assert f"{runtime}@" in server.env["KVGUARD_DATABASE_URL"]
        with server.client("erasure:write") as c:
            r = c.post("/v1/erasure-requests", headers={"Idempotency-Key": "roles-0001"},
                       json={"tenant": "acme", "user": "u-1", "legal_basis": "gdpr-art17"})
            assert r.status_code == 202, r.text
        with server.client("admin") as c:
            assert c.post("/v1/keys/kek/rotate").status_code == 200
            # the operator's command, against the running sidecar
            token_file = tmp_path / "admin.token"
            token_file.write_text(tokens["admin"])
            token_file.chmod(0o600)
            capsys.readouterr()
            assert main(["keys", "rotate", "--url", server.url, "--token-file", str(token_file)]) == 0
            out = capsys.readouterr().out
            keys = c.get("/v1/audit/public-keys").json()
            assert len(keys) == 2 and f"key {keys[1]['key_id'][:16]}... signs from" in out
            for _ in range(300):
                state = c.get(f"/v1/erasure-requests/{r.json()['id']}").json()["state"]
                if state == "completed":
                    break
                time.sleep(0.05)
            assert state == "completed"
            assert c.get("/readyz").status_code == 200
    finally:
        server.stop()

    # (4) the runtime role, as an attacker holding its credentials would use it
    with psycopg.connect(f"host=127.0.0.1 port=5432 dbname={name} user={runtime}", autocommit=True) as conn:
        attacks = [
            "ALTER TABLE records DISABLE TRIGGER records_append_only",
            "ALTER TABLE records DISABLE TRIGGER ALL",
            "DROP TRIGGER records_append_only ON records",
            "DROP TRIGGER keys_append_only ON keys",
            "SET session_replication_role = replica",
            "UPDATE records SET op = 'free' WHERE seq = 0",
            "DELETE FROM records WHERE seq = 0",
            "TRUNCATE records",
            "DELETE FROM checkpoints",
            "UPDATE keys SET valid_from_seq = 0",
            "UPDATE logs SET origin = 'x'",
        ]
        for sql in attacks:
            with pytest.raises(psycopg.errors.InsufficientPrivilege):
                conn.execute(sql)
        # the column UPDATE that SELECT ... FOR UPDATE needs: the trigger still refuses it
        with pytest.raises(psycopg.errors.RestrictViolation, match="append-only"):
            conn.execute("UPDATE logs SET created_ms = 0")
        n = conn.execute("SELECT count(*) FROM records").fetchone()[0]
        ops = [row[0] for row in conn.execute("SELECT op FROM records ORDER BY seq")]
    assert n >= 2 and "erase" in ops and "key_rotation" in ops
