"""The sidecar's own tables: admin API tokens, erasure requests and each sidecar's part of
them, the fleet of sidecars sharing the database.

Neither holds a raw subject id: a pending request keeps its ids sealed
(AES-GCM under a key in the data directory) until it completes, and then the
sealed blob is wiped; queries go by pseudonym.
"""

from __future__ import annotations

from sqlalchemy import BigInteger, Boolean, Integer, LargeBinary, String, Text
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column


class Base(DeclarativeBase):
    pass


class ApiToken(Base):
    __tablename__ = "api_tokens"

    id: Mapped[str] = mapped_column(String(32), primary_key=True)
    name: Mapped[str] = mapped_column(String(100))
    token_sha256: Mapped[str] = mapped_column(String(64), unique=True)
    scopes: Mapped[str] = mapped_column(String(200))  # space separated
    # an ingest token bound to tenants: their indexes (hex HMAC under the index key, never the
    # raw ids), space separated; None: every tenant
    tenants: Mapped[str | None] = mapped_column(Text, nullable=True)
    created_ms: Mapped[int] = mapped_column(BigInteger)
    expires_ms: Mapped[int | None] = mapped_column(BigInteger, nullable=True)  # None: never
    revoked: Mapped[bool] = mapped_column(Boolean, default=False)


class ErasureRequest(Base):
    __tablename__ = "erasure_requests"

    id: Mapped[str] = mapped_column(String(36), primary_key=True)
    origin: Mapped[str] = mapped_column(String(255), index=True)
    idempotency_sha256: Mapped[str] = mapped_column(String(64), unique=True)
    # HMAC-SHA256 under the index key of the canonical body: a reused key with another body
    # is refused, and a guess of the ids cannot be checked against it without the key
    body_hmac: Mapped[str | None] = mapped_column(String(64), nullable=True)
    scope: Mapped[str] = mapped_column(String(16))  # user | session | retention
    legal_basis: Mapped[str] = mapped_column(String(32))
    # HMAC-SHA256 of the reason under the subject's pseudonym secret (audit.pseudonym), which
    # the erasure shreds: afterwards no one can confirm a guessed reason against it
    reason_hmac: Mapped[str | None] = mapped_column(String(64), nullable=True)
    tenant_pseudonym: Mapped[str] = mapped_column(String(64))
    subject_pseudonym: Mapped[str] = mapped_column(String(64), index=True)
    sealed_subject: Mapped[bytes | None] = mapped_column(LargeBinary, nullable=True)
    state: Mapped[str] = mapped_column(String(16), index=True)  # received | executing | completed | failed
    received_ms: Mapped[int] = mapped_column(BigInteger)
    deadline_ms: Mapped[int] = mapped_column(BigInteger)
    completed_ms: Mapped[int | None] = mapped_column(BigInteger, nullable=True)
    attempts: Mapped[int] = mapped_column(Integer, default=0)
    result_json: Mapped[str | None] = mapped_column(Text, nullable=True)
    receipt_json: Mapped[str | None] = mapped_column(Text, nullable=True)
    record_seq: Mapped[int | None] = mapped_column(BigInteger, nullable=True)
    error: Mapped[str | None] = mapped_column(Text, nullable=True)
    # crypto-shredding, once for the fleet: how many secrets it destroyed, and when
    secrets_destroyed: Mapped[int | None] = mapped_column(Integer, nullable=True)
    shredded_ms: Mapped[int | None] = mapped_column(BigInteger, nullable=True)
    shredded_tags: Mapped[str | None] = mapped_column(Text, nullable=True)  # JSON: audit.pseudonym.shred_tag of each


class ErasurePart(Base):
    """One sidecar's (origin's) part of an erasure request: its inference processes erase
    (pending → erased), then, once the fleet's shredding is done, it signs its own erase
    record (→ done). An operator may exclude a part whose processes have not erased, with a
    reason every record of the request states."""

    __tablename__ = "erasure_parts"

    request_id: Mapped[str] = mapped_column(String(36), primary_key=True)  # an erasure_requests.id
    origin: Mapped[str] = mapped_column(String(255), primary_key=True)
    state: Mapped[str] = mapped_column(String(16), index=True)  # pending | erased | done | excluded | failed
    attempts: Mapped[int] = mapped_column(Integer, default=0)
    processes_json: Mapped[str | None] = mapped_column(Text, nullable=True)  # what each process acknowledged
    record_seq: Mapped[int | None] = mapped_column(BigInteger, nullable=True)
    receipt_json: Mapped[str | None] = mapped_column(Text, nullable=True)
    error: Mapped[str | None] = mapped_column(Text, nullable=True)
    excluded_reason: Mapped[str | None] = mapped_column(Text, nullable=True)
    created_ms: Mapped[int] = mapped_column(BigInteger)
    updated_ms: Mapped[int] = mapped_column(BigInteger)


class FleetSidecar(Base):
    """A sidecar of the database: registered at its start, heartbeating while it runs, marked
    as left when it stops cleanly. Every sidecar that has not left gets a part of each new
    erasure request, so one that is down is named as pending, never skipped."""

    __tablename__ = "fleet_sidecars"

    origin: Mapped[str] = mapped_column(String(255), primary_key=True)
    instance: Mapped[str] = mapped_column(String(32))  # drawn at each start
    key_id: Mapped[str] = mapped_column(String(64))  # its signing key's id when it started
    started_ms: Mapped[int] = mapped_column(BigInteger)
    heartbeat_ms: Mapped[int] = mapped_column(BigInteger)
    left_ms: Mapped[int | None] = mapped_column(BigInteger, nullable=True)


class SubjectLink(Base):
    """Which sessions belong to which user, by their pseudonym index (an HMAC under the
    index key, never a raw id), so that erasing a user shreds their sessions too."""

    __tablename__ = "subject_links"

    user_idx: Mapped[bytes] = mapped_column(LargeBinary(32), primary_key=True)
    session_idx: Mapped[bytes] = mapped_column(LargeBinary(32), primary_key=True)


class IngestProgress(Base):
    """How far each inference process start's events are recorded, so that events resent
    after a sidecar restart are recorded once. `log_size` is the log's size just after the
    client's last batch known to be stored: any record of the client at or after it belongs
    to a batch whose outcome this row does not know yet (ingest.py reads them back)."""

    __tablename__ = "ingest_progress"

    origin: Mapped[str] = mapped_column(String(255), primary_key=True)
    client: Mapped[str] = mapped_column(String(100), primary_key=True)  # name/instance
    last_event: Mapped[int] = mapped_column(BigInteger)
    log_size: Mapped[int] = mapped_column(BigInteger)
    updated_ms: Mapped[int] = mapped_column(BigInteger)
