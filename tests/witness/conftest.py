"""Fixtures of the witness tests: the audit tests' databases and a log key."""

from __future__ import annotations

import hashlib

import pytest
from kvguard.audit.keys import SigningKey

from tests.audit.conftest import _sqlite_template, db_url, origin, pg_url, sqlite_url  # noqa: F401


@pytest.fixture
def log_key() -> SigningKey:
    return SigningKey.from_seed(hashlib.sha256(b"log").digest())
