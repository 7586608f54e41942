"""Tokens may expire (api_tokens.expires_ms); an erasure request keeps a keyed digest of
its body (erasure_requests.body_hmac), so a reused Idempotency-Key with another body is
refused without storing the body's ids.

Revision ID: 0102
Revises: 0101
Create Date: 2026-12-01
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0102"
down_revision = "0101"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("api_tokens") as batch:
        batch.add_column(sa.Column("expires_ms", sa.BigInteger, nullable=True))
    with op.batch_alter_table("erasure_requests") as batch:
        batch.add_column(sa.Column("body_hmac", sa.String(64), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("erasure_requests") as batch:
        batch.drop_column("body_hmac")
    with op.batch_alter_table("api_tokens") as batch:
        batch.drop_column("expires_ms")
