"""Witness cosignatures of the checkpoints (C2SP tlog-cosignature), a table of their own.

Revision ID: 0121
Revises: 0110
Create Date: 2026-12-01
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0121"
down_revision = "0110"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "cosignatures",
        sa.Column("origin", sa.String(255), sa.ForeignKey("logs.origin"), primary_key=True),
        sa.Column("tree_size", sa.BigInteger, primary_key=True),
        sa.Column("witness", sa.String(255), primary_key=True),
        sa.Column("key_id", sa.String(8), primary_key=True),
        sa.Column("time_s", sa.BigInteger, nullable=False),
        sa.Column("line", sa.Text, nullable=False),
    )


def downgrade() -> None:
    op.drop_table("cosignatures")
