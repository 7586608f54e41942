"""Migrations, append-only enforcement, SQLite durability settings, several logs and writers."""

from __future__ import annotations

import threading
import uuid

import pytest
from alembic.script import ScriptDirectory
from kvguard.audit.errors import StoreError
from kvguard.audit.keys import SigningKey
from kvguard.audit.models import SubjectKey
from kvguard.audit.store import AuditStore, alembic_config, check_current, downgrade, make_engine, migrate
from kvguard.audit.verify import verify_store
from sqlalchemy import insert, inspect, text
from sqlalchemy.exc import DatabaseError, IntegrityError

from .audit_testlib import BACKENDS, fill, open_log

TABLES = {"logs", "keys", "records", "checkpoints", "subject_keys"}


@pytest.fixture(params=BACKENDS)
def empty_url(request, tmp_path):
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path / 'empty.db'}"
    return request.getfixturevalue("fresh_pg_url")


def _tables(url: str) -> set[str]:
    engine = make_engine(url)
    try:
        return set(inspect(engine).get_table_names()) - {"alembic_version"}
    finally:
        engine.dispose()


def test_upgrade_downgrade_and_readiness(empty_url):
    head = ScriptDirectory.from_config(alembic_config()).get_current_head()
    with pytest.raises(StoreError, match=f"at schema None, expected '{head}'"):
        check_current(empty_url)
    migrate(empty_url)
    check_current(empty_url)
    assert TABLES <= _tables(empty_url)
    downgrade(empty_url, "0001")  # triggers gone, tables kept
    with pytest.raises(StoreError):
        check_current(empty_url)
    store = AuditStore(empty_url)
    key = SigningKey.generate()
    store.create_log("o.example/x", key.public_key, 0)
    with store.write() as conn:
        conn.execute(text("UPDATE logs SET created_ms = 1"))
    store.dispose()
    downgrade(empty_url, "base")
    assert _tables(empty_url) == set()
    migrate(empty_url)
    check_current(empty_url)


def test_sqlite_is_wal_with_full_sync(sqlite_url):
    engine = make_engine(sqlite_url)
    with engine.connect() as conn:
        assert conn.exec_driver_sql("PRAGMA journal_mode").scalar() == "wal"
        assert conn.exec_driver_sql("PRAGMA synchronous").scalar() == 2  # FULL
        assert conn.exec_driver_sql("PRAGMA recursive_triggers").scalar() == 1
    engine.dispose()


@pytest.mark.parametrize("statement", [
    "UPDATE records SET op = 'quantize'",
    "DELETE FROM records",
    "UPDATE checkpoints SET note = ''",
    "DELETE FROM checkpoints",
    "DELETE FROM keys",
    "UPDATE logs SET created_ms = 0",
])
def test_database_refuses_update_and_delete(store, audit_log, origin, statement):
    fill(audit_log, 3)
    audit_log.checkpoint()
    with pytest.raises(DatabaseError, match="append-only"):
        with store.write() as conn:
            conn.execute(text(statement))
    assert store.size(origin) == 3


@pytest.mark.parametrize("statement", [
    "INSERT INTO records SELECT * FROM records WHERE true"
    " ON CONFLICT (origin, seq) DO UPDATE SET body = excluded.body",
    "INSERT INTO logs (origin, created_ms) SELECT origin, 0 FROM logs WHERE true"
    " ON CONFLICT (origin) DO UPDATE SET created_ms = excluded.created_ms",
])
def test_database_refuses_an_upsert_over_a_row(store, audit_log, origin, signing_key, statement):
    fill(audit_log, 3)
    audit_log.checkpoint()
    with pytest.raises(DatabaseError, match="append-only"):
        with store.write() as conn:
            conn.execute(text(statement))
    assert verify_store(store, origin, [signing_key.public_key]).size == 3


@pytest.mark.parametrize("statement", [
    "INSERT OR REPLACE INTO records SELECT * FROM records",
    "INSERT OR REPLACE INTO checkpoints SELECT * FROM checkpoints",
    "INSERT OR REPLACE INTO keys SELECT * FROM keys",
    "REPLACE INTO logs (origin, created_ms) SELECT origin, 0 FROM logs",
])
def test_sqlite_refuses_insert_or_replace(sqlite_url, origin, signing_key, statement):
    # REPLACE deletes the old row, which fires DELETE triggers only with recursive_triggers on
    store = AuditStore(sqlite_url)
    with open_log(store, origin, signing_key) as log:
        fill(log, 3)
        log.checkpoint()
    with pytest.raises(DatabaseError, match="append-only"):
        with store.write() as conn:
            conn.execute(text(statement))
    assert verify_store(store, origin, [signing_key.public_key]).size == 3
    store.dispose()


def test_database_errors_do_not_carry_bound_parameters(db_url):
    # an exception logged by the sidecar must not show a subject's pseudonym secret
    secret = b"S" * 32
    engine = make_engine(db_url)
    row = {"idx": uuid.uuid4().bytes * 2, "kind": "user", "secret": secret, "created_ms": 0}
    with pytest.raises(IntegrityError) as err:
        with engine.begin() as conn:
            for _ in range(2):
                conn.execute(insert(SubjectKey).values(**row))
    engine.dispose()
    assert secret.decode() not in str(err.value) and secret.hex() not in str(err.value)
    assert "parameters hidden" in str(err.value)


@pytest.mark.postgres
def test_postgres_refuses_truncate(pg_url):
    store = AuditStore(pg_url)
    with pytest.raises(DatabaseError, match="append-only"):
        with store.write() as conn:
            conn.execute(text("TRUNCATE records CASCADE"))
    store.dispose()


def test_logs_of_different_origins_do_not_interfere(store, signing_key, origin):
    logs = [open_log(store, f"{origin}-{i}", signing_key) for i in range(3)]
    threads = [threading.Thread(target=fill, args=(log, 40)) for log in logs]
    [t.start() for t in threads]
    [t.join() for t in threads]
    for log in logs:
        log.checkpoint()
        log.close()
        assert verify_store(store, log.origin, [signing_key.public_key]).size == 40


@pytest.mark.parametrize("sign_process", [False, True], ids=["sign-in-thread", "sign-in-process"])
def test_concurrent_writers_of_one_log_never_fork(db_url, signing_key, origin, sign_process):
    # Two writers, each with its own engine and in-memory tail, appending to one log at once;
    # with a signer process, slices signed ahead on a stale tail are re-signed at commit.
    stores = [AuditStore(db_url) for _ in range(2)]
    open_log(stores[0], origin, signing_key).close()
    logs = [open_log(s, origin, signing_key, sign_process=sign_process, sign_slice=2) for s in stores]
    done: list[list] = [[], []]

    def write(i):
        for n in range(15):
            done[i] += logs[i].append_many([("evict", {}, {"writer": i, "n": n})] * 4)

    threads = [threading.Thread(target=write, args=(i,)) for i in range(2)]
    [t.start() for t in threads]
    [t.join() for t in threads]
    seqs = sorted(r.seq for r in done[0] + done[1])
    assert seqs == list(range(120))
    logs[1].append("evict")  # catches up with whatever the other wrote last
    for log in logs:
        log.close()
    summary = verify_store(stores[0], origin, [signing_key.public_key])
    assert summary.size == 121
    assert summary.root == logs[1].root()
    for s in stores:
        s.dispose()


def test_a_stale_writer_reloads_the_tail_and_re_signs(db_url, signing_key, origin):
    stores = [AuditStore(db_url) for _ in range(2)]
    first = open_log(stores[0], origin, signing_key)
    second = open_log(stores[1], origin, signing_key)  # both believe the log is empty
    fill(first, 5)
    record = second.append("evict", {}, {"after": "conflict"})
    assert record.seq == 5 and second.size == 6
    assert record.prev == stores[0].record(origin, 4).digest
    first.close()
    second.close()
    verify_store(stores[0], origin, [signing_key.public_key])
    for s in stores:
        s.dispose()


def test_primary_key_is_the_last_defence(store, origin, signing_key, monkeypatch):
    from kvguard.audit.errors import ChainConflictError

    with open_log(store, origin, signing_key) as log:
        records = fill(log, 3)
    monkeypatch.setattr(store, "size", lambda origin, conn=None: 2)  # a writer that missed the lock
    with pytest.raises(ChainConflictError, match="concurrent append at seq 2"):
        store.append(origin, [records[2]], 2)
    monkeypatch.undo()
    assert store.size(origin) == 3
    verify_store(store, origin, [signing_key.public_key])
