"""Database engines and schema migrations of the audit store.

SQLite (the embedded default) runs in WAL mode with synchronous=FULL, so a
committed batch survives power loss, not just a crash of the process; writes
begin with BEGIN IMMEDIATE so a writer holds the lock from its first read of the
tail; recursive_triggers is on, so the append-only triggers also refuse the
delete inside INSERT OR REPLACE. Migrations are the Alembic scripts in
migrations/ (alembic.ini at the repo root runs the same scripts from the
command line).
"""

from __future__ import annotations

import functools
from pathlib import Path

from alembic import command
from alembic.config import Config
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory
from sqlalchemy import Engine, create_engine, event
from sqlalchemy.exc import OperationalError

from .errors import StoreError

MIGRATIONS = Path(__file__).resolve().parent.parent / "migrations"
READ_ONLY = "kvguard_read"  # execution option: a SQLite read takes no write lock


def make_engine(url: str, **kwargs) -> Engine:
    # hide_parameters: a logged database error must not carry bound values, e.g. the pseudonym
    # secret of a failed subject_keys insert
    engine = create_engine(url, hide_parameters=True, **kwargs)
    if engine.dialect.name == "sqlite":
        @event.listens_for(engine, "connect")
        def _sqlite_connect(dbapi_conn, _record):
            dbapi_conn.isolation_level = None  # we issue BEGIN ourselves (below)
            cur = dbapi_conn.cursor()
            cur.execute("PRAGMA journal_mode=WAL")
            cur.execute("PRAGMA synchronous=FULL")  # fsync the WAL on every commit
            cur.execute("PRAGMA foreign_keys=ON")
            cur.execute("PRAGMA busy_timeout=30000")
            cur.execute("PRAGMA secure_delete=ON")  # a shredded secret is overwritten, not unlinked
            # INSERT OR REPLACE deletes the row it replaces; only with this does that delete fire
            # the append-only DELETE triggers (migrations/versions/0002_append_only.py)
            cur.execute("PRAGMA recursive_triggers=ON")
            cur.close()

        @event.listens_for(engine, "begin")
        def _sqlite_begin(conn):
            read_only = conn.get_execution_options().get(READ_ONLY)
            conn.exec_driver_sql("BEGIN" if read_only else "BEGIN IMMEDIATE")
    return engine


def alembic_config(url: str | None = None) -> Config:
    cfg = Config()
    cfg.set_main_option("script_location", str(MIGRATIONS))
    if url:
        cfg.attributes["url"] = url
    return cfg


def migrate(url: str, revision: str = "head") -> None:
    """Upgrade the audit schema to `revision` (head by default)."""
    command.upgrade(alembic_config(url), revision)


def downgrade(url: str, revision: str = "base") -> None:
    command.downgrade(alembic_config(url), revision)


@functools.cache
def newest_migration() -> str:
    """The head of the migrations this install ships (read once: they do not change in a process)."""
    return ScriptDirectory.from_config(alembic_config()).get_current_head()


def check_current(url: str | Engine) -> None:
    """Readiness: raises StoreError unless the database is at the newest migration. Given an
    Engine (a running sidecar's, on every probe), it uses that engine's pool."""
    head = newest_migration()
    engine = url if isinstance(url, Engine) else make_engine(url)
    try:
        with engine.connect() as conn:
            current = MigrationContext.configure(conn).get_current_revision()
    except OperationalError as exc:
        raise StoreError(f"audit store unreachable: {exc.orig}") from None
    finally:
        if engine is not url:
            engine.dispose()
    if current != head:
        raise StoreError(f"audit store is at schema {current!r}, expected {head!r}: run `kvguard db upgrade` (kvguard.audit.store.migrate)")
