"""A stopped store tampered with, then the writer restarted on it: it signs nothing over any
tampered state, naming the record and the check (docs/audit-format.md §11.1), while
`kvguard audit check` and export say what they catch of the same. Then the runtime role's
grants: what it could still try is refused by the database (PostgreSQL). And an erased
person put back is never linked again.

One populated store per backend is built once per module and copied for each tamper
(a file copy; CREATE DATABASE ... TEMPLATE on PostgreSQL). The log is test_attacks.py's:
#0-#9, a checkpoint at 10, #10 an erase record that destroyed u-1's secret, #11-#19, a
checkpoint at 20."""

from __future__ import annotations

import base64
import shutil
import uuid
from dataclasses import dataclass

import psycopg
import pytest
from kvguard.audit.bundle.export import export_bundle
from kvguard.audit.bundle.verify import verify_bundle
from kvguard.audit.check import check_store
from kvguard.audit.errors import TamperedLogError, VerificationError
from kvguard.audit.keys import SigningKey
from kvguard.audit.pseudonym import Pseudonymizer, subject_data
from kvguard.audit.store import AuditStore, migrate
from sqlalchemy import text

from .audit_testlib import BACKENDS, fill, open_log
from .conftest import PG_ADMIN_URL, pg_admin
from .test_attacks import (
    ATTACKER,
    Log,
    add_a_key_row,
    delete_in_the_middle,
    delete_the_tail,
    edit_a_checkpoint_column,
    edit_a_checkpoint_note,
    edit_body_and_leaf_hash,
    edit_body_field,
    edit_query_columns,
    forged,
    insert_a_forged_tail_record,
    replace_the_first_key_row,
    resign_with_another_key,
    restore_a_shredded_secret,
    swap_two_records,
    tamper,
)

ORIGIN = "test.kvguard.example/restart"
KEY = SigningKey.from_seed(b"\x42" * 32)
INDEX_KEY = b"\x07" * 32


def break_the_last_checkpoint_signature(log: Log):
    note = log.store.latest_checkpoint(log.origin).note
    sig = note.rstrip("\n").rsplit(" ", 1)[1]
    raw = bytearray(base64.b64decode(sig))
    raw[-1] ^= 1  # the same key id, a signature that does not verify
    broken = base64.b64encode(bytes(raw)).decode()
    tamper(log.store, "UPDATE checkpoints SET note = :n WHERE origin = :o AND tree_size = 20", o=log.origin,
           n=note.replace(sig, broken))
    return "checkpoint_signature", 19


def edit_the_last_checkpoint_root_column(log: Log):
    tamper(log.store, "UPDATE checkpoints SET root_hash = :r WHERE origin = :o AND tree_size = 20", o=log.origin,
           r=bytes(32))
    return "checkpoint_columns", 19


def delete_the_tail_with_its_checkpoints(log: Log):
    tamper(log.store, "DELETE FROM records WHERE origin = :o AND seq >= 15",
           "DELETE FROM checkpoints WHERE origin = :o AND tree_size > 10", o=log.origin)
    return None, None  # consistent in itself: only a witness or an earlier bundle shows it


# tamper -> what the restarted writer names (check, seq); None: it cannot tell
WRITER = {
    edit_body_field: ("leaf_hash", 7),
    edit_body_and_leaf_hash: ("signature", 7),
    edit_query_columns: ("columns", 7),
    resign_with_another_key: ("key", 7),
    delete_in_the_middle: ("sequence", 7),
    delete_the_tail: ("truncation", 15),
    swap_two_records: ("sequence", 5),
    insert_a_forged_tail_record: ("signature", 20),
    edit_a_checkpoint_note: ("checkpoint_signature", 9),
    edit_a_checkpoint_column: ("checkpoint_columns", 9),
    break_the_last_checkpoint_signature: ("checkpoint_signature", 19),
    edit_the_last_checkpoint_root_column: ("checkpoint_columns", 19),
    restore_a_shredded_secret: ("erasure", 10),
    replace_the_first_key_row: ("keys", 0),
    add_a_key_row: ("keys", 14),
    delete_the_tail_with_its_checkpoints: None,
}
# what an export of the whole log and a verification of the bundle say (check, seq); None: both pass
EXPORT = {
    edit_body_field: ("leaf_hash", 7),
    edit_body_and_leaf_hash: ("signature", 7),
    edit_query_columns: None,  # a bundle carries bodies, never the query columns
    resign_with_another_key: ("key", 7),
    delete_in_the_middle: ("sequence", 7),
    delete_the_tail: ("sequence", 15),  # export: missing under the checkpoint
    swap_two_records: ("sequence", 5),
    insert_a_forged_tail_record: ("signature", 20),
    edit_a_checkpoint_note: ("checkpoint_signature", 9),
    edit_a_checkpoint_column: None,  # the notes are exported, not the columns
    break_the_last_checkpoint_signature: ("checkpoint_signature", 19),
    edit_the_last_checkpoint_root_column: None,
    restore_a_shredded_secret: None,  # secrets are not part of a bundle
    replace_the_first_key_row: ("keys", 0),
    add_a_key_row: ("keys", 14),
    delete_the_tail_with_its_checkpoints: None,
}
TAMPERS = list(WRITER)


@dataclass
class Template:
    url: str
    secret_row: dict
    new_copy: object  # () -> (url, cleanup)


def _populate(url: str) -> dict:
    store = AuditStore(url)
    names = Pseudonymizer(store, INDEX_KEY)
    with open_log(store, ORIGIN, KEY) as log:
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
    names.subject(tenant="acme", user="u-2")  # a live subject
    store.dispose()
    return row


@pytest.fixture(scope="module", params=BACKENDS)
def template(request, tmp_path_factory):
    if request.param == "sqlite":
        path = tmp_path_factory.mktemp("restart") / "template.db"
        url = f"sqlite:///{path}"
        migrate(url)
        row = _populate(url)

        def new_copy():
            copy = path.with_name(f"{uuid.uuid4().hex[:8]}.db")
            shutil.copyfile(path, copy)
            return f"sqlite:///{copy}", lambda: copy.unlink()

        yield Template(url, row, new_copy)
        return
    name = f"kvguard_tpl_{uuid.uuid4().hex[:10]}"
    pg_admin(f"CREATE DATABASE {name}")
    url = PG_ADMIN_URL.rsplit("/", 1)[0] + f"/{name}"
    try:
        migrate(url)
        row = _populate(url)

        def new_copy():
            copy = f"kvguard_cp_{uuid.uuid4().hex[:10]}"
            pg_admin(f"CREATE DATABASE {copy} TEMPLATE {name}")
            return url.rsplit("/", 1)[0] + f"/{copy}", lambda: pg_admin(f"DROP DATABASE IF EXISTS {copy} WITH (FORCE)")

        yield Template(url, row, new_copy)
    finally:
        pg_admin(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")


@pytest.fixture
def copy(template):
    url, cleanup = template.new_copy()
    store = AuditStore(url)
    yield Log(store, ORIGIN, KEY, template.secret_row)
    store.dispose()
    cleanup()


def _caught(call) -> tuple[str, int] | None:
    try:
        call()
    except VerificationError as exc:
        return exc.check, exc.seq
    except TamperedLogError as exc:
        return exc.failure.check, exc.failure.seq
    return None


@pytest.mark.parametrize("tamper_with", TAMPERS, ids=[t.__name__ for t in TAMPERS])
def test_a_restarted_writer_signs_nothing_over_a_tampered_store(copy, tamper_with, tmp_path):
    check = tamper_with(copy)
    size, latest = copy.store.size(ORIGIN), copy.store.latest_checkpoint(ORIGIN)

    # kvguard audit check, pinned to the log's first key
    assert _caught(lambda: check_store(copy.store, [ORIGIN], [KEY.public_key])) == (
        None if check == (None, None) else (("keys", 0) if tamper_with is replace_the_first_key_row else check))
    # export of everything a checkpoint covers and, if it exports, verification of the bundle
    def export_and_verify():
        export_bundle(copy.store, ORIGIN, str(tmp_path / "b.kvg"), KEY, progress=False)
        verify_bundle(tmp_path / "b.kvg", [KEY.public_key])

    assert _caught(export_and_verify) == EXPORT[tamper_with]

    def restart():
        with open_log(copy.store, ORIGIN, KEY) as writer:
            fill(writer, 8)
            writer.checkpoint()

    assert _caught(restart) == WRITER[tamper_with]
    if WRITER[tamper_with] is not None:  # nothing signed: no record, no checkpoint
        assert copy.store.size(ORIGIN) == size
        assert copy.store.latest_checkpoint(ORIGIN) == latest


def test_a_running_writer_halts_at_its_next_state_check(copy):
    with open_log(copy.store, ORIGIN, KEY) as writer:
        writer.check_state()  # intact
        edit_the_last_checkpoint_root_column(copy)
        add_a_key_row(copy)
        with pytest.raises(TamperedLogError) as err:
            writer.check_state()
        assert (err.value.failure.check, err.value.failure.seq) == ("keys", 14)
        assert writer.halted is err.value
        with pytest.raises(TamperedLogError):
            fill(writer, 1)
    assert copy.store.size(ORIGIN) == 20


def test_an_erased_person_put_back_gets_fresh_pseudonyms_only(copy):
    erased = copy.store.record(ORIGIN, 10).subject["user"]
    with open_log(copy.store, ORIGIN, KEY) as writer:
        reported = []
        names = Pseudonymizer(copy.store, INDEX_KEY, shredded=writer.shredded,
                              on_shredded=lambda origin, seq: reported.append((origin, seq)))
        restore_a_shredded_secret(copy)  # while the writer runs, from a backup taken before the erasure
        idx = copy.secret_row["idx"]
        user = names.subject(tenant="acme", user="u-1")["user"]
        assert user != erased and reported == [(ORIGIN, 10)]
        with copy.store.read() as conn:  # the put-back row is gone: a fresh secret holds the index
            stored = conn.scalar(text("SELECT secret FROM subject_keys WHERE idx = :i"), {"i": idx})
        assert bytes(stored) != copy.secret_row["secret"]
        assert names.subject(tenant="acme", user="u-1")["user"] == user  # the fresh one, from now on
        rec = writer.append("open", {"user": user}, {"policy": "chat"})
        assert rec.subject["user"] != erased
        writer.check_state()  # nothing put back is stored any more
    check_store(copy.store, [ORIGIN], [KEY.public_key])


# -- the runtime role (PostgreSQL): what its grants still allowed is refused by the database ------

RUNTIME_ATTEMPTS = {  # every tamper as the runtime role would try it: no trigger bypass
    "edit a body": "UPDATE records SET body = body || ' ' WHERE origin = :o AND seq = 7",
    "edit query columns": "UPDATE records SET op = 'fetch' WHERE origin = :o AND seq = 7",
    "delete a record": "DELETE FROM records WHERE origin = :o AND seq = 7",
    "delete the tail": "DELETE FROM records WHERE origin = :o AND seq >= 15",
    "edit a checkpoint": "UPDATE checkpoints SET root_hash = :z WHERE origin = :o AND tree_size = 10",
    "delete the checkpoints": "DELETE FROM checkpoints WHERE origin = :o AND tree_size > 10",
    "replace the first key row": "DELETE FROM keys WHERE origin = :o",
    "edit a key row": "UPDATE keys SET public_key = :z WHERE origin = :o",
    "add a key row": "INSERT INTO keys (origin, key_id, public_key, valid_from_seq, rotation_seq, created_ms) "
                     "VALUES (:o, :k, :p, 15, 14, 0)",
    "add a key row through the function": "SELECT kvguard_add_key(:o, :k, :p, 15, 14, 0)",
    "add a first key row through the function": "SELECT kvguard_add_key(:o, :k, :p, 0, NULL, 0)",
    "put a secret back": "INSERT INTO subject_keys (idx, kind, secret, created_ms) VALUES (:idx, :kind, :secret, 0)",
    "put a secret back through the function": "SELECT kvguard_add_subject_key(:idx, :kind, :secret, NULL, 0)",
    "put a secret back over a live row": "UPDATE subject_keys SET secret = :secret",
    "move a row to another index": "UPDATE subject_keys SET idx = :idx",
}


@pytest.fixture
def runtime_role(template, copy):
    if template.url.startswith("sqlite"):
        pytest.skip("SQLite has no roles: the writer's checks are the defence there")
    from kvguard.sidecar import roles

    role = f"kvguard_rt_{uuid.uuid4().hex[:8]}"
    database = copy.store.engine.url.database
    pg_admin(f"CREATE ROLE {role} LOGIN")
    try:
        with copy.store.write() as conn:
            roles.grant(conn, role)
        yield copy.store.engine.url.set(username=role)
    finally:
        copy.store.dispose()
        pg_admin(f"DROP DATABASE IF EXISTS {database} WITH (FORCE)")
        pg_admin(f"DROP ROLE IF EXISTS {role}")


@pytest.mark.postgres
def test_the_runtime_role_cannot_tamper_where_its_grants_once_allowed_it(copy, runtime_role):
    pub = ATTACKER.public_key
    row = copy.secret_row
    params = {"o": ORIGIN, "z": bytes(32), "k": pub.key_id, "p": pub.raw, "idx": row["idx"], "kind": row["kind"],
              "secret": row["secret"]}
    with psycopg.connect(f"host=127.0.0.1 port=5432 dbname={runtime_role.database} user={runtime_role.username}",
                         autocommit=True) as conn:
        for what, sql in RUNTIME_ATTEMPTS.items():
            with pytest.raises(psycopg.errors.DatabaseError) as err:
                conn.execute(_pyformat(sql), params)
            assert isinstance(err.value, (psycopg.errors.InsufficientPrivilege, psycopg.errors.RestrictViolation)), \
                (what, err.value)
        # what its grants allow: a forged record at the tail, which the writer refuses on open
        r = forged(copy, 20, claim_log_key=True)
        conn.execute("INSERT INTO records (origin, seq, time_ms, op, key_id, prev, leaf_hash, sig, body) "
                     "VALUES (%s, %s, %s, %s, %s, %s, %s, %s, %s)",
                     (r.origin, r.seq, r.time_ms, r.op, r.key_id, r.prev, r.leaf_hash, r.sig, r.leaf_bytes.decode()))
    with pytest.raises(TamperedLogError) as err:
        open_log(copy.store, ORIGIN, KEY)
    assert (err.value.failure.check, err.value.failure.seq) == ("signature", 20)


@pytest.mark.postgres
def test_the_runtime_role_rotates_and_makes_secrets_through_the_functions(copy, runtime_role):
    store = AuditStore(runtime_role.render_as_string(hide_password=False))
    try:
        with open_log(store, ORIGIN, KEY) as writer:  # a key row with its rotation record
            rotation = writer.rotate_key(SigningKey.from_seed(b"\x43" * 32))
            fill(writer, 2)
        assert [k.rotation_seq for k in store.keys(ORIGIN)] == [None, rotation.seq]
        names = Pseudonymizer(store, INDEX_KEY)  # a new subject's secret
        assert names.subject(tenant="acme", user="u-3")["user"]
        with open_log(store, "test.kvguard.example/another", KEY):  # a new log's first key
            pass
    finally:
        store.dispose()


def _pyformat(sql: str) -> str:
    """`:name` parameters as psycopg's `%(name)s`."""
    import re

    return re.sub(r"(?<!:):([a-z]+)", r"%(\1)s", sql)
