"""Migration 0123 (the fleet's tables) on both stores: reversible, and a request left open
by a sidecar of before the fleet becomes that sidecar's part, so it is still carried out."""

from __future__ import annotations

import sqlalchemy as sa
from kvguard.audit.store import downgrade, migrate

OPEN = ("INSERT INTO erasure_requests (id, origin, idempotency_sha256, scope, legal_basis, tenant_pseudonym, "
        "subject_pseudonym, state, received_ms, deadline_ms, attempts) VALUES "
        "(:id, 'pod-a', :id, 'user', 'gdpr-art17', 't', 's', :state, 1, 2, 0)")


def test_the_fleet_migration_is_reversible_and_keeps_open_requests(db_url):
    migrate(db_url)
    downgrade(db_url, "0110")
    engine = sa.create_engine(db_url)
    try:
        with engine.begin() as c:
            for rid, state in (("r-open", "executing"), ("r-done", "completed")):
                c.execute(sa.text(OPEN), {"id": rid, "state": state})
        migrate(db_url)
        with engine.connect() as c:
            parts = c.execute(sa.text("SELECT request_id, origin, state FROM erasure_parts")).all()
        assert parts == [("r-open", "pod-a", "pending")]
        downgrade(db_url, "0110")  # down again with parts in place, and up
        with engine.connect() as c:
            assert "erasure_parts" not in sa.inspect(c).get_table_names()
        migrate(db_url)
    finally:
        engine.dispose()
