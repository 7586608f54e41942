"""Sidecar tables: admin API tokens (hashed), erasure requests, user-session links.

Revision ID: 0100
Revises: 0002
Create Date: 2026-11-29
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0100"
down_revision = "0002"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "api_tokens",
        sa.Column("id", sa.String(32), primary_key=True),
        sa.Column("name", sa.String(100), nullable=False),
        sa.Column("token_sha256", sa.String(64), nullable=False, unique=True),
        sa.Column("scopes", sa.String(200), nullable=False),
        sa.Column("created_ms", sa.BigInteger, nullable=False),
        sa.Column("revoked", sa.Boolean, nullable=False, server_default=sa.false()),
    )
    op.create_table(
        "erasure_requests",
        sa.Column("id", sa.String(36), primary_key=True),
        sa.Column("origin", sa.String(255), nullable=False, index=True),
        sa.Column("idempotency_sha256", sa.String(64), nullable=False, unique=True),
        sa.Column("scope", sa.String(16), nullable=False),
        sa.Column("legal_basis", sa.String(32), nullable=False),
        sa.Column("reason_sha256", sa.String(64)),
        sa.Column("tenant_pseudonym", sa.String(64), nullable=False),
        sa.Column("subject_pseudonym", sa.String(64), nullable=False, index=True),
        sa.Column("sealed_subject", sa.LargeBinary),
        sa.Column("state", sa.String(16), nullable=False, index=True),
        sa.Column("received_ms", sa.BigInteger, nullable=False),
        sa.Column("deadline_ms", sa.BigInteger, nullable=False),
        sa.Column("completed_ms", sa.BigInteger),
        sa.Column("attempts", sa.Integer, nullable=False, server_default="0"),
        sa.Column("result_json", sa.Text),
        sa.Column("receipt_json", sa.Text),
        sa.Column("record_seq", sa.BigInteger),
        sa.Column("error", sa.Text),
    )


    op.create_table(
        "subject_links",
        sa.Column("user_idx", sa.LargeBinary(32), primary_key=True),
        sa.Column("session_idx", sa.LargeBinary(32), primary_key=True),
    )


def downgrade() -> None:
    op.drop_table("subject_links")
    op.drop_table("erasure_requests")
    op.drop_table("api_tokens")
