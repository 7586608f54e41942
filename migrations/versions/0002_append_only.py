"""Append-only: the database itself refuses UPDATE, DELETE (and TRUNCATE) on the log tables.

Application code never updates or deletes a record; these triggers make a
mistaken or hostile statement fail too. subject_keys stays mutable: deleting
its rows is crypto-shredding.

Revision ID: 0002
Revises: 0001
Create Date: 2025-01-01
"""

from __future__ import annotations

from alembic import op

revision = "0002"
down_revision = "0001"
branch_labels = None
depends_on = None

TABLES = ("logs", "keys", "records", "checkpoints")

PG_FUNCTION = """
CREATE FUNCTION kvguard_append_only() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    RAISE EXCEPTION 'kvguard audit table % is append-only: % refused', TG_TABLE_NAME, TG_OP
        USING ERRCODE = 'restrict_violation';
END
$$
"""


def upgrade() -> None:
    if op.get_bind().dialect.name == "postgresql":
        op.execute(PG_FUNCTION)
        for table in TABLES:
            op.execute(
                f"CREATE TRIGGER {table}_append_only BEFORE UPDATE OR DELETE ON {table}"
                " FOR EACH ROW EXECUTE FUNCTION kvguard_append_only()"
            )
            op.execute(
                f"CREATE TRIGGER {table}_no_truncate BEFORE TRUNCATE ON {table}"
                " FOR EACH STATEMENT EXECUTE FUNCTION kvguard_append_only()"
            )
        return
    for table in TABLES:
        for action in ("UPDATE", "DELETE"):
            op.execute(
                f"CREATE TRIGGER {table}_no_{action.lower()} BEFORE {action} ON {table} BEGIN"
                f" SELECT RAISE(ABORT, 'kvguard audit table {table} is append-only: {action} refused'); END"
            )


def downgrade() -> None:
    if op.get_bind().dialect.name == "postgresql":
        for table in TABLES:
            op.execute(f"DROP TRIGGER {table}_no_truncate ON {table}")
            op.execute(f"DROP TRIGGER {table}_append_only ON {table}")
        op.execute("DROP FUNCTION kvguard_append_only()")
        return
    for table in TABLES:
        for action in ("update", "delete"):
            op.execute(f"DROP TRIGGER {table}_no_{action}")
