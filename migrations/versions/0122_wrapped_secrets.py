"""Subject secrets wrapped under a key-encryption key kept outside the database; erasure
reasons kept only as an HMAC under the subject's secret.

subject_keys.kek_id names the key-encryption key (table keks) whose AES-GCM wraps the
row's secret; NULL marks a secret stored before wrapping, which the sidecar wraps at its
next start. erasure_requests.reason_sha256 (an unkeyed digest, which confirms a guessed
reason) gives way to reason_hmac; its values are dropped, not converted: the reasons are
not stored anywhere to convert from.

Revision ID: 0122
Revises: 0110
Create Date: 2026-12-01
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0122"
down_revision = "0121"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "keks",
        sa.Column("id", sa.String(32), primary_key=True),
        sa.Column("created_ms", sa.BigInteger, nullable=False),
        sa.Column("destroyed_ms", sa.BigInteger, nullable=True),
    )
    with op.batch_alter_table("subject_keys") as batch:
        batch.add_column(sa.Column("kek_id", sa.String(32), nullable=True))
    with op.batch_alter_table("erasure_requests") as batch:
        batch.add_column(sa.Column("reason_hmac", sa.String(64), nullable=True))
        batch.drop_column("reason_sha256")


def downgrade() -> None:
    with op.batch_alter_table("erasure_requests") as batch:
        batch.add_column(sa.Column("reason_sha256", sa.String(64), nullable=True))
        batch.drop_column("reason_hmac")
    with op.batch_alter_table("subject_keys") as batch:
        batch.drop_column("kek_id")
    op.drop_table("keks")
