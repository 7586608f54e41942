"""Alembic environment of the audit store.

The URL is, in order: a connection handed over by audit.store.migrate
(config.attributes["connection"]), config.attributes["url"], the
KVGUARD_DATABASE_URL environment variable, then alembic.ini's sqlalchemy.url.
Engines come from audit.store.make_engine so SQLite gets WAL and synchronous=FULL
here too.
"""

from __future__ import annotations

import os

from alembic import context
from kvguard.audit.engine import make_engine
from kvguard.audit.models import Base

config = context.config
target_metadata = Base.metadata


def _url() -> str:
    return (
        config.attributes.get("url")
        or os.environ.get("KVGUARD_DATABASE_URL")
        or config.get_main_option("sqlalchemy.url")
    )


def run_offline() -> None:
    context.configure(url=_url(), target_metadata=target_metadata, literal_binds=True)
    with context.begin_transaction():
        context.run_migrations()


def run_online() -> None:
    connection = config.attributes.get("connection")
    if connection is not None:
        context.configure(connection=connection, target_metadata=target_metadata)
        with context.begin_transaction():
            context.run_migrations()
        return
    engine = make_engine(_url())
    try:
        with engine.connect() as conn:
            context.configure(connection=conn, target_metadata=target_metadata)
            with context.begin_transaction():
                context.run_migrations()
    finally:
        engine.dispose()


if context.is_offline_mode():
    run_offline()
else:
    run_online()
