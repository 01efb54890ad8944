"""Metric summaries per bucket of steps (downsampled curves), and when a job's per-step
rows were thinned by retention. Jobs stored before get their summaries here.

Revision ID: 0005
Revises: 0004
Create Date: 2026-11-24
"""

from __future__ import annotations

from typing import Any

import sqlalchemy as sa
from alembic import op

revision = "0005"
down_revision = "0004"
branch_labels = None
depends_on = None

BigId = sa.BigInteger().with_variant(sa.Integer(), "sqlite")


def upgrade() -> None:
    op.create_table(
        "metric_buckets",
        sa.Column("job_id", BigId, nullable=False),
        sa.Column("width", sa.Integer(), nullable=False),
        sa.Column("bucket", sa.Integer(), nullable=False),
        sa.Column("lo_step", sa.Integer(), nullable=True),
        sa.Column("lo_loss", sa.Float(), nullable=True),
        sa.Column("hi_step", sa.Integer(), nullable=True),
        sa.Column("hi_loss", sa.Float(), nullable=True),
        sa.Column("slow_step", sa.Integer(), nullable=True),
        sa.Column("slow_s", sa.Float(), nullable=True),
        sa.Column("eval_step", sa.Integer(), nullable=True),
        sa.ForeignKeyConstraint(["job_id"], ["jobs.id"], ondelete="CASCADE"),
        sa.PrimaryKeyConstraint("job_id", "width", "bucket"),
    )
    with op.batch_alter_table("jobs") as batch:
        batch.add_column(sa.Column("metrics_thinned_at", sa.DateTime(timezone=True), nullable=True))
    _backfill()


def _backfill() -> None:
    """Summaries of the rows already stored, job by job, in step order."""
    from elastrain.service.metric_summary import summarize

    bind = op.get_bind()
    metrics = sa.table(
        "metrics", sa.column("job_id"), sa.column("step"), sa.column("values", sa.JSON)
    )
    buckets = sa.table(
        "metric_buckets",
        *(sa.column(c) for c in ("job_id", "width", "bucket", "lo_step", "lo_loss", "hi_step",
                                 "hi_loss", "slow_step", "slow_s", "eval_step")),
    )  # fmt: skip
    job_ids = bind.execute(sa.select(metrics.c.job_id).distinct()).scalars().all()
    for job_id in job_ids:
        rows = bind.execute(
            sa.select(metrics.c.step, metrics.c["values"])
            .where(metrics.c.job_id == job_id)
            .order_by(metrics.c.step)
        )
        summaries = summarize((step, values or {}) for step, values in rows)
        batch: list[dict[str, Any]] = [
            {"job_id": job_id, "width": width, "bucket": bucket, **_columns(summary)}
            for (width, bucket), summary in summaries.items()
        ]
        for start in range(0, len(batch), 5000):
            bind.execute(buckets.insert(), batch[start : start + 5000])


def _columns(summary: Any) -> dict[str, Any]:
    return {
        name: getattr(summary, name)
        for name in ("lo_step", "lo_loss", "hi_step", "hi_loss", "slow_step", "slow_s", "eval_step")
    }


def downgrade() -> None:
    with op.batch_alter_table("jobs") as batch:
        batch.drop_column("metrics_thinned_at")
    op.drop_table("metric_buckets")
