"""Fixtures for the audit tests, reusable by other test packages.

* `sqlite_url`: a migrated SQLite file under tmp_path (copied from one migrated template).
* `pg_url`: a PostgreSQL database created for this test session (kvguard_test_<random>)
  and dropped at the end, so parallel runs and other modules using `test` never collide.
* `fresh_pg_url`: an empty PostgreSQL database of its own (migration tests).
* `db_url`: parametrized over both. Tests use a unique origin (`origin` fixture).

Other test packages reuse them by importing the fixtures, e.g.
`from tests.audit.conftest import db_url, pg_url, sqlite_url, _sqlite_template`, and the
shared functions from tests.audit.audit_testlib.
"""

from __future__ import annotations

import shutil
import uuid
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
from kvguard.audit.keys import SigningKey
from kvguard.audit.log import AuditLog
from kvguard.audit.store import AuditStore, migrate
from sqlalchemy import create_engine, text

from .audit_testlib import BACKENDS, open_log

PG_ADMIN_URL = "postgresql+psycopg://postgres@127.0.0.1:5432/test"


def pg_admin(sql: str) -> None:
    """Run one statement outside a transaction (CREATE/DROP DATABASE) on the shared server."""
    engine = create_engine(PG_ADMIN_URL, isolation_level="AUTOCOMMIT")
    try:
        with engine.connect() as conn:
            conn.execute(text(sql))
    finally:
        engine.dispose()


@contextmanager
def scratch_pg_database(migrated: bool) -> Iterator[str]:
    """A uniquely named PostgreSQL database, dropped (with its connections) on exit."""
    name = f"kvguard_test_{uuid.uuid4().hex[:12]}"
    pg_admin(f"CREATE DATABASE {name}")
    url = PG_ADMIN_URL.rsplit("/", 1)[0] + f"/{name}"
    try:
        if migrated:
            migrate(url)
        yield url
    finally:
        pg_admin(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")


@pytest.fixture(scope="session")
def pg_url() -> Iterator[str]:
    with scratch_pg_database(migrated=True) as url:
        yield url


@pytest.fixture
def fresh_pg_url() -> Iterator[str]:
    with scratch_pg_database(migrated=False) as url:
        yield url


@pytest.fixture(scope="session")
def _sqlite_template(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("template") / "audit.db"
    migrate(f"sqlite:///{path}")
    return str(path)


@pytest.fixture
def sqlite_url(tmp_path, _sqlite_template) -> str:
    path = tmp_path / "audit.db"
    shutil.copyfile(_sqlite_template, path)  # WAL was checkpointed when the template closed
    return f"sqlite:///{path}"


@pytest.fixture(params=BACKENDS)
def db_url(request) -> str:
    return request.getfixturevalue("sqlite_url" if request.param == "sqlite" else "pg_url")


@pytest.fixture
def origin() -> str:
    return f"test.kvguard.example/{uuid.uuid4().hex[:12]}"


@pytest.fixture
def signing_key() -> SigningKey:
    return SigningKey.generate()


@pytest.fixture
def store(db_url) -> Iterator[AuditStore]:
    s = AuditStore(db_url)
    yield s
    s.dispose()


@pytest.fixture
def audit_log(store, origin, signing_key) -> Iterator[AuditLog]:
    log = open_log(store, origin, signing_key)
    yield log
    log.close()
