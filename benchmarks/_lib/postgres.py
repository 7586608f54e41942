"""A scratch PostgreSQL database for a benchmark's run: created on the server the admin URL
names, dropped afterwards (connections and all). Imports SQLAlchemy when used."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from contextlib import contextmanager

PG_ADMIN = "postgresql+psycopg://postgres@127.0.0.1:5432/test"  # the test server of `make test`


@contextmanager
def scratch_database(prefix: str = "kvguard_bench", admin_url: str = PG_ADMIN) -> Iterator[str]:
    """The URL of a fresh database named prefix_<8 hex digits>, dropped on the way out."""
    from sqlalchemy import create_engine, text

    name = f"{prefix}_{uuid.uuid4().hex[:8]}"
    admin = create_engine(admin_url, isolation_level="AUTOCOMMIT")
    with admin.connect() as c:
        c.execute(text(f"CREATE DATABASE {name}"))
    try:
        yield admin_url.rsplit("/", 1)[0] + "/" + name
    finally:
        with admin.connect() as c:
            c.execute(text(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)"))
        admin.dispose()
