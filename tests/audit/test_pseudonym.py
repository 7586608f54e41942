"""Pseudonyms and crypto-shredding: after shred, the whole database plus every key cannot
link a record's pseudonym back to the person."""

from __future__ import annotations

import hashlib
import hmac
import os
import sqlite3
from pathlib import Path

import pytest
from kvguard.audit.errors import RecordFormatError, StoreError
from kvguard.audit.models import SubjectKey
from kvguard.audit.pseudonym import (
    Pseudonymizer,
    generate_index_key,
    load_index_key,
    pseudonym_of,
    subject_data,
)
from kvguard.audit.store import AuditStore, make_engine
from sqlalchemy import event, select

INDEX_KEY = bytes(range(32))


@pytest.fixture
def pz(store) -> Pseudonymizer:
    return Pseudonymizer(store, INDEX_KEY)


def test_stable_scoped_and_distinct(pz):
    alice = pz.pseudonym("user", "alice", tenant="acme")
    assert alice == pz.pseudonym("user", "alice", tenant="acme")
    assert len(alice) == 32 and int(alice, 16) >= 0
    assert alice != pz.pseudonym("user", "alice", tenant="globex")  # scoped by tenant
    assert alice != pz.pseudonym("session", "alice", tenant="acme")  # kind is part of the input
    subject = pz.subject(tenant="acme", user="alice", session="s-1")
    assert subject["user"] == alice and set(subject) == {"tenant", "user", "session"}
    with pytest.raises(RecordFormatError, match="tenant"):
        pz.pseudonym("user", "alice")
    with pytest.raises(RecordFormatError):
        pz.pseudonym("user", "a\x00b", tenant="acme")
    # "acme" + "x\0y" and "acme\0x" + "y" must not collide: NUL is refused inside ids
    assert subject_data("user", "b", tenant="a") == b"user\x00a\x00b"


def test_shred_unlinks_for_someone_holding_everything(pz, store, audit_log, signing_key, db_url):
    raw_tenant, raw_user = "acme", "alice@example.com"
    pseudonym = pz.pseudonym("user", raw_user, tenant=raw_tenant)
    other = pz.pseudonym("user", "bob", tenant=raw_tenant)
    audit_log.append("evict", {"user": pseudonym}, {"pages": [1]})
    data = subject_data("user", raw_user, tenant=raw_tenant)

    def everything_an_attacker_can_compute() -> set[str]:
        """With the whole database, the index key, the signing key and the raw id."""
        with store.read() as conn:
            secrets = [bytes(s) for s in conn.scalars(select(SubjectKey.secret))]
            indexes = [bytes(i) for i in conn.scalars(select(SubjectKey.idx))]
        keys = [INDEX_KEY, signing_key._key.private_bytes_raw(), signing_key.public_key.raw]
        keys += secrets + indexes + [hmac.new(INDEX_KEY, data, hashlib.sha256).digest()]
        out = {pseudonym_of(k, data) for k in keys}
        out |= {hmac.new(k, data, hashlib.sha256).hexdigest()[:32] for k in keys}
        out |= {hashlib.sha256(k + data).hexdigest()[:32] for k in keys}
        out |= {hashlib.sha256(data).hexdigest()[:32]}
        return out

    # before shredding the link is there to find (the test can fail)
    assert pseudonym in everything_an_attacker_can_compute()
    assert pz.existing("user", raw_user, tenant=raw_tenant) == pseudonym
    with store.read() as conn:
        secret = bytes(conn.scalar(select(SubjectKey.secret).where(
            SubjectKey.idx == hmac.new(INDEX_KEY, data, hashlib.sha256).digest())))

    files = []
    if db_url.startswith("sqlite"):
        path = Path(db_url.removeprefix("sqlite:///"))
        files = [path, path.with_name(path.name + "-wal")]
        assert any(f.exists() and secret in f.read_bytes() for f in files)  # on disk before
    assert pz.shred("user", raw_user, tenant=raw_tenant) is True
    assert pz.shred("user", raw_user, tenant=raw_tenant) is False  # idempotent

    assert pseudonym not in everything_an_attacker_can_compute()
    assert pz.existing("user", raw_user, tenant=raw_tenant) is None
    assert pz.pseudonym("user", "bob", tenant=raw_tenant) == other  # others untouched
    assert pz.pseudonym("user", raw_user, tenant=raw_tenant) != pseudonym  # a fresh, unlinked secret
    assert store.record(audit_log.origin, 0).subject == {"user": pseudonym}  # the log is unchanged
    for f in files:  # SQLite: secure_delete + WAL truncation overwrote the secret on disk
        assert not f.exists() or secret not in f.read_bytes()


def test_index_key_file(tmp_path):
    path = tmp_path / "index.key"
    key = generate_index_key(path)
    assert os.stat(path).st_mode & 0o777 == 0o600
    assert load_index_key(path) == key
    os.chmod(path, 0o644)
    with pytest.raises(Exception, match="chmod 600"):
        load_index_key(path)
    assert "index key hidden" in repr(Pseudonymizer(object(), key))
    with pytest.raises(RecordFormatError):
        Pseudonymizer(object(), b"short")


def test_shred_refuses_to_report_success_while_a_reader_keeps_the_wal(sqlite_url):
    """A TRUNCATE checkpoint blocked by a reader answers with a 'busy' row, not an error: the
    deleted secret's old page would stay in the WAL file while the shred looked complete."""
    engine = make_engine(sqlite_url)

    @event.listens_for(engine, "connect")
    def _short_wait(dbapi_conn, _record):  # after make_engine's own: wait 0.2 s, not 30 s
        dbapi_conn.execute("PRAGMA busy_timeout=200")

    store = AuditStore(engine)
    pz = Pseudonymizer(store, INDEX_KEY)
    path = Path(sqlite_url.removeprefix("sqlite:///"))
    wal = path.with_name(path.name + "-wal")
    pz.pseudonym("user", "alice", tenant="acme")
    _, secret = store.find_subject_secret(pz.index(subject_data("user", "alice", tenant="acme")))
    reader = sqlite3.connect(path, isolation_level=None)
    try:
        reader.execute("BEGIN")
        reader.execute("SELECT count(*) FROM subject_keys").fetchall()  # a snapshot that pins the WAL
        assert secret in wal.read_bytes()
        with pytest.raises(StoreError, match="WAL"):
            pz.shred("user", "alice", tenant="acme")
        assert pz.existing("user", "alice", tenant="acme") is None  # the row itself is gone
        assert secret in wal.read_bytes()  # ...but not yet its old page
        reader.execute("COMMIT")
        assert pz.shred("user", "alice", tenant="acme") is False  # nothing left to delete, and
        assert not wal.exists() or secret not in wal.read_bytes()  # the retry truncates the WAL
        assert secret not in path.read_bytes()
    finally:
        reader.close()
        store.dispose()
