"""ORM rows (SQLAlchemy 2). HTTP schemas live in `api/schemas.py`, not here."""

from __future__ import annotations

from datetime import datetime, timezone
from typing import Any

from sqlalchemy import (
    JSON,
    BigInteger,
    Boolean,
    DateTime,
    Enum,
    Float,
    ForeignKey,
    Index,
    Integer,
    String,
    Text,
    TypeDecorator,
    UniqueConstraint,
)
from sqlalchemy.dialects.postgresql import JSONB
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column, relationship

from elastrain.service.states import JobState

# JSONB on PostgreSQL (indexable, compact), plain JSON text elsewhere.
JSONType = JSON().with_variant(JSONB(), "postgresql")
# BigInteger primary keys autoincrement on SQLite only as INTEGER.
BigId = BigInteger().with_variant(Integer(), "sqlite")


def utcnow() -> datetime:
    return datetime.now(timezone.utc)


class UTCDateTime(TypeDecorator[datetime]):
    """An aware UTC datetime on every database.

    SQLite has no time zone type and hands back naive datetimes, which then neither compare
    with `utcnow()` (TypeError) nor serialise with an offset. Store UTC, read back UTC.
    """

    impl = DateTime(timezone=True)
    cache_ok = True

    def process_bind_param(self, value: datetime | None, dialect: Any) -> datetime | None:
        if value is not None and value.tzinfo is not None:
            value = value.astimezone(timezone.utc)
        return value

    def process_result_value(self, value: datetime | None, dialect: Any) -> datetime | None:
        if value is not None and value.tzinfo is None:
            value = value.replace(tzinfo=timezone.utc)
        return value


def as_utc(ts: datetime) -> datetime:
    """SQLite hands back naive datetimes; everything we store is UTC."""
    return ts if ts.tzinfo is not None else ts.replace(tzinfo=timezone.utc)


class Base(DeclarativeBase):
    pass


class Job(Base):
    __tablename__ = "jobs"

    id: Mapped[int] = mapped_column(BigId, primary_key=True, autoincrement=True)
    # Every job has an owner from the first migration on, so that tokens and per-tenant
    # isolation can be added without reshaping the data.
    owner: Mapped[str] = mapped_column(String(100), default="default", index=True)
    name: Mapped[str] = mapped_column(String(100))
    spec: Mapped[dict[str, Any]] = mapped_column(JSONType)
    state: Mapped[JobState] = mapped_column(
        Enum(JobState, name="job_state", native_enum=False, length=16), default=JobState.PENDING
    )
    state_reason: Mapped[str | None] = mapped_column(Text, default=None)
    priority: Mapped[int] = mapped_column(Integer, default=0)
    strategy: Mapped[str] = mapped_column(String(16))
    min_workers: Mapped[int] = mapped_column(Integer)
    max_workers: Mapped[int] = mapped_column(Integer)
    max_steps: Mapped[int] = mapped_column(Integer)
    # The current (newest) attempt number; 0 before the first launch. Reports and
    # checkpoint commits carry theirs and are rejected when it is older (fencing).
    attempt: Mapped[int] = mapped_column(Integer, default=0)
    restarts: Mapped[int] = mapped_column(Integer, default=0)
    world_size: Mapped[int | None] = mapped_column(Integer, default=None)
    step: Mapped[int] = mapped_column(Integer, default=0)
    latest_loss: Mapped[float | None] = mapped_column(Float, default=None)
    last_error: Mapped[str | None] = mapped_column(Text, default=None)
    cancel_requested: Mapped[bool] = mapped_column(Boolean, default=False)
    checkpoint_requested: Mapped[bool] = mapped_column(Boolean, default=False)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime(), default=utcnow)
    updated_at: Mapped[datetime] = mapped_column(UTCDateTime(), default=utcnow, onupdate=utcnow)
    started_at: Mapped[datetime | None] = mapped_column(UTCDateTime(), default=None)
    finished_at: Mapped[datetime | None] = mapped_column(UTCDateTime(), default=None)
    # When the job first found fewer than min_workers available (None when it is not waiting).
    below_min_since: Mapped[datetime | None] = mapped_column(UTCDateTime(), default=None)

    # Goodput accounting (`elastrain.service.goodput`), kept up to date as things happen so that
    # reading a job never scans its events or metrics: seconds spent in each state left
    # so far, when the current state began, and the step seconds reported (all of them,
    # those of steps still kept, and the checkpoint saves that blocked training).
    seconds_in: Mapped[dict[str, float]] = mapped_column(JSONType, default=dict)
    state_since: Mapped[datetime | None] = mapped_column(UTCDateTime(), default=None)
    compute_s: Mapped[float] = mapped_column(Float, default=0.0)
    kept_s: Mapped[float] = mapped_column(Float, default=0.0)
    stall_s: Mapped[float] = mapped_column(Float, default=0.0)
    # When retention thinned this finished job's per-step metric rows (None: never).
    metrics_thinned_at: Mapped[datetime | None] = mapped_column(UTCDateTime(), default=None)

    # Loaded on access only: the labels are also in `spec["labels"]`, which is what the API
    # shows, so reading a job costs one query, not two. The table is for filtering.
    labels: Mapped[list[JobLabel]] = relationship(
        back_populates="job", cascade="all, delete-orphan", lazy="select"
    )

    __table_args__ = (
        Index("ix_jobs_state_priority", "state", "priority", "id"),
        Index("ix_jobs_created", "created_at", "id"),
    )


class JobLabel(Base):
    """Labels in their own table so `GET /v1/jobs?label=k:v` is an indexed join on any DB."""

    __tablename__ = "job_labels"

    job_id: Mapped[int] = mapped_column(ForeignKey("jobs.id", ondelete="CASCADE"), primary_key=True)
    key: Mapped[str] = mapped_column(String(63), primary_key=True)
    value: Mapped[str] = mapped_column(String(100))
    job: Mapped[Job] = relationship(back_populates="labels")

    __table_args__ = (Index("ix_job_labels_kv", "key", "value"),)


class Attempt(Base):
    """One launch of a job: a driver (in the runtime actor) and its worker group at one world size.

    Its number fences everything it reports: what an older attempt sends is refused."""

    __tablename__ = "attempts"

    id: Mapped[int] = mapped_column(BigId, primary_key=True, autoincrement=True)
    job_id: Mapped[int] = mapped_column(ForeignKey("jobs.id", ondelete="CASCADE"), index=True)
    number: Mapped[int] = mapped_column(Integer)
    world_size: Mapped[int] = mapped_column(Integer)
    driver_name: Mapped[str] = mapped_column(String(200))
    started_at: Mapped[datetime] = mapped_column(UTCDateTime(), default=utcnow)
    ended_at: Mapped[datetime | None] = mapped_column(UTCDateTime(), default=None)
    outcome: Mapped[str | None] = mapped_column(String(32), default=None)
    # `error` is the failure's one-line summary for people; `failure` the record
    # (`elastrain.contracts.messages.WorkerError`), which says whether two failures are the same.
    error: Mapped[str | None] = mapped_column(Text, default=None)
    failure: Mapped[dict[str, Any] | None] = mapped_column(JSONType, default=None)
    # The node of each rank, once the worker group reported it.
    nodes: Mapped[list[str] | None] = mapped_column(JSONType, default=None)
    # Asked to checkpoint and stop so that the job relaunches at another size: this
    # attempt's steps do not make a RESIZING job RUNNING again; the next attempt's do.
    stop_requested: Mapped[bool] = mapped_column(Boolean, default=False)
    # The last driver message persisted (acknowledged on the next poll): a message is
    # stored once even when a pass rolls back or the control plane restarts.
    report_seq: Mapped[int] = mapped_column(Integer, default=0)

    __table_args__ = (UniqueConstraint("job_id", "number", name="uq_attempts_job_number"),)


class Event(Base):
    """Every state transition (and notable happenings such as checkpoint fallbacks)."""

    __tablename__ = "events"

    id: Mapped[int] = mapped_column(BigId, primary_key=True, autoincrement=True)
    job_id: Mapped[int] = mapped_column(ForeignKey("jobs.id", ondelete="CASCADE"), index=True)
    at: Mapped[datetime] = mapped_column(UTCDateTime(), default=utcnow)
    kind: Mapped[str] = mapped_column(String(32), default="transition")
    from_state: Mapped[str | None] = mapped_column(String(16), default=None)
    to_state: Mapped[str | None] = mapped_column(String(16), default=None)
    reason: Mapped[str] = mapped_column(Text, default="")
    world_size_before: Mapped[int | None] = mapped_column(Integer, default=None)
    world_size_after: Mapped[int | None] = mapped_column(Integer, default=None)
    attempt: Mapped[int] = mapped_column(Integer, default=0)
    step: Mapped[int | None] = mapped_column(Integer, default=None)
    details: Mapped[dict[str, Any] | None] = mapped_column(JSONType, default=None)


class Metric(Base):
    """One reported training step. A later attempt that recomputes a step replaces its row."""

    __tablename__ = "metrics"

    job_id: Mapped[int] = mapped_column(ForeignKey("jobs.id", ondelete="CASCADE"), primary_key=True)
    step: Mapped[int] = mapped_column(Integer, primary_key=True)
    attempt: Mapped[int] = mapped_column(Integer)
    at: Mapped[datetime] = mapped_column(UTCDateTime(), default=utcnow)
    values: Mapped[dict[str, Any]] = mapped_column(JSONType)


class MetricBucket(Base):
    """A bucket of a job's steps at one width: which steps carry its shape (lowest and
    highest loss, slowest step, last held-out loss). See `elastrain.service.metric_summary`."""

    __tablename__ = "metric_buckets"

    job_id: Mapped[int] = mapped_column(ForeignKey("jobs.id", ondelete="CASCADE"), primary_key=True)
    width: Mapped[int] = mapped_column(Integer, primary_key=True)
    bucket: Mapped[int] = mapped_column(Integer, primary_key=True)
    lo_step: Mapped[int | None] = mapped_column(Integer)
    lo_loss: Mapped[float | None] = mapped_column(Float)
    hi_step: Mapped[int | None] = mapped_column(Integer)
    hi_loss: Mapped[float | None] = mapped_column(Float)
    slow_step: Mapped[int | None] = mapped_column(Integer)
    slow_s: Mapped[float | None] = mapped_column(Float)
    eval_step: Mapped[int | None] = mapped_column(Integer)


class CheckpointRecord(Base):
    """The catalogue of committed checkpoints (answerable after the Ray cluster is gone)."""

    __tablename__ = "checkpoints"

    id: Mapped[int] = mapped_column(BigId, primary_key=True, autoincrement=True)
    job_id: Mapped[int] = mapped_column(ForeignKey("jobs.id", ondelete="CASCADE"), index=True)
    step: Mapped[int] = mapped_column(Integer)
    attempt: Mapped[int] = mapped_column(Integer)
    world_size: Mapped[int] = mapped_column(Integer)
    path: Mapped[str] = mapped_column(Text)
    bytes: Mapped[int] = mapped_column(BigInteger, default=0)
    committed_at: Mapped[datetime] = mapped_column(UTCDateTime(), default=utcnow)
    manifest: Mapped[dict[str, Any] | None] = mapped_column(JSONType, default=None)

    __table_args__ = (UniqueConstraint("job_id", "step", name="uq_checkpoints_job_step"),)


class ClusterSnapshot(Base):
    """The scheduler's latest view of the Ray cluster (nodes, free resources, jobs per
    node), kept in the DB so that every API replica serves it, with or without a scheduler."""

    __tablename__ = "cluster_snapshot"

    name: Mapped[str] = mapped_column(String(64), primary_key=True)
    view: Mapped[dict[str, Any]] = mapped_column(JSONType)
    updated_at: Mapped[datetime] = mapped_column(UTCDateTime(), default=utcnow)


class SchedulerLease(Base):
    """At most one active scheduler per database: whoever holds this row's lease."""

    __tablename__ = "scheduler_lease"

    name: Mapped[str] = mapped_column(String(64), primary_key=True)
    holder: Mapped[str] = mapped_column(String(200))
    expires_at: Mapped[datetime] = mapped_column(UTCDateTime())


class Tenant(Base):
    """Whoever owns jobs: a team or a user. Jobs name theirs in `jobs.owner`."""

    __tablename__ = "tenants"

    name: Mapped[str] = mapped_column(String(100), primary_key=True)
    # The most workers the tenant's jobs may hold at once (None: the settings' default).
    max_workers: Mapped[int | None] = mapped_column(Integer, default=None)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime(), default=utcnow)


class ApiToken(Base):
    """A bearer token, stored as its SHA-256: the database never holds one that works.

    Tokens are 256 random bits, so a fast hash is enough (GitHub and PyPI do the same); a
    slow password hash would only cost every request."""

    __tablename__ = "api_tokens"

    id: Mapped[int] = mapped_column(BigId, primary_key=True, autoincrement=True)
    tenant: Mapped[str] = mapped_column(ForeignKey("tenants.name"), index=True)
    admin: Mapped[bool] = mapped_column(Boolean, default=False)
    name: Mapped[str] = mapped_column(String(100), default="")
    # The first characters, to tell tokens apart in `token list` without revealing them.
    prefix: Mapped[str] = mapped_column(String(16))
    sha256: Mapped[str] = mapped_column(String(64), unique=True)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime(), default=utcnow)
    revoked_at: Mapped[datetime | None] = mapped_column(UTCDateTime(), default=None)


class DatabaseIdentity(Base):
    """Made once with the schema: `database` is this database's random id
    (`elastrain.contracts.runtime.JobRef`). A backup restored keeps it (its jobs are the same jobs);
    a fresh database gets a new one. `runtime_control_key` (made on first use,
    `elastrain.service.identity.runtime_control_key`): the key the runtime checks callers with."""

    __tablename__ = "database_identity"

    name: Mapped[str] = mapped_column(String(64), primary_key=True)
    value: Mapped[str] = mapped_column(String(64))


class NodeDrainRow(Base):
    """A Ray node an operator drained (`elastrain drain`): no rank is placed on it and
    jobs leave it, until it is undrained. Drains Ray itself reports (autoscaler, KubeRay,
    preemption notices) are read from Ray every pass and are not stored."""

    __tablename__ = "node_drains"

    node_id: Mapped[str] = mapped_column(String(64), primary_key=True)
    reason: Mapped[str] = mapped_column(Text, default="")
    # When the node goes: a job that cannot leave it checkpoints and stops by then.
    deadline: Mapped[datetime | None] = mapped_column(UTCDateTime(), default=None)
    created_by: Mapped[str] = mapped_column(String(100), default="")
    created_at: Mapped[datetime] = mapped_column(UTCDateTime(), default=utcnow)


class PackageGrant(Base):
    """Who may use a stored package (`elastrain.service.package_access`). The files are stored once
    by their content; visibility is per tenant: the tenant that uploaded it (`uploaded`,
    its bytes counted against that tenant's storage quota) or one an admin shared it with
    (`tenant` "*": every tenant)."""

    __tablename__ = "package_owners"

    digest: Mapped[str] = mapped_column(String(71), primary_key=True)
    tenant: Mapped[str] = mapped_column(String(100), primary_key=True)
    uploaded: Mapped[bool] = mapped_column(Boolean, default=True)
    size_bytes: Mapped[int] = mapped_column(BigInteger, default=0)
    # Whose token made the row: the uploading tenant, or the admin who shared.
    granted_by: Mapped[str] = mapped_column(String(100), default="")
    created_at: Mapped[datetime] = mapped_column(UTCDateTime(), default=utcnow)


class TrackerRun(Base):
    """How far a job's metrics and events have been forwarded to one experiment tracker
    (`elastrain.service.tracking`): made with the job when its spec names the tracker, so the
    forwarder finds the jobs to follow with one indexed query, and a restarted control plane
    goes on where the last one stopped, in the same tracker run."""

    __tablename__ = "tracker_runs"

    job_id: Mapped[int] = mapped_column(ForeignKey("jobs.id", ondelete="CASCADE"), primary_key=True)
    tracker: Mapped[str] = mapped_column(String(16), primary_key=True)
    # The tracker's id of the job's run, once made.
    run_id: Mapped[str | None] = mapped_column(String(200), default=None)
    # The highest step forwarded, and the highest event id (events are forwarded in id order).
    metric_step: Mapped[int] = mapped_column(Integer, default=-1)
    event_id: Mapped[int] = mapped_column(BigInteger, default=0)
    # The job ended and the tracker was told (or the forwarder gave up): nothing more to do.
    done: Mapped[bool] = mapped_column(Boolean, default=False)
    # Forwarding failures in a row, the last one's message, and when to try again.
    failures: Mapped[int] = mapped_column(Integer, default=0)
    last_error: Mapped[str | None] = mapped_column(Text, default=None)
    retry_at: Mapped[datetime | None] = mapped_column(UTCDateTime(), default=None)

    __table_args__ = (Index("ix_tracker_runs_open", "done"),)
