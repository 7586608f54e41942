"""Audit tables: logs, keys, records, checkpoints, subject_keys.

Revision ID: 0001
Revises:
Create Date: 2025-01-01
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0001"
down_revision = None
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "logs",
        sa.Column("origin", sa.String(255), primary_key=True),
        sa.Column("created_ms", sa.BigInteger, nullable=False),
    )
    op.create_table(
        "keys",
        sa.Column("origin", sa.String(255), sa.ForeignKey("logs.origin"), primary_key=True),
        sa.Column("key_id", sa.String(64), primary_key=True),
        sa.Column("public_key", sa.LargeBinary(32), nullable=False),
        sa.Column("valid_from_seq", sa.BigInteger, nullable=False),
        sa.Column("rotation_seq", sa.BigInteger, nullable=True),
        sa.Column("created_ms", sa.BigInteger, nullable=False),
    )
    op.create_table(
        "records",
        sa.Column("origin", sa.String(255), sa.ForeignKey("logs.origin"), primary_key=True),
        sa.Column("seq", sa.BigInteger, primary_key=True),
        sa.Column("time_ms", sa.BigInteger, nullable=False),
        sa.Column("op", sa.String(32), nullable=False),
        sa.Column("tenant_pseudonym", sa.String(32), nullable=True),
        sa.Column("user_pseudonym", sa.String(32), nullable=True),
        sa.Column("session_pseudonym", sa.String(32), nullable=True),
        sa.Column("key_id", sa.String(64), nullable=False),
        sa.Column("prev", sa.String(64), nullable=False),
        sa.Column("leaf_hash", sa.LargeBinary(32), nullable=False),
        sa.Column("sig", sa.String(88), nullable=False),
        sa.Column("body", sa.Text, nullable=False),
    )
    op.create_index("ix_records_origin_time", "records", ["origin", "time_ms"])
    op.create_index("ix_records_origin_op", "records", ["origin", "op"])
    op.create_index("ix_records_tenant", "records", ["tenant_pseudonym"])
    op.create_index("ix_records_user", "records", ["user_pseudonym"])
    op.create_index("ix_records_session", "records", ["session_pseudonym"])
    op.create_table(
        "checkpoints",
        sa.Column("origin", sa.String(255), sa.ForeignKey("logs.origin"), primary_key=True),
        sa.Column("tree_size", sa.BigInteger, primary_key=True),
        sa.Column("root_hash", sa.LargeBinary(32), nullable=False),
        sa.Column("time_ms", sa.BigInteger, nullable=False),
        sa.Column("key_id", sa.String(64), nullable=False),
        sa.Column("note", sa.Text, nullable=False),
    )
    op.create_table(
        "subject_keys",
        sa.Column("idx", sa.LargeBinary(32), primary_key=True),
        sa.Column("kind", sa.String(16), nullable=False),
        sa.Column("secret", sa.LargeBinary(32), nullable=False),
        sa.Column("created_ms", sa.BigInteger, nullable=False),
    )


def downgrade() -> None:
    op.drop_table("subject_keys")
    op.drop_table("checkpoints")
    op.drop_index("ix_records_session", table_name="records")
    op.drop_index("ix_records_user", table_name="records")
    op.drop_index("ix_records_tenant", table_name="records")
    op.drop_index("ix_records_origin_op", table_name="records")
    op.drop_index("ix_records_origin_time", table_name="records")
    op.drop_table("records")
    op.drop_table("keys")
    op.drop_table("logs")
