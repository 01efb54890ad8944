"""Goodput accounting on the job row: seconds per state, step and stall seconds.

Revision ID: 0004
Revises: 0003
Create Date: 2026-11-23
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision = "0004"
down_revision = "0003"
branch_labels = None
depends_on = None

JSONType = sa.JSON().with_variant(postgresql.JSONB(astext_type=sa.Text()), "postgresql")
_FLOATS = ("compute_s", "kept_s", "stall_s")


def upgrade() -> None:
    with op.batch_alter_table("jobs") as batch:
        batch.add_column(sa.Column("seconds_in", JSONType, nullable=False, server_default="{}"))
        batch.add_column(sa.Column("state_since", sa.DateTime(timezone=True), nullable=True))
        for name in _FLOATS:
            batch.add_column(sa.Column(name, sa.Float(), nullable=False, server_default="0"))
    # Jobs from before: their current state counts from their last change.
    op.execute("UPDATE jobs SET state_since = updated_at")
    with op.batch_alter_table("jobs") as batch:
        batch.alter_column("seconds_in", server_default=None)
        for name in _FLOATS:
            batch.alter_column(name, server_default=None)


def downgrade() -> None:
    with op.batch_alter_table("jobs") as batch:
        for name in (*_FLOATS, "state_since", "seconds_in"):
            batch.drop_column(name)
