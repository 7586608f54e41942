"""The log as an attacker with write access to the database leaves it: superuser SQL around
the append-only triggers, one attack per case. `kvguard audit check` (audit.check) catches
each and names the record, and a writer never chains onto a forged row, running or
restarted. Over SQLite and PostgreSQL (a scratch database per session, one origin per case).

The log of every case: records #0-#9, a checkpoint at 10, #10 an erase record that destroyed
the secret of user u-1, #11-#19, a checkpoint at 20."""

from __future__ import annotations

import os
from dataclasses import dataclass

import pytest
from kvguard.audit import cli
from kvguard.audit.check import check_store
from kvguard.audit.checkpoint import Checkpoint
from kvguard.audit.errors import TamperedLogError, VerificationError
from kvguard.audit.keys import SigningKey
from kvguard.audit.merkle import leaf_hash as merkle_leaf_hash
from kvguard.audit.pseudonym import Pseudonymizer, subject_data
from kvguard.audit.record import Record
from kvguard.audit.store import AuditStore
from sqlalchemy import text

from .audit_testlib import fill, open_log

TRIGGERS = [f"{t}_no_{a}" for t in ("logs", "keys", "records", "checkpoints") for a in ("update", "delete")]
ATTACKER = SigningKey.from_seed(b"\x66" * 32)


def tamper(store: AuditStore, *statements: str, **params) -> None:
    """Statements run as the attacker would: as superuser, triggers bypassed."""
    with store.write() as conn:
        if store.dialect == "postgresql":
            conn.execute(text("SET LOCAL session_replication_role = replica"))
        else:
            for trigger in TRIGGERS:
                conn.execute(text(f"DROP TRIGGER IF EXISTS {trigger}"))
        for statement in statements:
            conn.execute(text(statement), params)


@dataclass
class Log:
    store: AuditStore
    origin: str
    key: SigningKey
    secret_row: dict  # the shredded secret's row, as a backup taken before the erasure holds it


@pytest.fixture
def log20(store, origin, signing_key) -> Log:
    names = Pseudonymizer(store, os.urandom(32))
    with open_log(store, origin, signing_key) as log:
        fill(log, 10)
        log.checkpoint()
        user = names.subject(tenant="acme", user="u-1")["user"]
        idx = names.index(subject_data("user", "u-1", "acme"))
        with store.read() as conn:
            row = conn.execute(text("SELECT idx, kind, secret, created_ms FROM subject_keys WHERE idx = :i"),
                               {"i": idx}).one()._asdict()
        tag = store.shred_subject_secret(idx)
        log.append("erase", {"user": user}, {"secrets_destroyed": 1, "shredded": [tag]})
        fill(log, 9)
        log.checkpoint()
    check_store(store, [origin], [signing_key.public_key])  # intact before the attack
    yield Log(store, origin, signing_key, row)
    # a secret put back would stop every writer of the session's database (audit.state)
    with store.write() as conn:
        conn.execute(text("DELETE FROM subject_keys WHERE idx = :i"), {"i": row["idx"]})


def body(log: Log, seq: int) -> str:
    return log.store.record(log.origin, seq).leaf_bytes.decode()


def forged(log: Log, seq: int, *, claim_log_key: bool, **details) -> Record:
    """A record at `seq` chained onto the stored one before it, signed by the attacker's key;
    `claim_log_key` names the log's key id instead of the attacker's."""
    prev = log.store.record(log.origin, seq - 1).digest
    r = Record.sign_new(ATTACKER, log.origin, seq, "2025-01-31T12:00:00.000Z", "evict", {},
                        details or {"pages": [seq]}, prev)
    if not claim_log_key:
        return r
    unsigned = Record(r.origin, r.seq, r.time, r.op, r.subject, r.details, r.prev, log.key.key_id)
    return unsigned.with_signature(ATTACKER.sign(unsigned.signing_bytes()))


def insert(log: Log, r: Record) -> None:
    tamper(log.store, "INSERT INTO records (origin, seq, time_ms, op, key_id, prev, leaf_hash, sig, body) "
           "VALUES (:o, :s, :t, :op, :k, :p, :h, :sig, :b)", o=r.origin, s=r.seq, t=r.time_ms, op=r.op,
           k=r.key_id, p=r.prev, h=r.leaf_hash, sig=r.sig, b=r.leaf_bytes.decode())


# -- the attacks: each edits the database, and says which check names which record ----------------

def edit_body_field(log: Log):
    tamper(log.store, "UPDATE records SET body = :b WHERE origin = :o AND seq = 7", o=log.origin,
           b=body(log, 7).replace('"bytes":28672', '"bytes":28673'))
    return "signature", 7


def edit_body_and_leaf_hash(log: Log):
    new = body(log, 7).replace('"bytes":28672', '"bytes":28673')
    tamper(log.store, "UPDATE records SET body = :b, leaf_hash = :h WHERE origin = :o AND seq = 7",
           o=log.origin, b=new, h=merkle_leaf_hash(new.encode()))
    return "signature", 7


def edit_query_columns(log: Log):
    tamper(log.store, "UPDATE records SET op = 'fetch', time_ms = time_ms + 1 WHERE origin = :o AND seq = 7",
           o=log.origin)
    return "columns", 7


def resign_with_another_key(log: Log):
    r = forged(log, 7, claim_log_key=False, pages=[7], bytes=1)
    tamper(log.store, "UPDATE records SET body = :b, sig = :sig, key_id = :k, leaf_hash = :h "
           "WHERE origin = :o AND seq = 7", o=log.origin, b=r.leaf_bytes.decode(), sig=r.sig, k=r.key_id,
           h=r.leaf_hash)
    return "key", 7


def delete_in_the_middle(log: Log):
    tamper(log.store, "DELETE FROM records WHERE origin = :o AND seq = 7", o=log.origin)
    return "sequence", 7


def delete_the_tail(log: Log):
    tamper(log.store, "DELETE FROM records WHERE origin = :o AND seq >= 15", o=log.origin)
    return "truncation", 15


def swap_two_records(log: Log):
    cols = "time_ms, op, key_id, prev, leaf_hash, sig, body"
    tamper(log.store,
           f"CREATE TEMPORARY TABLE swap AS SELECT seq, {cols} FROM records WHERE origin = :o AND seq IN (5, 6)",
           "DELETE FROM records WHERE origin = :o AND seq IN (5, 6)",
           f"INSERT INTO records (origin, seq, {cols}) SELECT :o, 11 - seq, {cols} FROM swap", o=log.origin)
    return "sequence", 5


def insert_a_forged_tail_record(log: Log):
    insert(log, forged(log, 20, claim_log_key=True))
    return "signature", 20


def edit_a_checkpoint_note(log: Log):
    (note,) = [c.note for c in log.store.checkpoints(log.origin) if c.size == 10]
    cp = Checkpoint.parse_text(note.split("\n\n")[0] + "\n")
    other = Checkpoint(cp.origin, cp.size, bytes(32)).text()
    tamper(log.store, "UPDATE checkpoints SET note = :n WHERE origin = :o AND tree_size = 10", o=log.origin,
           n=note.replace(cp.text(), other))
    return "checkpoint_signature", 9


def edit_a_checkpoint_column(log: Log):
    tamper(log.store, "UPDATE checkpoints SET root_hash = :r WHERE origin = :o AND tree_size = 10", o=log.origin,
           r=bytes(32))
    return "checkpoint_columns", 9


def restore_a_shredded_secret(log: Log):
    tamper(log.store, "INSERT INTO subject_keys (idx, kind, secret, created_ms) VALUES (:idx, :kind, :secret, "
           ":created_ms)", **log.secret_row)
    return "erasure", 10


def replace_the_first_key_row(log: Log):
    pub = ATTACKER.public_key
    tamper(log.store, "DELETE FROM keys WHERE origin = :o",
           "INSERT INTO keys (origin, key_id, public_key, valid_from_seq, rotation_seq, created_ms) "
           "VALUES (:o, :k, :p, 0, NULL, 0)", o=log.origin, k=pub.key_id, p=pub.raw)
    return "key", 0  # record #0 is signed by a key the (replaced) table does not hold


def add_a_key_row(log: Log):
    pub = ATTACKER.public_key
    tamper(log.store, "INSERT INTO keys (origin, key_id, public_key, valid_from_seq, rotation_seq, created_ms) "
           "VALUES (:o, :k, :p, 15, 14, 0)", o=log.origin, k=pub.key_id, p=pub.raw)
    return "keys", 14


ATTACKS = [edit_body_field, edit_body_and_leaf_hash, edit_query_columns, resign_with_another_key,
           delete_in_the_middle, delete_the_tail, swap_two_records, insert_a_forged_tail_record,
           edit_a_checkpoint_note, edit_a_checkpoint_column, restore_a_shredded_secret,
           replace_the_first_key_row, add_a_key_row]


@pytest.mark.parametrize("attack", ATTACKS, ids=[a.__name__ for a in ATTACKS])
def test_check_names_the_record_of_each_attack(log20, attack, capsys):
    check, seq = attack(log20)
    with pytest.raises(VerificationError) as err:
        check_store(log20.store, [log20.origin])  # as the admin endpoint runs it: no pinned key
    assert (err.value.check, err.value.record) == (check, f"{log20.origin}#{seq}"), err.value
    # the command line: exit 1, the record named
    assert cli.main(["check", "--database-url", log20.store.engine.url.render_as_string(False),
                     "--origin", log20.origin, "--no-progress"]) == cli.EXIT_FAILED
    out = capsys.readouterr().out
    assert out.startswith("NOT CONSISTENT") and f"{log20.origin}#{seq}" in out and check in out


def test_a_pinned_first_key_names_a_replaced_key_row(log20):
    replace_the_first_key_row(log20)
    with pytest.raises(VerificationError) as err:
        check_store(log20.store, [log20.origin], [log20.key.public_key])
    assert (err.value.check, err.value.record) == ("keys", f"{log20.origin}#0")


def test_export_refuses_an_edited_body_and_names_it(log20, tmp_path):
    from kvguard.audit.bundle.export import export_bundle
    from kvguard.audit.tree import HashTree

    edit_body_and_leaf_hash(log20)
    tree = HashTree()  # and the root column the stored leaves now give, as export once compared
    tree.extend(leaf for _, leaf in log20.store.iter_leaves(log20.origin))
    tamper(log20.store, "UPDATE checkpoints SET root_hash = :r WHERE origin = :o AND tree_size = 20",
           o=log20.origin, r=tree.root())

    with pytest.raises(VerificationError) as err:
        export_bundle(log20.store, log20.origin, str(tmp_path / "b.kvg"), log20.key, progress=False)
    assert err.value.record == f"{log20.origin}#7" and not (tmp_path / "b.kvg").exists()


def test_a_running_writer_halts_on_a_forged_tail_record_and_a_restarted_one_refuses_to_open(log20):
    writer = open_log(log20.store, log20.origin, log20.key)
    try:
        insert_a_forged_tail_record(log20)
        with pytest.raises(TamperedLogError) as err:  # its append meets the forged row and verifies it
            fill(writer, 1)
        assert err.value.failure.record == f"{log20.origin}#20" and err.value.failure.check == "signature"
        assert writer.halted is err.value
        with pytest.raises(TamperedLogError):  # nothing more is signed or acknowledged
            fill(writer, 1)
        with pytest.raises(TamperedLogError):
            writer.checkpoint()
    finally:
        writer.close()
    assert log20.store.size(log20.origin) == 21  # the forged row, and nothing chained onto it
    assert log20.store.latest_checkpoint(log20.origin).size == 20
    with pytest.raises(TamperedLogError) as err:
        open_log(log20.store, log20.origin, log20.key)
    assert err.value.failure.record == f"{log20.origin}#20"


def test_a_writer_never_signs_anew_over_a_cut_tail(log20):
    writer = open_log(log20.store, log20.origin, log20.key)
    try:
        delete_the_tail(log20)
        with pytest.raises(TamperedLogError) as err:  # running: its append finds the log shorter
            fill(writer, 1)
        assert (err.value.failure.check, err.value.failure.record) == ("truncation", f"{log20.origin}#15")
    finally:
        writer.close()
    with pytest.raises(TamperedLogError) as err:  # restarted: its own checkpoint covers #19
        open_log(log20.store, log20.origin, log20.key)
    assert (err.value.failure.check, err.value.failure.record) == ("truncation", f"{log20.origin}#15")
    assert log20.store.size(log20.origin) == 15


def test_a_restarted_writer_refuses_rows_edited_under_its_last_checkpoint(log20):
    edit_body_and_leaf_hash(log20)  # the stored leaves no longer hash to the signed root
    with pytest.raises(TamperedLogError) as err:
        open_log(log20.store, log20.origin, log20.key)
    assert err.value.failure.record == f"{log20.origin}#7"


def test_check_exit_status_and_scope(log20, capsys, monkeypatch):
    url = log20.store.engine.url.render_as_string(False)
    assert cli.main(["check", "--database-url", url, "--origin", log20.origin, "--no-progress", "--json"]) == 0
    assert '"consistent": true' in capsys.readouterr().out
    assert cli.main(["check", "--database-url", url, "--origin", "no.such/log"]) == cli.EXIT_USAGE
    assert "no log 'no.such/log'" in capsys.readouterr().err
    monkeypatch.delenv("KVGUARD_DATABASE_URL", raising=False)
    assert cli.main(["check"]) == cli.EXIT_USAGE


def test_a_rotated_log_checks_and_a_moved_key_row_is_named(store, origin, signing_key):
    with open_log(store, origin, signing_key) as log:
        fill(log, 3)
        rotation = log.rotate_key(SigningKey.generate())
        fill(log, 3)
        log.checkpoint()
    summary = check_store(store, [origin], [signing_key.public_key])
    assert (summary.records, summary.keys) == (7, 2)
    tamper(store, "UPDATE keys SET valid_from_seq = 2 WHERE origin = :o AND rotation_seq = :r",
           o=origin, r=rotation.seq)
    with pytest.raises(VerificationError) as err:
        check_store(store, [origin], [signing_key.public_key])
    assert (err.value.check, err.value.record) == ("keys", f"{origin}#{rotation.seq}")


def test_a_restarted_writer_refuses_a_checkpoint_row_it_did_not_sign(log20):
    forged_note = Checkpoint(log20.origin, 20, bytes(32)).sign(ATTACKER)
    tamper(log20.store, "DELETE FROM checkpoints WHERE origin = :o AND tree_size = 20",
           "INSERT INTO checkpoints (origin, tree_size, root_hash, time_ms, key_id, note) "
           "VALUES (:o, 20, :r, 0, :k, :n)", o=log20.origin, r=bytes(32), k=log20.key.key_id, n=forged_note)
    with pytest.raises(TamperedLogError) as err:  # it would hand the row out in receipts and proofs
        open_log(log20.store, log20.origin, log20.key)
    assert (err.value.failure.check, err.value.failure.record) == ("checkpoint_signature", f"{log20.origin}#19")
