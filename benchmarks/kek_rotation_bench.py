"""How fast a key-encryption key rotation re-wraps the subjects' pseudonym secrets.

    .venv/bin/python benchmarks/kek_rotation_bench.py [--secrets 20000] [--no-postgres]

N random secrets are inserted in the clear (as a version before wrapping stored them),
then timed: wrapping them under the first KEK (what the first start after the upgrade
does), and a rotation (a new KEK, every secret re-wrapped, the old KEK destroyed). The
rotation's duration adds to the exposure bound of docs/audit-format.md §6. PostgreSQL
runs in a scratch database on 127.0.0.1:5432, dropped afterwards.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
import uuid
from pathlib import Path

from kvguard.audit.keyring import Keyring
from kvguard.audit.models import SubjectKey
from kvguard.audit.store import AuditStore, migrate
from sqlalchemy import create_engine, insert, text

PG_ADMIN = "postgresql+psycopg://postgres@127.0.0.1:5432/test"


def run(url: str, label: str, n: int) -> None:
    migrate(url)
    store = AuditStore(url)
    with store.write() as conn:
        conn.execute(insert(SubjectKey), [{"idx": os.urandom(32), "kind": "user", "secret": os.urandom(32),
                                           "created_ms": 0} for _ in range(n)])
    with tempfile.TemporaryDirectory() as kek_dir:
        ring = Keyring(Path(kek_dir) / "kek", store)
        started = time.perf_counter()
        wrapped = ring.rewrap(ring.current())
        wrap_s = time.perf_counter() - started
        started = time.perf_counter()
        ring.rotate()
        rotate_s = time.perf_counter() - started
    store.dispose()
    print(f"{label:10}  wrap {wrapped} secrets in {wrap_s:.2f} s ({wrapped / wrap_s:,.0f}/s)   "
          f"rotate {n} in {rotate_s:.2f} s ({n / rotate_s:,.0f}/s)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--secrets", type=int, default=20_000)
    ap.add_argument("--no-postgres", action="store_true")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        run(f"sqlite:///{tmp}/audit.db", "sqlite", args.secrets)
    if args.no_postgres:
        return
    name = f"kvguard_kek_bench_{uuid.uuid4().hex[:8]}"
    admin = create_engine(PG_ADMIN, isolation_level="AUTOCOMMIT")
    with admin.connect() as conn:
        conn.execute(text(f"CREATE DATABASE {name}"))
    try:
        run(PG_ADMIN.rsplit("/", 1)[0] + f"/{name}", "postgresql", args.secrets)
    finally:
        with admin.connect() as conn:
            conn.execute(text(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)"))
        admin.dispose()


if __name__ == "__main__":
    main()
