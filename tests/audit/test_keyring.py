"""Subject secrets wrapped under a key-encryption key kept outside the database, and its rotation:
a copy of a secret row taken before a rotation (a backup, a WAL segment) is unreadable after it."""

from __future__ import annotations

import stat

import pytest
from kvguard.audit.errors import KeyFileError
from kvguard.audit.keyring import Keyring
from kvguard.audit.models import Kek, SubjectKey
from kvguard.audit.pseudonym import Pseudonymizer, pseudonym_of, subject_data
from kvguard.audit.store import AuditStore, migrate
from sqlalchemy import create_engine, insert, select, text

INDEX_KEY = b"\x07" * 32


@pytest.fixture(params=["sqlite", pytest.param("postgresql", marks=pytest.mark.postgres)])
def own_db(request) -> str:
    """A database of this test's own: rotation re-wraps every row of subject_keys."""
    if request.param == "sqlite":
        return request.getfixturevalue("sqlite_url")
    url = request.getfixturevalue("fresh_pg_url")
    migrate(url)
    return url


def attacker(url: str, sql: str, **params):
    """Direct SQL as a superuser would run it (triggers bypassed where the table has any)."""
    engine = create_engine(url)
    try:
        with engine.begin() as conn:
            if engine.dialect.name == "postgresql":
                conn.execute(text("SET session_replication_role = replica"))
            return conn.execute(text(sql), params).all() if sql.lstrip().upper().startswith("SELECT") else \
                conn.execute(text(sql), params)
    finally:
        engine.dispose()


def test_a_restored_secret_row_cannot_be_unwrapped_after_a_rotation(own_db, tmp_path):
    store = AuditStore(own_db)
    ring = Keyring(tmp_path / "kek", store)
    pz = Pseudonymizer(store, INDEX_KEY, ring)
    alice = pz.pseudonym("user", "alice", tenant="acme")
    bob = pz.pseudonym("user", "bob", tenant="acme")
    first = store.current_kek()
    assert stat.S_IMODE(ring.path(first).stat().st_mode) == 0o600
    # the database holds no secret in the clear: the pseudonym does not follow from any stored value
    data = subject_data("user", "alice", tenant="acme")
    rows = attacker(own_db, "SELECT idx, secret, kek_id FROM subject_keys")
    assert rows and all(kek == first and len(bytes(blob)) == 60 for _, blob, kek in rows)
    assert all(pseudonym_of(bytes(blob)[:32], data) != alice for _, blob, _ in rows)
    # a backup taken now holds alice's row
    idx = pz.index(data)
    backup = attacker(own_db, "SELECT idx, kind, secret, created_ms, kek_id FROM subject_keys WHERE idx = :i", i=idx)

    # rotation: a new KEK, every live secret re-wrapped under it, the old KEK destroyed
    done = []
    second = ring.rotate(progress=done.append)
    assert second != first and done and done[-1] >= 2
    assert not ring.path(first).exists() and ring.path(second).exists()
    assert pz.pseudonym("user", "alice", tenant="acme") == alice  # live secrets still open
    assert pz.pseudonym("user", "bob", tenant="acme") == bob
    with store.read() as conn:
        assert set(conn.scalars(select(SubjectKey.kek_id))) == {second}
        assert conn.scalar(select(Kek.destroyed_ms).where(Kek.id == first)) is not None

    # alice is shredded; the attacker restores her row from the backup
    assert pz.shred("user", "alice", tenant="acme")
    assert pz.existing("user", "alice", tenant="acme") is None
    attacker(own_db, "INSERT INTO subject_keys (idx, kind, secret, created_ms, kek_id) VALUES (:i, :k, :s, :c, :e)",
             **dict(zip(("i", "k", "s", "c", "e"), backup[0])))
    with pytest.raises(KeyFileError, match=f"key-encryption key {first} .* destroyed"):
        pz.existing("user", "alice", tenant="acme")
    # nor does it open under the KEK that is left, even relabelled as wrapped by it
    attacker(own_db, "UPDATE subject_keys SET kek_id = :e WHERE idx = :i", e=second, i=idx)
    with pytest.raises(KeyFileError, match="does not open"):
        pz.existing("user", "alice", tenant="acme")
    # and the restored row cannot stop the next rotation, which names it and leaves it unreadable
    attacker(own_db, "UPDATE subject_keys SET kek_id = :e WHERE idx = :i", e=first, i=idx)
    third = ring.rotate()
    assert ring.unreadable == [idx] and pz.pseudonym("user", "bob", tenant="acme") == bob
    with pytest.raises(KeyFileError, match=f"key-encryption key {first} "):
        pz.existing("user", "alice", tenant="acme")
    assert store.current_kek() == third
    store.dispose()


def test_a_blob_moved_to_another_row_does_not_open(sqlite_url, tmp_path):
    store = AuditStore(sqlite_url)
    pz = Pseudonymizer(store, INDEX_KEY, Keyring(tmp_path / "kek", store))
    pz.pseudonym("user", "alice", tenant="acme")
    pz.pseudonym("user", "mallory", tenant="acme")
    a, m = (pz.index(subject_data("user", u, tenant="acme")) for u in ("alice", "mallory"))
    attacker(sqlite_url, "UPDATE subject_keys SET secret = (SELECT secret FROM subject_keys WHERE idx = :a) "
                         "WHERE idx = :m", a=a, m=m)
    with pytest.raises(KeyFileError, match="moved from another subject's row"):
        pz.existing("user", "mallory", tenant="acme")
    store.dispose()


def test_secrets_stored_in_the_clear_are_wrapped_and_a_missing_kek_is_named(sqlite_url, tmp_path):
    store = AuditStore(sqlite_url)
    clear = Pseudonymizer(store, INDEX_KEY)  # as before wrapping existed: kek_id NULL
    alice = clear.pseudonym("user", "alice", tenant="acme")
    ring = Keyring(tmp_path / "kek", store)
    kek = ring.current()
    with pytest.raises(Exception, match="stored in the clear although secrets are wrapped"):
        Pseudonymizer(store, INDEX_KEY, ring).existing("user", "alice", tenant="acme")
    assert ring.rewrap(kek) == 1
    with store.read() as conn:
        assert conn.scalar(select(SubjectKey.kek_id)) == kek
    assert Pseudonymizer(store, INDEX_KEY, ring).pseudonym("user", "alice", tenant="acme") == alice
    with pytest.raises(Exception, match="give the Pseudonymizer the keyring"):
        clear.existing("user", "alice", tenant="acme")
    # another sidecar of the database given a directory without the current KEK
    with pytest.raises(KeyFileError, match="not the one every sidecar of this database shares"):
        Pseudonymizer(store, INDEX_KEY, Keyring(tmp_path / "elsewhere", store)).pseudonym("user", "bob",
                                                                                            tenant="acme")
    with store.write() as conn:
        conn.execute(insert(Kek).values(id="0" * 16, created_ms=0, destroyed_ms=1))  # a destroyed one is not current
    assert store.current_kek() == kek
    store.dispose()
