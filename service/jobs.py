"""Job records: creation, queries, and the one function that changes a job's state.

Functions take a `Session` and keyword-only arguments, and never commit: the caller's
transaction (`service.db.session_scope`) decides, so a state change and its event land
together or not at all.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from sqlalchemy import Row, bindparam, delete, func, insert, select
from sqlalchemy.orm import Session

from service.models import Attempt, CheckpointRecord, Event, Job, JobLabel, Metric, utcnow
from service.spec import JobSpec
from service.states import IllegalTransition, JobState, can_transition


class JobNotFound(LookupError):
    def __init__(self, job_id: int) -> None:
        super().__init__(f"job {job_id} not found")
        self.job_id = job_id


class StaleAttempt(Exception):
    """A report from an attempt older than the job's current one (fencing)."""

    def __init__(self, job_id: int, attempt: int, current: int) -> None:
        super().__init__(
            f"job {job_id}: report from attempt {attempt} rejected; current attempt is {current}"
        )
        self.job_id = job_id
        self.attempt = attempt
        self.current = current


# The submit and get-by-id statements, built once: building a statement per call cost more
# CPU than executing it (about 0.1-0.4 ms a request, most on PostgreSQL).
_JOBS = Job.__table__
_INSERT_JOB = insert(_JOBS).returning(*_JOBS.c)
_INSERT_LABELS = insert(JobLabel.__table__)
_INSERT_EVENT = insert(Event.__table__)
_SELECT_JOB = select(_JOBS).where(_JOBS.c.id == bindparam("job_id"))


def job_row_values(spec: JobSpec, *, owner: str) -> dict[str, Any]:
    """The `jobs` columns a new job starts with (also used by bulk loaders such as benches)."""
    return {
        "owner": owner,
        "name": spec.name,
        "spec": spec.model_dump(mode="json"),
        "state": JobState.PENDING,
        "priority": spec.priority,
        "strategy": spec.strategy.kind.value,
        "min_workers": spec.scaling.min_workers,
        "max_workers": spec.scaling.max_workers,
        "max_steps": spec.training.max_steps,
    }


def insert_job(session: Session, *, spec: JobSpec, owner: str = "default") -> Row[Any]:
    """Store a submitted job (its row, labels and "submitted" event); returns the job's row.

    Core statements, not the ORM unit of work: one INSERT ... RETURNING for the job, one
    multi-row INSERT for the labels, one for the event. That is about half the CPU of
    `session.add` + two flushes, and the submit route is the API's hottest write
    (docs/bench-api.md). The row has every column, so it answers the request by itself.
    """
    job = session.execute(_INSERT_JOB, job_row_values(spec, owner=owner)).one()
    if spec.labels:
        session.execute(
            _INSERT_LABELS,
            [{"job_id": job.id, "key": k, "value": v} for k, v in spec.labels.items()],
        )
    session.execute(
        _INSERT_EVENT,
        {"job_id": job.id, "to_state": JobState.PENDING.value, "reason": "submitted", "attempt": 0},
    )
    return job


def create_job(session: Session, *, spec: JobSpec, owner: str = "default") -> Job:
    """`insert_job`, returning the ORM object (for code that goes on to change the job)."""
    job = session.get(Job, insert_job(session, spec=spec, owner=owner).id)
    assert job is not None
    return job


def get_job(session: Session, job_id: int, *, for_update: bool = False) -> Job:
    stmt = select(Job).where(Job.id == job_id)
    if for_update:
        stmt = stmt.with_for_update()
    job = session.scalars(stmt).one_or_none()
    if job is None:
        raise JobNotFound(job_id)
    return job


def get_job_row(session: Session, job_id: int) -> Row[Any]:
    """The job's columns as a Core row: for read-only answers, no ORM identity map."""
    job = session.execute(_SELECT_JOB, {"job_id": job_id}).one_or_none()
    if job is None:
        raise JobNotFound(job_id)
    return job


def job_spec(job: Job) -> JobSpec:
    return JobSpec.model_validate(job.spec)


@dataclass(frozen=True, slots=True)
class JobPage:
    items: Sequence[Job]
    total: int


def list_jobs(
    session: Session,
    *,
    states: Sequence[JobState] = (),
    labels: dict[str, str] | None = None,
    owner: str | None = None,
    limit: int = 50,
    offset: int = 0,
) -> JobPage:
    """Newest first, filtered by any of `states` and all of `labels`."""
    stmt = select(Job)
    if states:
        stmt = stmt.where(Job.state.in_(list(states)))
    if owner is not None:
        stmt = stmt.where(Job.owner == owner)
    for key, value in (labels or {}).items():
        stmt = stmt.where(
            select(JobLabel.job_id)
            .where(JobLabel.job_id == Job.id, JobLabel.key == key, JobLabel.value == value)
            .exists()
        )
    total = session.scalar(select(func.count()).select_from(stmt.subquery())) or 0
    items = session.scalars(
        stmt.order_by(Job.created_at.desc(), Job.id.desc()).limit(limit).offset(offset)
    ).all()
    return JobPage(items=items, total=total)


def set_job_state(
    session: Session,
    job: Job,
    to_state: JobState,
    *,
    reason: str,
    world_size: int | None = None,
    details: dict[str, Any] | None = None,
    force: bool = False,
) -> Event:
    """The only way a job's state changes: checks the transition, writes the event.

    `world_size` is the world size after the transition (defaults to unchanged). Raises
    `IllegalTransition` unless the state machine allows the move (or `force` is set, which
    only the control plane's own repair paths use).
    """
    from_state = job.state
    if not force and not can_transition(from_state, to_state):
        raise IllegalTransition(job.id, from_state, to_state)
    before = job.world_size
    after = before if world_size is None else world_size
    job.state = to_state
    job.state_reason = reason
    job.world_size = after
    now = utcnow()
    if to_state == JobState.RUNNING and job.started_at is None:
        job.started_at = now
    if to_state.is_terminal:
        job.finished_at = now
    event = Event(
        job_id=job.id,
        at=now,
        from_state=from_state.value,
        to_state=to_state.value,
        reason=reason,
        world_size_before=before,
        world_size_after=after,
        attempt=job.attempt,
        step=job.step,
        details=details,
    )
    session.add(event)
    return event


def record_event(
    session: Session, job: Job, *, kind: str, reason: str, details: dict[str, Any] | None = None
) -> Event:
    """A notable happening that is not a state change (checkpoint fallback, node lost...)."""
    event = Event(
        job_id=job.id,
        kind=kind,
        reason=reason,
        world_size_before=job.world_size,
        world_size_after=job.world_size,
        attempt=job.attempt,
        step=job.step,
        details=details,
    )
    session.add(event)
    return event


def check_attempt(job: Job, attempt: int) -> None:
    if attempt != job.attempt:
        raise StaleAttempt(job.id, attempt, job.attempt)


def start_attempt(session: Session, job: Job, *, world_size: int, driver_name: str) -> Attempt:
    """Open attempt `job.attempt + 1`. Every later report must carry this number."""
    job.attempt += 1
    attempt = Attempt(
        job_id=job.id, number=job.attempt, world_size=world_size, driver_name=driver_name
    )
    session.add(attempt)
    return attempt


def end_attempt(
    session: Session, job: Job, *, number: int, outcome: str, error: str | None = None
) -> None:
    row = session.scalars(
        select(Attempt).where(Attempt.job_id == job.id, Attempt.number == number)
    ).one_or_none()
    if row is not None and row.ended_at is None:
        row.ended_at = utcnow()
        row.outcome = outcome
        row.error = error


def current_attempt(session: Session, job: Job) -> Attempt | None:
    return session.scalars(
        select(Attempt).where(Attempt.job_id == job.id, Attempt.number == job.attempt)
    ).one_or_none()


def record_metrics(
    session: Session, job: Job, *, attempt: int, points: Sequence[dict[str, Any]]
) -> int:
    """Persist metric points (each has 'step'); fenced by attempt. Returns how many."""
    check_attempt(job, attempt)
    if not points:
        return 0
    steps = [int(p["step"]) for p in points]
    # A recomputed step (after a resume) replaces what an earlier attempt reported.
    session.execute(delete(Metric).where(Metric.job_id == job.id, Metric.step.in_(steps)))
    seen: set[int] = set()
    for point in reversed(points):  # the last report of a step wins
        step = int(point["step"])
        if step in seen:
            continue
        seen.add(step)
        values = {k: v for k, v in point.items() if k != "step"}
        session.add(Metric(job_id=job.id, step=step, attempt=attempt, values=values))
    last = max(points, key=lambda p: int(p["step"]))
    job.step = max(job.step, int(last["step"]))
    if last.get("loss") is not None:
        job.latest_loss = float(last["loss"])
    return len(seen)


def list_metrics(
    session: Session, job_id: int, *, since_step: int = 0, limit: int = 10_000
) -> Sequence[Metric]:
    return session.scalars(
        select(Metric)
        .where(Metric.job_id == job_id, Metric.step >= since_step)
        .order_by(Metric.step)
        .limit(limit)
    ).all()


def list_events(session: Session, job_id: int) -> Sequence[Event]:
    return session.scalars(select(Event).where(Event.job_id == job_id).order_by(Event.id)).all()


def list_checkpoints(session: Session, job_id: int) -> Sequence[CheckpointRecord]:
    return session.scalars(
        select(CheckpointRecord)
        .where(CheckpointRecord.job_id == job_id)
        .order_by(CheckpointRecord.step.desc())
    ).all()


def record_checkpoint(
    session: Session,
    job: Job,
    *,
    attempt: int,
    step: int,
    world_size: int,
    path: str,
    size_bytes: int,
    manifest: dict[str, Any] | None = None,
    committed_at: datetime | None = None,
) -> CheckpointRecord:
    """Catalogue a committed checkpoint; fenced by attempt, idempotent per (job, step)."""
    check_attempt(job, attempt)
    existing = session.scalars(
        select(CheckpointRecord).where(
            CheckpointRecord.job_id == job.id, CheckpointRecord.step == step
        )
    ).one_or_none()
    if existing is not None:
        session.delete(existing)
        session.flush()
    row = CheckpointRecord(
        job_id=job.id,
        step=step,
        attempt=attempt,
        world_size=world_size,
        path=path,
        bytes=size_bytes,
        manifest=manifest,
        committed_at=committed_at or utcnow(),
    )
    session.add(row)
    return row
