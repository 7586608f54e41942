"""The event numbers recorded per inference process start, durable across sidecar restarts.

Revision ID: 0110
Revises: 0102
Create Date: 2026-12-01
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0110"
down_revision = "0102"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "ingest_progress",
        sa.Column("origin", sa.String(255), primary_key=True),
        sa.Column("client", sa.String(100), primary_key=True),
        sa.Column("last_event", sa.BigInteger, nullable=False),
        sa.Column("log_size", sa.BigInteger, nullable=False),
        sa.Column("updated_ms", sa.BigInteger, nullable=False),
    )


def downgrade() -> None:
    op.drop_table("ingest_progress")
