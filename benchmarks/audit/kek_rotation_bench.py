"""How fast a key-encryption key rotation re-wraps the subjects' pseudonym secrets.

    .venv/bin/python benchmarks/audit/kek_rotation_bench.py [--secrets 20000] [--no-postgres]

N random secrets are inserted in the clear (as a version before wrapping stored them),
then timed: wrapping them under the first KEK (what the first start after the upgrade
does), and a rotation (a new KEK, every secret re-wrapped, the old KEK destroyed). The
rotation's duration adds to the exposure bound of docs/audit-format.md §6. PostgreSQL
runs in a scratch database on 127.0.0.1:5432, dropped afterwards.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from kvguard.audit.keyring import Keyring  # noqa: E402
from kvguard.audit.models import SubjectKey  # noqa: E402
from kvguard.audit.store import AuditStore, migrate  # noqa: E402
from sqlalchemy import insert  # noqa: E402

from benchmarks._lib.postgres import scratch_database  # noqa: E402


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
    with scratch_database("kvguard_kek_bench") as url:
        run(url, "postgresql", args.secrets)


if __name__ == "__main__":
    main()
