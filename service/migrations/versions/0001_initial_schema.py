"""Initial schema: jobs (with owner), labels, attempts, events, metrics, checkpoints, lease.

Revision ID: 0001
Revises:
Create Date: 2026-11-21

Generated from `service/models.py` with autogenerate against a scratch SQLite, then tidied.
`tests/unit/test_migrations.py` compares the migrated schema with the models on SQLite and
PostgreSQL, so a model change without a new revision fails the tests.
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision = "0001"
down_revision = None
branch_labels = None
depends_on = None

# The same variants as `elastrain.service.models`: JSONB and BIGINT ids on PostgreSQL; SQLite only
# auto-increments a primary key declared exactly INTEGER.
JSONType = sa.JSON().with_variant(postgresql.JSONB(astext_type=sa.Text()), "postgresql")
BigId = sa.BigInteger().with_variant(sa.Integer(), "sqlite")

JOB_STATES = (
    "PENDING",
    "STARTING",
    "RUNNING",
    "RECOVERING",
    "RESIZING",
    "SUCCEEDED",
    "FAILED",
    "CANCELLED",
)


def _job_fk() -> sa.ForeignKeyConstraint:
    return sa.ForeignKeyConstraint(["job_id"], ["jobs.id"], ondelete="CASCADE")


def upgrade() -> None:
    op.create_table(
        "jobs",
        sa.Column("id", BigId, autoincrement=True, nullable=False),
        sa.Column("owner", sa.String(length=100), nullable=False),
        sa.Column("name", sa.String(length=100), nullable=False),
        sa.Column("spec", JSONType, nullable=False),
        sa.Column(
            "state",
            # A VARCHAR, not a native enum: adding a state later needs no ALTER TYPE.
            sa.Enum(*JOB_STATES, name="job_state", native_enum=False, length=16),
            nullable=False,
        ),
        sa.Column("state_reason", sa.Text(), nullable=True),
        sa.Column("priority", sa.Integer(), nullable=False),
        sa.Column("strategy", sa.String(length=16), nullable=False),
        sa.Column("min_workers", sa.Integer(), nullable=False),
        sa.Column("max_workers", sa.Integer(), nullable=False),
        sa.Column("max_steps", sa.Integer(), nullable=False),
        sa.Column("attempt", sa.Integer(), nullable=False),
        sa.Column("restarts", sa.Integer(), nullable=False),
        sa.Column("world_size", sa.Integer(), nullable=True),
        sa.Column("step", sa.Integer(), nullable=False),
        sa.Column("latest_loss", sa.Float(), nullable=True),
        sa.Column("last_error", sa.Text(), nullable=True),
        sa.Column("cancel_requested", sa.Boolean(), nullable=False),
        sa.Column("checkpoint_requested", sa.Boolean(), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("updated_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("started_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("finished_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("below_min_since", sa.DateTime(timezone=True), nullable=True),
        sa.PrimaryKeyConstraint("id"),
    )
    op.create_index("ix_jobs_created", "jobs", ["created_at", "id"])
    op.create_index("ix_jobs_owner", "jobs", ["owner"])
    op.create_index("ix_jobs_state_priority", "jobs", ["state", "priority", "id"])

    op.create_table(
        "job_labels",
        sa.Column("job_id", BigId, nullable=False),
        sa.Column("key", sa.String(length=63), nullable=False),
        sa.Column("value", sa.String(length=100), nullable=False),
        _job_fk(),
        sa.PrimaryKeyConstraint("job_id", "key"),
    )
    op.create_index("ix_job_labels_kv", "job_labels", ["key", "value"])

    op.create_table(
        "attempts",
        sa.Column("id", BigId, autoincrement=True, nullable=False),
        sa.Column("job_id", BigId, nullable=False),
        sa.Column("number", sa.Integer(), nullable=False),
        sa.Column("world_size", sa.Integer(), nullable=False),
        sa.Column("driver_name", sa.String(length=200), nullable=False),
        sa.Column("resume_step", sa.Integer(), nullable=True),
        sa.Column("started_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("ended_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("outcome", sa.String(length=32), nullable=True),
        sa.Column("error", sa.Text(), nullable=True),
        sa.Column("nodes", JSONType, nullable=True),
        _job_fk(),
        sa.PrimaryKeyConstraint("id"),
        sa.UniqueConstraint("job_id", "number", name="uq_attempts_job_number"),
    )
    op.create_index("ix_attempts_job_id", "attempts", ["job_id"])

    op.create_table(
        "events",
        sa.Column("id", BigId, autoincrement=True, nullable=False),
        sa.Column("job_id", BigId, nullable=False),
        sa.Column("at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("kind", sa.String(length=32), nullable=False),
        sa.Column("from_state", sa.String(length=16), nullable=True),
        sa.Column("to_state", sa.String(length=16), nullable=True),
        sa.Column("reason", sa.Text(), nullable=False),
        sa.Column("world_size_before", sa.Integer(), nullable=True),
        sa.Column("world_size_after", sa.Integer(), nullable=True),
        sa.Column("attempt", sa.Integer(), nullable=False),
        sa.Column("step", sa.Integer(), nullable=True),
        sa.Column("details", JSONType, nullable=True),
        _job_fk(),
        sa.PrimaryKeyConstraint("id"),
    )
    op.create_index("ix_events_job_id", "events", ["job_id"])

    op.create_table(
        "metrics",
        sa.Column("job_id", BigId, nullable=False),
        sa.Column("step", sa.Integer(), nullable=False),
        sa.Column("attempt", sa.Integer(), nullable=False),
        sa.Column("at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("values", JSONType, nullable=False),
        _job_fk(),
        sa.PrimaryKeyConstraint("job_id", "step"),
    )

    op.create_table(
        "checkpoints",
        sa.Column("id", BigId, autoincrement=True, nullable=False),
        sa.Column("job_id", BigId, nullable=False),
        sa.Column("step", sa.Integer(), nullable=False),
        sa.Column("attempt", sa.Integer(), nullable=False),
        sa.Column("world_size", sa.Integer(), nullable=False),
        sa.Column("path", sa.Text(), nullable=False),
        sa.Column("bytes", sa.BigInteger(), nullable=False),
        sa.Column("committed_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("manifest", JSONType, nullable=True),
        _job_fk(),
        sa.PrimaryKeyConstraint("id"),
        sa.UniqueConstraint("job_id", "step", name="uq_checkpoints_job_step"),
    )
    op.create_index("ix_checkpoints_job_id", "checkpoints", ["job_id"])

    op.create_table(
        "scheduler_lease",
        sa.Column("name", sa.String(length=64), nullable=False),
        sa.Column("holder", sa.String(length=200), nullable=False),
        sa.Column("expires_at", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("name"),
    )


def downgrade() -> None:
    # Children first; dropping a table drops its indexes.
    for table in ("scheduler_lease", "checkpoints", "metrics", "events", "attempts", "job_labels"):
        op.drop_table(table)
    op.drop_table("jobs")
