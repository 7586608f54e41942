"""Fleet erasure: the sidecars of one database and each one's part of every erasure request.

Revision ID: 0123
Revises: 0122
Create Date: 2026-12-01
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0123"
down_revision = "0122"
branch_labels = None
depends_on = None


def upgrade() -> None:
    # first: on SQLite the batch rebuilds erasure_requests, which nothing may reference yet
    with op.batch_alter_table("erasure_requests") as b:
        b.add_column(sa.Column("secrets_destroyed", sa.Integer, nullable=True))
        b.add_column(sa.Column("shredded_ms", sa.BigInteger, nullable=True))
        b.add_column(sa.Column("shredded_tags", sa.Text, nullable=True))
    op.create_table(
        "fleet_sidecars",
        sa.Column("origin", sa.String(255), primary_key=True),
        sa.Column("instance", sa.String(32), nullable=False),
        sa.Column("key_id", sa.String(64), nullable=False),
        sa.Column("started_ms", sa.BigInteger, nullable=False),
        sa.Column("heartbeat_ms", sa.BigInteger, nullable=False),
        sa.Column("left_ms", sa.BigInteger, nullable=True),
    )
    op.create_table(
        "erasure_parts",
        # no foreign key: on SQLite a later batch rebuild of erasure_requests would trip over it
        sa.Column("request_id", sa.String(36), primary_key=True),
        sa.Column("origin", sa.String(255), primary_key=True),
        sa.Column("state", sa.String(16), nullable=False, index=True),
        sa.Column("attempts", sa.Integer, nullable=False, server_default="0"),
        sa.Column("processes_json", sa.Text, nullable=True),
        sa.Column("record_seq", sa.BigInteger, nullable=True),
        sa.Column("receipt_json", sa.Text, nullable=True),
        sa.Column("error", sa.Text, nullable=True),
        sa.Column("excluded_reason", sa.Text, nullable=True),
        sa.Column("created_ms", sa.BigInteger, nullable=False),
        sa.Column("updated_ms", sa.BigInteger, nullable=False),
    )
    op.create_index("ix_erasure_parts_origin_state", "erasure_parts", ["origin", "state"])
    # a request still open was its accepting sidecar's alone: that sidecar's part, to carry out
    op.execute("INSERT INTO erasure_parts (request_id, origin, state, attempts, created_ms, updated_ms) "
               "SELECT id, origin, 'pending', 0, received_ms, received_ms FROM erasure_requests "
               "WHERE state IN ('received', 'executing')")


def downgrade() -> None:
    # the parts first: on SQLite the batch below rebuilds the table they reference
    op.drop_index("ix_erasure_parts_origin_state", "erasure_parts")
    op.drop_table("erasure_parts")
    op.drop_table("fleet_sidecars")
    with op.batch_alter_table("erasure_requests") as b:
        b.drop_column("shredded_tags")
        b.drop_column("shredded_ms")
        b.drop_column("secrets_destroyed")
