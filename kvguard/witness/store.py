"""The witness's state: the latest cosigned checkpoint of each origin, one row per origin.

Its own schema (one table, created on first start) in a SQLite file or any database
SQLAlchemy reaches. The check of the submitted old size against the stored one and
the update are one atomic step: a conditional UPDATE (or the INSERT of an origin's
first row), so two concurrent requests can never roll the state back.
"""

from __future__ import annotations

from dataclasses import dataclass

from sqlalchemy import BigInteger, Column, LargeBinary, MetaData, String, Table, Text, insert, select, update
from sqlalchemy.engine import Engine
from sqlalchemy.exc import IntegrityError

from kvguard.audit.engine import make_engine
from kvguard.audit.merkle import EMPTY_ROOT

metadata = MetaData()
witnessed = Table(
    "witness_checkpoints", metadata,
    Column("origin", String(255), primary_key=True),
    Column("tree_size", BigInteger, nullable=False),
    Column("root_hash", LargeBinary(32), nullable=False),
    Column("note", Text, nullable=False),  # the log-signed checkpoint, as evidence
    Column("updated_ms", BigInteger, nullable=False),
)


@dataclass(frozen=True, slots=True)
class Latest:
    size: int
    root: bytes


class WitnessStore:
    def __init__(self, url_or_engine: str | Engine) -> None:
        self.engine = make_engine(url_or_engine) if isinstance(url_or_engine, str) else url_or_engine
        metadata.create_all(self.engine)

    def latest(self, origin: str) -> Latest:
        """The latest cosigned size and root (size 0 and the empty root before the first)."""
        with self.engine.connect() as conn:
            row = conn.execute(select(witnessed.c.tree_size, witnessed.c.root_hash)
                               .where(witnessed.c.origin == origin)).first()
        return Latest(0, EMPTY_ROOT) if row is None else Latest(row[0], bytes(row[1]))

    def advance(self, origin: str, old: Latest, size: int, root: bytes, note: str, now_ms: int) -> bool:
        """Move the origin from `old` (as read and checked) to (size, root); False if another
        request moved it meanwhile."""
        values = {"tree_size": size, "root_hash": root, "note": note, "updated_ms": now_ms}
        with self.engine.begin() as conn:
            done = conn.execute(update(witnessed).where(
                witnessed.c.origin == origin, witnessed.c.tree_size == old.size,
                witnessed.c.root_hash == old.root).values(values)).rowcount
            if done or old.size:
                return bool(done)
        try:  # the origin's first checkpoint
            with self.engine.begin() as conn:
                conn.execute(insert(witnessed).values(origin=origin, **values))
        except IntegrityError:
            return False
        return True

    def dispose(self) -> None:
        self.engine.dispose()
