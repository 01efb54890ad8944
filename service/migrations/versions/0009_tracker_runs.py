"""Experiment trackers: how far each tracked job has been forwarded to each tracker.

Revision ID: 0009
Revises: 0008
Create Date: 2026-11-26
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0009"
down_revision = "0008"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "tracker_runs",
        sa.Column("job_id", sa.BigInteger().with_variant(sa.Integer(), "sqlite"), nullable=False),
        sa.Column("tracker", sa.String(length=16), nullable=False),
        sa.Column("run_id", sa.String(length=200), nullable=True),
        sa.Column("metric_step", sa.Integer(), nullable=False),
        sa.Column("event_id", sa.BigInteger(), nullable=False),
        sa.Column("done", sa.Boolean(), nullable=False),
        sa.Column("failures", sa.Integer(), nullable=False),
        sa.Column("last_error", sa.Text(), nullable=True),
        sa.Column("retry_at", sa.DateTime(timezone=True), nullable=True),
        sa.ForeignKeyConstraint(["job_id"], ["jobs.id"], ondelete="CASCADE"),
        sa.PrimaryKeyConstraint("job_id", "tracker"),
    )
    op.create_index("ix_tracker_runs_open", "tracker_runs", ["done"])


def downgrade() -> None:
    op.drop_index("ix_tracker_runs_open", table_name="tracker_runs")
    op.drop_table("tracker_runs")
