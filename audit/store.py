"""The audit store: every query the log, exporter, pseudonymizer and verifier run.

Writers serialize per log: SQLite writers take the database lock up front
(BEGIN IMMEDIATE, audit.engine) so two never read the same tail; PostgreSQL
writers lock their log's row (SELECT ... FOR UPDATE), so logs of different
origins never wait on each other. The (origin, seq) primary key is the last
defence: a writer that still loses a race gets ChainConflictError and reloads.
Engines and migrations are in audit.engine (re-exported here).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager, suppress
from dataclasses import dataclass

from sqlalchemy import Connection, Engine, bindparam, delete, func, insert, select, text, update
from sqlalchemy.exc import IntegrityError

from .engine import READ_ONLY, alembic_config, check_current, downgrade, make_engine, migrate
from .errors import ChainConflictError, StoreError
from .fields import parse_time
from .keys import PublicKey
from .models import CheckpointRow, Kek, Log, LogKey, RecordRow, SubjectKey
from .ops import ERASE_OPS
from .pseudonym import shred_tag
from .record import Record


@dataclass(frozen=True, slots=True)
class KeyEntry:
    key: PublicKey
    valid_from_seq: int
    rotation_seq: int | None


@dataclass(frozen=True, slots=True)
class CheckpointEntry:
    origin: str
    size: int
    root: bytes
    time_ms: int
    key_id: str
    note: str


class AuditStore:
    def __init__(self, url_or_engine: str | Engine) -> None:
        self.engine = make_engine(url_or_engine) if isinstance(url_or_engine, str) else url_or_engine
        self.dialect = self.engine.dialect.name
        self._checked_inserts: bool | None = None

    def checked_inserts(self, conn: Connection) -> bool:
        """Whether key rows and secrets go through the owner's functions (PostgreSQL, schema
        0124 on: the runtime role may not insert them itself)."""
        if self._checked_inserts is None:
            self._checked_inserts = self.dialect == "postgresql" and conn.scalar(text(
                "SELECT to_regprocedure('kvguard_add_key(text, text, bytea, bigint, bigint, bigint)') IS NOT NULL"))
        return self._checked_inserts

    def dispose(self) -> None:
        self.engine.dispose()

    @contextmanager
    def write(self) -> Iterator[Connection]:
        with self.engine.begin() as conn:
            yield conn

    @contextmanager
    def read(self) -> Iterator[Connection]:
        with self.engine.connect() as conn:
            conn.execution_options(**{READ_ONLY: True})
            with conn.begin():
                yield conn

    # -- logs and keys -------------------------------------------------------------

    def create_log(self, origin: str, key: PublicKey, now_ms: int) -> None:
        with self.write() as conn:
            conn.execute(insert(Log).values(origin=origin, created_ms=now_ms))
            self._add_key(conn, origin, key, 0, None, now_ms)

    def has_log(self, origin: str) -> bool:
        with self.read() as conn:
            return conn.scalar(select(Log.origin).where(Log.origin == origin)) is not None

    def origins(self) -> list[str]:
        with self.read() as conn:
            return list(conn.scalars(select(Log.origin).order_by(Log.origin)))

    def keys(self, origin: str) -> list[KeyEntry]:
        with self.read() as conn:
            rows = conn.execute(
                select(LogKey.public_key, LogKey.valid_from_seq, LogKey.rotation_seq)
                .where(LogKey.origin == origin)
                .order_by(LogKey.valid_from_seq)
            )
            return [KeyEntry(PublicKey.from_raw(pk), start, rot) for pk, start, rot in rows]

    def _add_key(self, conn: Connection, origin: str, key: PublicKey, start: int, rot: int | None,
                 now: int) -> None:
        values = {"origin": origin, "key_id": key.key_id, "public_key": key.raw,
                  "valid_from_seq": start, "rotation_seq": rot, "created_ms": now}
        if self.checked_inserts(conn):  # the runtime role may not insert: the owner's function checks the row
            conn.execute(text("SELECT kvguard_add_key(CAST(:origin AS text), CAST(:key_id AS text), "
                              "CAST(:public_key AS bytea), CAST(:valid_from_seq AS bigint), "
                              "CAST(:rotation_seq AS bigint), CAST(:created_ms AS bigint))"), values)
        else:
            conn.execute(insert(LogKey).values(values))

    # -- records -------------------------------------------------------------------

    def size(self, origin: str, conn: Connection | None = None) -> int:
        query = select(func.max(RecordRow.seq)).where(RecordRow.origin == origin)
        if conn is None:
            with self.read() as c:
                last = c.scalar(query)
        else:
            last = conn.scalar(query)
        return 0 if last is None else last + 1

    def append(self, origin: str, records: Sequence[Record], expected_size: int,
               new_key: tuple[PublicKey, int, int] | None = None,
               checkpoint: CheckpointEntry | None = None) -> None:
        """Insert `records` (seq expected_size, expected_size + 1, ...) in one transaction,
        or raise ChainConflictError if the log grew meanwhile. `new_key` = (key,
        valid_from_seq, rotation_seq) registers a rotated-in key atomically with its record;
        `checkpoint` (of the log with these records) is stored in the same transaction."""
        try:
            with self.write() as conn:
                if self.dialect == "postgresql":
                    conn.execute(select(Log.origin).where(Log.origin == origin).with_for_update())
                size = self.size(origin, conn)
                if size != expected_size:
                    raise ChainConflictError(
                        f"log {origin} has {size} records, writer expected {expected_size}")
                self._insert_records(conn, records)
                if new_key is not None:
                    self._add_key(conn, origin, new_key[0], new_key[1], new_key[2], records[-1].time_ms)
                if checkpoint is not None:
                    conn.execute(insert(CheckpointRow).values(_checkpoint_row(checkpoint)))
        except (IntegrityError, self.engine.dialect.loaded_dbapi.IntegrityError) as exc:
            # the primary key (origin, seq) caught a race the lock did not (COPY raises the
            # driver's own IntegrityError, not SQLAlchemy's)
            raise ChainConflictError(f"log {origin}: concurrent append at seq {expected_size}") from exc

    def _insert_records(self, conn: Connection, records: Sequence[Record]) -> None:
        # The driver's bulk paths, not the ORM: this is the hot path of every write
        # (PostgreSQL COPY, SQLite executemany), ~3x faster than per-row parameter dicts.
        rows = [_row(r) for r in records]
        if self.dialect == "postgresql":
            cursor = conn.connection.dbapi_connection.cursor()
            with cursor.copy(f"COPY records ({', '.join(_COLUMNS)}) FROM STDIN") as copy:
                for row in rows:
                    copy.write_row(row)
        elif self.dialect == "sqlite":
            conn.exec_driver_sql(
                f"INSERT INTO records ({', '.join(_COLUMNS)}) VALUES ({', '.join('?' * len(_COLUMNS))})", rows
            )
        else:
            conn.execute(insert(RecordRow), [dict(zip(_COLUMNS, row)) for row in rows])

    def iter_bodies(self, origin: str, start: int = 0, end: int | None = None, batch: int = 5000
                    ) -> Iterator[tuple[int, str, str, bytes]]:
        """(seq, body, sig, leaf_hash) in seq order, streamed (server-side cursor on PostgreSQL)."""
        query = select(RecordRow.seq, RecordRow.body, RecordRow.sig, RecordRow.leaf_hash).where(
            RecordRow.origin == origin, RecordRow.seq >= start
        )
        if end is not None:
            query = query.where(RecordRow.seq < end)
        with self.read() as conn:
            result = conn.execution_options(yield_per=batch).execute(query.order_by(RecordRow.seq))
            for row in result:
                yield row[0], row[1], row[2], bytes(row[3])

    def iter_rows(self, origin: str, start: int = 0, batch: int = 5000, end: int | None = None) -> Iterator:
        """Whole rows, for verification of the query columns against each body."""
        query = select(RecordRow).where(RecordRow.origin == origin, RecordRow.seq >= start)
        if end is not None:
            query = query.where(RecordRow.seq < end)
        with self.read() as conn:
            result = conn.execution_options(yield_per=batch).execute(query.order_by(RecordRow.seq))
            yield from result

    def record(self, origin: str, seq: int) -> Record:
        with self.read() as conn:
            body = conn.scalar(select(RecordRow.body).where(RecordRow.origin == origin, RecordRow.seq == seq))
        if body is None:
            raise StoreError(f"no record {origin}#{seq}")
        return Record.from_leaf_bytes(body.encode("utf-8"))

    def leaf_hashes(self, origin: str, start: int, end: int) -> list[bytes]:
        with self.read() as conn:
            return [bytes(h) for h in conn.scalars(
                select(RecordRow.leaf_hash)
                .where(RecordRow.origin == origin, RecordRow.seq >= start, RecordRow.seq < end)
                .order_by(RecordRow.seq)
            )]

    def iter_leaves(self, origin: str, start: int = 0, end: int | None = None,
                    batch: int = 20000) -> Iterator[tuple[int, bytes]]:
        """(seq, leaf hash) in seq order, streamed: what rebuilding a tree needs."""
        query = select(RecordRow.seq, RecordRow.leaf_hash).where(
            RecordRow.origin == origin, RecordRow.seq >= start)
        if end is not None:
            query = query.where(RecordRow.seq < end)
        with self.read() as conn:
            for seq, leaf in conn.execution_options(yield_per=batch).execute(query.order_by(RecordRow.seq)):
                yield seq, bytes(leaf)

    def seq_range(self, origin: str, since_ms: int | None, until_ms: int | None) -> tuple[int, int] | None:
        """First and last seq of the records with since <= time < until (None: nothing)."""
        query = select(func.min(RecordRow.seq), func.max(RecordRow.seq)).where(RecordRow.origin == origin)
        if since_ms is not None:
            query = query.where(RecordRow.time_ms >= since_ms)
        if until_ms is not None:
            query = query.where(RecordRow.time_ms < until_ms)
        with self.read() as conn:
            first, last = conn.execute(query).one()
        return None if first is None else (first, last)

    # -- checkpoints ---------------------------------------------------------------

    def add_checkpoint(self, cp: CheckpointEntry) -> None:
        """Idempotent: two writers may checkpoint the same size (with the same root)."""
        with suppress(IntegrityError), self.write() as conn:
            conn.execute(insert(CheckpointRow).values(_checkpoint_row(cp)))

    def checkpoints(self, origin: str, min_size: int = 0,
                    max_size: int | None = None) -> list[CheckpointEntry]:
        query = select(CheckpointRow).where(
            CheckpointRow.origin == origin, CheckpointRow.tree_size >= min_size)
        if max_size is not None:
            query = query.where(CheckpointRow.tree_size <= max_size)
        with self.read() as conn:
            rows = conn.execute(query.order_by(CheckpointRow.tree_size)).all()
        return [_entry(r) for r in rows]

    def latest_checkpoint(self, origin: str) -> CheckpointEntry | None:
        with self.read() as conn:
            r = conn.execute(
                select(CheckpointRow).where(CheckpointRow.origin == origin)
                .order_by(CheckpointRow.tree_size.desc()).limit(1)
            ).first()
        return None if r is None else _entry(r)

    def checkpoint_covering(self, origin: str, seq: int) -> CheckpointEntry | None:
        """The smallest checkpoint whose tree includes record `seq`."""
        with self.read() as conn:
            r = conn.execute(
                select(CheckpointRow).where(CheckpointRow.origin == origin, CheckpointRow.tree_size > seq)
                .order_by(CheckpointRow.tree_size).limit(1)
            ).first()
        return None if r is None else _entry(r)

    # -- subject secrets (audit.pseudonym) ------------------------------------------

    def subject_secret(self, idx: bytes, kind: str, candidate: tuple[str | None, bytes],
                       now_ms: int) -> tuple[str | None, bytes]:
        """(kek id, stored secret) under `idx`, inserting `candidate` = (kek id, wrapped
        secret) if there is none yet. The kek id is None for a secret stored in the clear."""
        query = select(SubjectKey.kek_id, SubjectKey.secret).where(SubjectKey.idx == idx)
        for _ in range(3):
            with self.write() as conn:
                found = conn.execute(query).first()
                if found is not None:
                    return found[0], bytes(found[1])
                kek_id, blob = candidate
                if self.checked_inserts(conn):  # through the owner's function
                    if conn.scalar(text("SELECT kvguard_add_subject_key(CAST(:i AS bytea), CAST(:k AS text), "
                                        "CAST(:s AS bytea), CAST(:kek AS text), CAST(:t AS bigint))"),
                                   {"i": idx, "k": kind, "s": blob, "kek": kek_id, "t": now_ms}):
                        return kek_id, blob
                    continue  # another writer created it first; read theirs
                try:
                    with conn.begin_nested():
                        conn.execute(insert(SubjectKey).values(idx=idx, kind=kind, secret=blob, kek_id=kek_id,
                                                               created_ms=now_ms))
                    return kek_id, blob
                except IntegrityError:  # another writer created it first; read theirs
                    continue
        raise StoreError("could not create a subject secret")

    def find_subject_secret(self, idx: bytes) -> tuple[str | None, bytes] | None:
        """(kek id, stored secret) under `idx`, or None."""
        with self.read() as conn:
            found = conn.execute(select(SubjectKey.kek_id, SubjectKey.secret).where(SubjectKey.idx == idx)).first()
        return None if found is None else (found[0], bytes(found[1]))

    # -- key-encryption keys (audit.keyring) -----------------------------------------

    def current_kek(self) -> str | None:
        row = self._current_kek()
        return None if row is None else row[0]

    def current_kek_created_ms(self) -> int | None:
        row = self._current_kek()
        return None if row is None else row[1]

    def _current_kek(self):
        with self.read() as conn:
            return conn.execute(select(Kek.id, Kek.created_ms).where(Kek.destroyed_ms.is_(None))
                                .order_by(Kek.created_ms.desc(), Kek.id).limit(1)).first()

    def add_kek(self, kek_id: str, now_ms: int) -> None:
        with self.write() as conn:
            conn.execute(insert(Kek).values(id=kek_id, created_ms=now_ms))

    def destroy_keks_except(self, kek_id: str, now_ms: int) -> None:
        with self.write() as conn:
            conn.execute(update(Kek).where(Kek.id != kek_id, Kek.destroyed_ms.is_(None)).values(destroyed_ms=now_ms))

    def subject_rows_not_under(self, kek_id: str, after: bytes, limit: int) -> list[tuple[bytes, str | None, bytes]]:
        """(idx, kek id, stored secret) of up to `limit` secrets not wrapped under `kek_id`
        whose idx sorts after `after` (b"" for the first), in idx order."""
        query = (select(SubjectKey.idx, SubjectKey.kek_id, SubjectKey.secret)
                 .where((SubjectKey.kek_id != kek_id) | SubjectKey.kek_id.is_(None), SubjectKey.idx > after)
                 .order_by(SubjectKey.idx).limit(limit))
        with self.read() as conn:
            return [(bytes(i), k, bytes(b)) for i, k, b in conn.execute(query)]

    def rewrap_subject_secrets(self, rows: Sequence[tuple[bytes, str | None, str, bytes]]) -> int:
        """For each (idx, old kek, new kek, blob), replace the secret under `idx` if it is still
        wrapped under the old KEK (a shred or another rotation meanwhile wins); one transaction.
        Returns how many were replaced."""
        if not rows:
            return 0
        stmt = (update(SubjectKey)
                .where(SubjectKey.idx == bindparam("b_idx"), SubjectKey.kek_id.is_not_distinct_from(bindparam("b_old")))
                .values(kek_id=bindparam("b_new"), secret=bindparam("b_blob")))
        with self.write() as conn:  # one executemany: ~5x fewer round trips than a statement a row
            result = conn.execute(stmt, [{"b_idx": i, "b_old": o, "b_new": n, "b_blob": b} for i, o, n, b in rows])
        return result.rowcount if self.engine.dialect.supports_sane_multi_rowcount else len(rows)

    @contextmanager
    def kek_rotation_lock(self) -> Iterator[bool]:
        """Yields whether this caller may rotate: on PostgreSQL, whether it took the
        database-wide advisory lock that lets one sidecar of a database rotate at a time; on
        SQLite (one sidecar per database, serve.lock) always."""
        if self.dialect != "postgresql":
            yield True
            return
        with self.engine.connect() as conn:
            got = bool(conn.execute(text("SELECT pg_try_advisory_lock(:k)"), {"k": _KEK_LOCK}).scalar())
            conn.commit()
            try:
                yield got
            finally:
                if got:
                    conn.execute(text("SELECT pg_advisory_unlock(:k)"), {"k": _KEK_LOCK})
                    conn.commit()

    def delete_subject_secret(self, idx: bytes, *, truncate_wal: bool = True) -> bool:
        """Delete the secret under `idx`; True if there was one. On SQLite the WAL is then
        truncated (`truncate_wal`), also when nothing was deleted, so that calling again
        finishes a shred whose truncation a reader blocked."""
        return self.shred_subject_secret(idx, truncate_wal=truncate_wal) is not None

    def shred_subject_secret(self, idx: bytes, *, truncate_wal: bool = True) -> str | None:
        """Delete the secret under `idx` as `delete_subject_secret` does; returns the shred
        tag of the row deleted (audit.pseudonym.shred_tag), None if there was none. An erase
        record carries the tags, so `kvguard audit check` finds a destroyed secret put back."""
        with self.write() as conn:
            stored = conn.scalar(delete(SubjectKey).where(SubjectKey.idx == idx).returning(SubjectKey.secret))
        if truncate_wal:
            self.truncate_wal()
        return None if stored is None else shred_tag(bytes(stored))

    def delete_subject_secret_if(self, idx: bytes, stored: bytes) -> bool:
        """Delete the secret under `idx` if it still holds the bytes `stored` (a destroyed
        secret put back, found on use: audit.pseudonym); True if it did."""
        with self.write() as conn:
            gone = conn.execute(delete(SubjectKey).where(SubjectKey.idx == idx, SubjectKey.secret == stored)).rowcount
        self.truncate_wal()
        return bool(gone)

    def bodies_of(self, origin: str, op: str) -> list[str]:
        """Bodies of the log's records of one op, in seq order, unverified (index ix_records_origin_op)."""
        with self.read() as conn:
            return list(conn.scalars(select(RecordRow.body).where(RecordRow.origin == origin, RecordRow.op == op)
                                     .order_by(RecordRow.seq)))

    def other_erase_bodies(self, origin: str) -> list[tuple[str, int, str]]:
        """(origin, seq, body) of the erase records of every log but `origin`, unverified:
        where the shred tags of the other logs are read from (index ix_records_erase)."""
        with self.read() as conn:
            return [tuple(r) for r in conn.execute(select(RecordRow.origin, RecordRow.seq, RecordRow.body).where(
                RecordRow.op.in_(sorted(ERASE_OPS)), RecordRow.origin != origin))]

    def iter_subject_secrets(self, batch: int = 5000) -> Iterator[bytes]:
        """Every stored subject secret (as stored), streamed: the erasure-consistency check."""
        with self.read() as conn:
            yield from (bytes(s) for s in conn.execution_options(yield_per=batch).scalars(
                select(SubjectKey.secret)))

    def truncate_wal(self) -> None:
        """SQLite: checkpoint the WAL and truncate it to zero bytes, so no frame keeps the
        image of a page as it was before a shred (secure_delete overwrites the page itself).
        Raises StoreError while a reader still uses the WAL after the busy timeout: the
        shred is then not complete on disk, and calling again completes it. No-op elsewhere."""
        if self.dialect != "sqlite":
            return
        raw = self.engine.raw_connection()
        try:
            cur = raw.cursor()
            try:
                # one row (busy, frames in the log, frames checkpointed); busy = 1 is no error
                row = cur.execute("PRAGMA wal_checkpoint(TRUNCATE)").fetchone()
            except self.engine.dialect.loaded_dbapi.OperationalError as exc:
                raise StoreError(f"could not truncate the SQLite WAL: {exc}") from None
            finally:
                cur.close()
        finally:
            raw.close()
        if row is None or row[0] != 0:
            raise StoreError("a reader kept the SQLite WAL busy, so it still holds the page images from "
                             "before the delete; shred again once readers are done to truncate it")

_KEK_LOCK = 0x6B76_6B65_6B00  # "kvkek": the advisory lock of KEK rotation


def _checkpoint_row(cp: CheckpointEntry) -> dict:
    return {"origin": cp.origin, "tree_size": cp.size, "root_hash": cp.root, "time_ms": cp.time_ms,
            "key_id": cp.key_id, "note": cp.note}


def _entry(r) -> CheckpointEntry:
    return CheckpointEntry(r.origin, r.tree_size, bytes(r.root_hash), r.time_ms, r.key_id, r.note)


_COLUMNS = (
    "origin", "seq", "time_ms", "op", "tenant_pseudonym", "user_pseudonym", "session_pseudonym",
    "key_id", "prev", "leaf_hash", "sig", "body",
)


def stored_columns(row) -> tuple:
    """A records row as the tuple `_row` makes of the record its body holds."""
    return (row.origin, row.seq, row.time_ms, row.op, row.tenant_pseudonym, row.user_pseudonym,
            row.session_pseudonym, row.key_id, row.prev, bytes(row.leaf_hash), row.sig, row.body)


def _row(r: Record) -> tuple:
    subject = r.subject
    return (
        r.origin, r.seq, parse_time(r.time), r.op, subject.get("tenant"), subject.get("user"),
        subject.get("session"), r.key_id, r.prev, r.leaf_hash, r.sig, r.leaf_bytes.decode("utf-8"),
    )


__all__ = [
    "AuditStore", "CheckpointEntry", "KeyEntry", "alembic_config", "check_current", "downgrade",
    "make_engine", "migrate",
]
