"""SQLAlchemy models of the audit store (schema owned by the Alembic migrations in migrations/).

logs, keys, records and checkpoints are append-only (database triggers refuse
UPDATE and DELETE); subject_keys is not: deleting a row is how a subject is
crypto-shredded (audit.pseudonym), and rotating the key-encryption key rewrites it.
"""

from __future__ import annotations

from sqlalchemy import BigInteger, ForeignKey, Index, LargeBinary, String, Text, text
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column


class Base(DeclarativeBase):
    """Metadata of the audit tables (Alembic's target for autogenerate)."""


class Log(Base):
    """One log per origin; writers lock this row to append (PostgreSQL: SELECT ... FOR UPDATE)."""

    __tablename__ = "logs"
    origin: Mapped[str] = mapped_column(String(255), primary_key=True)
    created_ms: Mapped[int] = mapped_column(BigInteger)


class LogKey(Base):
    """Public keys of a log: the first from seq 0, each later one from the record after
    the key_rotation record that introduced it."""

    __tablename__ = "keys"
    origin: Mapped[str] = mapped_column(ForeignKey("logs.origin"), primary_key=True)
    key_id: Mapped[str] = mapped_column(String(64), primary_key=True)
    public_key: Mapped[bytes] = mapped_column(LargeBinary(32))
    valid_from_seq: Mapped[int] = mapped_column(BigInteger)
    rotation_seq: Mapped[int | None] = mapped_column(BigInteger)
    created_ms: Mapped[int] = mapped_column(BigInteger)


class RecordRow(Base):
    """A signed record. `body` holds its leaf bytes (canonical JSON with sig), the source
    of truth; the other columns copy fields out of it for queries and are checked
    against it on verification."""

    __tablename__ = "records"
    origin: Mapped[str] = mapped_column(ForeignKey("logs.origin"), primary_key=True)
    seq: Mapped[int] = mapped_column(BigInteger, primary_key=True)
    time_ms: Mapped[int] = mapped_column(BigInteger)
    op: Mapped[str] = mapped_column(String(32))
    tenant_pseudonym: Mapped[str | None] = mapped_column(String(32))
    user_pseudonym: Mapped[str | None] = mapped_column(String(32))
    session_pseudonym: Mapped[str | None] = mapped_column(String(32))
    key_id: Mapped[str] = mapped_column(String(64))
    prev: Mapped[str] = mapped_column(String(64))
    leaf_hash: Mapped[bytes] = mapped_column(LargeBinary(32))
    sig: Mapped[str] = mapped_column(String(88))
    body: Mapped[str] = mapped_column(Text)

    __table_args__ = (
        Index("ix_records_origin_time", "origin", "time_ms"),
        Index("ix_records_origin_op", "origin", "op"),
        Index("ix_records_tenant", "tenant_pseudonym"),
        Index("ix_records_user", "user_pseudonym"),
        Index("ix_records_session", "session_pseudonym"),
        # the erase records alone, whose shred tags the writer and kvguard_shredded() read
        Index("ix_records_erase", "origin", "seq", postgresql_where=text("op IN ('erase', 'retention_erase')"),
              sqlite_where=text("op IN ('erase', 'retention_erase')")),
    )


class CheckpointRow(Base):
    """A signed checkpoint (C2SP signed note) of a log at one tree size."""

    __tablename__ = "checkpoints"
    origin: Mapped[str] = mapped_column(ForeignKey("logs.origin"), primary_key=True)
    tree_size: Mapped[int] = mapped_column(BigInteger, primary_key=True)
    root_hash: Mapped[bytes] = mapped_column(LargeBinary(32))
    time_ms: Mapped[int] = mapped_column(BigInteger)
    key_id: Mapped[str] = mapped_column(String(64))
    note: Mapped[str] = mapped_column(Text)


class SubjectKey(Base):
    """Per-subject pseudonym secret, found by `idx` = HMAC(index key, kind || 0x00 || raw id).
    Deleting the row shreds the subject: its pseudonyms can no longer be recomputed."""

    __tablename__ = "subject_keys"
    idx: Mapped[bytes] = mapped_column(LargeBinary(32), primary_key=True)
    kind: Mapped[str] = mapped_column(String(16))
    # AES-GCM of the secret under the key-encryption key `kek_id` (audit.keyring); NULL: a
    # secret stored before wrapping, in the clear until the sidecar's next start wraps it
    secret: Mapped[bytes] = mapped_column(LargeBinary)
    created_ms: Mapped[int] = mapped_column(BigInteger)
    kek_id: Mapped[str | None] = mapped_column(String(32), nullable=True)


class Kek(Base):
    """A key-encryption key of subject_keys. The key itself is a file outside the database
    (audit.keyring); the row says which is current (the newest not destroyed) and when the
    previous one was destroyed. Mutable: rotation marks the old one destroyed."""

    __tablename__ = "keks"
    id: Mapped[str] = mapped_column(String(32), primary_key=True)
    created_ms: Mapped[int] = mapped_column(BigInteger)
    destroyed_ms: Mapped[int | None] = mapped_column(BigInteger, nullable=True)


class CosignatureRow(Base):
    """A witness's cosignature (C2SP tlog-cosignature line) on a checkpoint; the newest per
    witness and checkpoint. Not append-only: the witness's key, not the database, makes one
    trustworthy, so a deleted or edited row can only make verification fail."""

    __tablename__ = "cosignatures"
    origin: Mapped[str] = mapped_column(ForeignKey("logs.origin"), primary_key=True)
    tree_size: Mapped[int] = mapped_column(BigInteger, primary_key=True)
    witness: Mapped[str] = mapped_column(String(255), primary_key=True)  # its name
    key_id: Mapped[str] = mapped_column(String(8), primary_key=True)  # hex of the 4-byte key id
    time_s: Mapped[int] = mapped_column(BigInteger)
    line: Mapped[str] = mapped_column(Text)
