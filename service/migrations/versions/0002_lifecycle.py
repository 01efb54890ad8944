"""Lifecycle: attempts record a stop request, the acknowledged report and the failure
record; the cluster snapshot moves into the database; the unused `resume_step` goes.

Revision ID: 0002
Revises: 0001
Create Date: 2026-11-23
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision = "0002"
down_revision = "0001"
branch_labels = None
depends_on = None

JSONType = sa.JSON().with_variant(postgresql.JSONB(astext_type=sa.Text()), "postgresql")


def upgrade() -> None:
    # batch: SQLite cannot drop a column in place; Alembic copies the table there.
    with op.batch_alter_table("attempts") as batch:
        batch.drop_column("resume_step")
        batch.add_column(
            sa.Column("stop_requested", sa.Boolean(), nullable=False, server_default=sa.false())
        )
        batch.add_column(sa.Column("report_seq", sa.Integer(), nullable=False, server_default="0"))
        batch.add_column(sa.Column("failure", JSONType, nullable=True))
    # The defaults only fill existing rows; the models set them for new ones.
    with op.batch_alter_table("attempts") as batch:
        batch.alter_column("stop_requested", server_default=None)
        batch.alter_column("report_seq", server_default=None)
    op.create_table(
        "cluster_snapshot",
        sa.Column("name", sa.String(length=64), nullable=False),
        sa.Column("view", JSONType, nullable=False),
        sa.Column("updated_at", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("name"),
    )


def downgrade() -> None:
    op.drop_table("cluster_snapshot")
    with op.batch_alter_table("attempts") as batch:
        batch.drop_column("failure")
        batch.drop_column("report_seq")
        batch.drop_column("stop_requested")
        batch.add_column(sa.Column("resume_step", sa.Integer(), nullable=True))
