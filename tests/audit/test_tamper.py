"""Tampering with a stored log, bypassing the append-only triggers: verification names
the record and the failed check. Parametrized over SQLite and PostgreSQL."""

from __future__ import annotations

import pytest
from kvguard.audit.errors import VerificationError
from kvguard.audit.keys import SigningKey
from kvguard.audit.record import Record
from kvguard.audit.store import AuditStore
from kvguard.audit.verify import verify_store
from sqlalchemy import text

from .audit_testlib import fill, open_log

TRIGGERS = [f"{t}_no_{a}" for t in ("records", "checkpoints") for a in ("update", "delete")]


def tamper(store: AuditStore, *statements: str, **params) -> None:
    """Run statements as an attacker with database access would: around the triggers."""
    with store.write() as conn:
        if store.dialect == "postgresql":
            conn.execute(text("SET LOCAL session_replication_role = replica"))  # superuser: triggers off
        else:
            for trigger in TRIGGERS:
                conn.execute(text(f"DROP TRIGGER IF EXISTS {trigger}"))
        for statement in statements:
            conn.execute(text(statement), params)


@pytest.fixture
def log20(store, origin, signing_key):
    with open_log(store, origin, signing_key) as log:
        fill(log, 10)
        log.checkpoint()
        fill(log, 10)
        log.checkpoint()
    verify_store(store, origin, [signing_key.public_key])  # intact before each attack
    return store


def caught(store, origin, key) -> VerificationError:
    with pytest.raises(VerificationError) as err:
        verify_store(store, origin, [key.public_key])
    assert err.value.origin == origin
    assert f"record {origin}#{err.value.seq}" in str(err.value)
    return err.value


def test_one_byte_of_details(log20, origin, signing_key):
    tamper(log20, "UPDATE records SET body = replace(body, :old, :new) WHERE origin = :o AND seq = 7",
           o=origin, old='"bytes":28672', new='"bytes":28673')
    err = caught(log20, origin, signing_key)
    assert (err.check, err.seq) == ("signature", 7)


def test_deleted_record(log20, origin, signing_key):
    tamper(log20, "DELETE FROM records WHERE origin = :o AND seq = 7", o=origin)
    err = caught(log20, origin, signing_key)
    assert (err.check, err.seq) == ("sequence", 7)
    assert "missing" in err.message


def test_swapped_records(log20, origin, signing_key):
    cols = "time_ms, op, key_id, prev, leaf_hash, sig, body"
    tamper(
        log20,
        f"CREATE TEMPORARY TABLE swap AS SELECT seq, {cols} FROM records WHERE origin = :o AND seq IN (5, 6)",
        "DELETE FROM records WHERE origin = :o AND seq IN (5, 6)",
        f"INSERT INTO records (origin, seq, {cols}) SELECT :o, 11 - seq, {cols} FROM swap",
        o=origin,
    )
    err = caught(log20, origin, signing_key)
    assert (err.check, err.seq) == ("sequence", 5)


def test_replaced_signature(log20, origin, signing_key):
    other = log20.record(origin, 8).sig
    tamper(log20, "UPDATE records SET sig = :s, body = replace(body, sig, :s2) WHERE origin = :o AND seq = 7",
           o=origin, s=other, s2=other)
    err = caught(log20, origin, signing_key)
    assert (err.check, err.seq) == ("signature", 7)


def test_truncated_tail_under_a_checkpoint(log20, origin, signing_key):
    tamper(log20, "DELETE FROM records WHERE origin = :o AND seq >= 15", o=origin)
    err = caught(log20, origin, signing_key)
    assert (err.check, err.seq) == ("truncation", 15)


def test_record_appended_with_another_key(log20, origin, signing_key):
    intruder = SigningKey.generate()
    last = log20.record(origin, 19)
    forged = Record(origin, 20, last.time, "evict", {}, {"pages": [1]}, last.digest, intruder.key_id)
    data = forged.signing_bytes()
    log20.append(origin, [forged.with_signature(intruder.sign(data), data)], 20)
    err = caught(log20, origin, signing_key)
    assert (err.check, err.seq) == ("key", 20)
    assert "unknown key id" in err.message


def test_record_appended_claiming_the_log_key(log20, origin, signing_key):
    intruder = SigningKey.generate()
    last = log20.record(origin, 19)
    forged = Record(origin, 20, last.time, "evict", {}, {}, last.digest, signing_key.key_id)
    data = forged.signing_bytes()
    log20.append(origin, [forged.with_signature(intruder.sign(data), data)], 20)
    err = caught(log20, origin, signing_key)
    assert (err.check, err.seq) == ("signature", 20)


def test_query_column_rewritten(log20, origin, signing_key):
    tamper(log20, "UPDATE records SET op = 'fetch' WHERE origin = :o AND seq = 3", o=origin)
    err = caught(log20, origin, signing_key)
    assert (err.check, err.seq) == ("columns", 3)


def test_checkpoint_root_rewritten(log20, origin, signing_key):
    cp = log20.checkpoints(origin)[0]
    forged = cp.note.replace(cp.note.split("\n")[2], "A" * 43 + "=")
    tamper(log20, "UPDATE checkpoints SET note = :n WHERE origin = :o AND tree_size = 10", o=origin, n=forged)
    err = caught(log20, origin, signing_key)
    assert (err.check, err.seq) == ("checkpoint_signature", 9)


def test_plain_update_and_delete_are_refused_by_the_database(log20, origin):
    from sqlalchemy.exc import DatabaseError

    for statement in ("UPDATE records SET body = 'x' WHERE origin = :o",
                      "DELETE FROM records WHERE origin = :o AND seq = 19",
                      "DELETE FROM checkpoints WHERE origin = :o"):
        with pytest.raises(DatabaseError, match="append-only"):
            with log20.write() as conn:
                conn.execute(text(statement), {"o": origin})
    assert log20.size(origin) == 20
