"""Job records: creation, queries, and one function per kind of change to a job.

A job's state and the fields that go with it (reason, world size, restarts, last error,
the wait below min) change only here, each with its event. What its attempts report
(metrics, checkpoints) is stored by `elastrain.service.reports`. The scheduler reaches these
through `elastrain.service.executor`, which applies the actions of `elastrain.service.decisions.decide`.

Functions take a `Session` and keyword-only arguments, and never commit: the caller's
transaction (`elastrain.service.db.session_scope`) decides, so a change and its event land together
or not at all.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any, cast

from sqlalchemy import Row, Table, bindparam, func, insert, select
from sqlalchemy.orm import Session

from elastrain.contracts.messages import (
    EventKind,
    WorkerError,
)
from elastrain.contracts.spec import JobSpec
from elastrain.service.models import Attempt, Event, Job, JobLabel, TrackerRun, as_utc, utcnow
from elastrain.service.states import IllegalTransition, JobState, can_transition


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


# Built once: building and cache-keying a statement per call cost more than running it.
_JOBS = cast(Table, Job.__table__)
_INSERT_JOB = insert(_JOBS).returning(*_JOBS.c)
_INSERT_LABELS = insert(cast(Table, JobLabel.__table__))
_INSERT_EVENT = insert(cast(Table, Event.__table__))
_INSERT_TRACKERS = insert(cast(Table, TrackerRun.__table__))
_SELECT_JOB = select(_JOBS).where(_JOBS.c.id == bindparam("job_id"))


def job_row_values(spec: JobSpec, *, owner: str) -> dict[str, Any]:
    """The `jobs` columns a new job starts with that its spec gives (the others take their
    defaults); also used by bulk loaders such as benches."""
    return {
        "owner": owner,
        "name": spec.name,
        "spec": spec.model_dump(mode="json"),
        "state": JobState.PENDING,
        "priority": spec.priority,
        "strategy": spec.strategy.label,
        "min_workers": spec.scaling.min_workers,
        "max_workers": spec.scaling.max_workers,
        "max_steps": spec.training.max_steps,
    }


def queued_jobs(session: Session, owner: str) -> int:
    """How many of `owner`'s jobs wait in the queue (PENDING)."""
    return (
        session.scalar(
            select(func.count())
            .select_from(Job)
            .where(Job.state == JobState.PENDING.value, Job.owner == owner)
        )
        or 0
    )


def insert_job(session: Session, *, spec: JobSpec, owner: str = "default") -> Row[Any]:
    """Store a submitted job: its row, its labels, its trackers' cursors and its "submitted"
    event, in the session's transaction (the caller commits); returns the job's row, every
    column of it, so that it answers the submit without reading the row back.

    A few Core statements, the same on every database: the job's INSERT ... RETURNING, one
    INSERT of all its labels, one of its trackers' cursors, one of its event. Not the ORM's unit of work: that costs the
    API measurably more CPU per submit (docs/bench-api.md)."""
    job = session.execute(_INSERT_JOB, job_row_values(spec, owner=owner)).one()
    if spec.labels:
        session.execute(
            _INSERT_LABELS,
            [{"job_id": job.id, "key": k, "value": v} for k, v in spec.labels.items()],
        )
    if spec.tracking.names:  # followed by the forwarder (elastrain.service.tracking) from now on
        session.execute(
            _INSERT_TRACKERS,
            [
                {"job_id": job.id, "tracker": name, "metric_step": -1, "event_id": 0,
                 "done": False, "failures": 0}
                for name in spec.tracking.names
            ],
        )  # fmt: skip
    session.execute(
        _INSERT_EVENT,
        _event_values(
            job.id,
            kind=EventKind.TRANSITION,
            reason="submitted",
            to_state=JobState.PENDING,
            at=job.created_at,
        ),
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
    return JobSpec.from_stored(job.spec)


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


def _event_values(
    job_id: int,
    *,
    kind: EventKind,
    reason: str,
    from_state: JobState | None = None,
    to_state: JobState | None = None,
    world_size_before: int | None = None,
    world_size_after: int | None = None,
    attempt: int = 0,
    step: int | None = None,
    details: dict[str, Any] | None = None,
    at: datetime | None = None,
) -> dict[str, Any]:
    """An event row's columns: the one place events are built (ORM and Core inserts)."""
    return {
        "job_id": job_id,
        "at": at or utcnow(),
        "kind": kind.value,
        "from_state": from_state.value if from_state is not None else None,
        "to_state": to_state.value if to_state is not None else None,
        "reason": reason,
        "world_size_before": world_size_before,
        "world_size_after": world_size_after,
        "attempt": attempt,
        "step": step,
        "details": details,
    }


def set_job_state(
    session: Session,
    job: Job,
    to_state: JobState,
    *,
    reason: str,
    world_size: int | None = None,
    details: dict[str, Any] | None = None,
) -> Event:
    """The only way a job's state changes: checks the transition, writes the event.

    `world_size` is the world size after the transition (defaults to unchanged). Raises
    `IllegalTransition` unless the state machine allows the move.
    """
    from_state = job.state
    if not can_transition(from_state, to_state):
        raise IllegalTransition(job.id, from_state, to_state)
    before = job.world_size
    after = before if world_size is None else world_size
    now = utcnow()
    # Goodput: the state being left gets its seconds (elastrain.service.goodput).
    since = job.state_since or job.created_at
    spent = max(0.0, (now - as_utc(since)).total_seconds())
    seconds_in = dict(job.seconds_in or {})
    seconds_in[from_state.value] = round(seconds_in.get(from_state.value, 0.0) + spent, 3)
    job.seconds_in = seconds_in
    job.state_since = now
    job.state = to_state
    job.state_reason = reason
    job.world_size = after
    # A job short enough to finish between two scheduler passes goes from STARTING straight
    # to SUCCEEDED: it trained all the same.
    if to_state in (JobState.RUNNING, JobState.SUCCEEDED) and job.started_at is None:
        job.started_at = now
    if to_state.is_terminal:
        job.finished_at = now
        job.below_min_since = None
    event = Event(
        **_event_values(
            job.id,
            kind=EventKind.TRANSITION,
            reason=reason,
            from_state=from_state,
            to_state=to_state,
            world_size_before=before,
            world_size_after=after,
            attempt=job.attempt,
            step=job.step,
            details=details,
            at=now,
        )
    )
    session.add(event)
    return event


def record_event(
    session: Session,
    job: Job,
    *,
    kind: EventKind,
    reason: str,
    details: dict[str, Any] | None = None,
) -> Event:
    """A notable happening that is not a state change (checkpoint fallback, node lost...)."""
    event = Event(
        **_event_values(
            job.id,
            kind=kind,
            reason=reason,
            world_size_before=job.world_size,
            world_size_after=job.world_size,
            attempt=job.attempt,
            step=job.step,
            details=details,
        )
    )
    session.add(event)
    return event


def set_state_reason(job: Job, *, reason: str) -> None:
    """Why the job is where it is (e.g. why it waits in the queue); no event."""
    job.state_reason = reason


def start_waiting(session: Session, job: Job, *, reason: str, since: datetime) -> None:
    """Fewer than min_workers fit: the job waits (and times out counting from `since`)."""
    job.below_min_since = since
    job.state_reason = reason
    record_event(session, job, kind=EventKind.BELOW_MIN, reason=reason)


def stop_waiting(session: Session, job: Job, *, reason: str) -> None:
    job.below_min_since = None
    record_event(session, job, kind=EventKind.CAPACITY, reason=reason)


def request_cancel(session: Session, job: Job) -> bool:
    """Record a user's cancel; the job's next decision acts on it. False if already asked."""
    if job.cancel_requested:
        return False
    job.cancel_requested = True
    return True


def request_checkpoint(session: Session, job: Job) -> bool:
    """Record a user's "checkpoint now"; the scheduler passes it to the driver."""
    if job.checkpoint_requested:
        return False
    job.checkpoint_requested = True
    record_event(
        session, job, kind=EventKind.CHECKPOINT_REQUESTED, reason="checkpoint requested by user"
    )
    return True


def checkpoint_request_sent(
    session: Session, job: Job, *, reason: str = "checkpoint now (user)"
) -> None:
    job.checkpoint_requested = False
    record_event(session, job, kind=EventKind.CHECKPOINT_REQUESTED, reason=reason)


def check_attempt(job: Job, attempt: int) -> None:
    if attempt != job.attempt:
        raise StaleAttempt(job.id, attempt, job.attempt)


def start_attempt(session: Session, job: Job, *, world_size: int, driver_name: str) -> Attempt:
    """Open attempt `job.attempt + 1`. Every later report must carry this number."""
    job.attempt += 1
    job.state_reason = f"launching attempt {job.attempt} at world size {world_size}"
    attempt = Attempt(
        job_id=job.id,
        number=job.attempt,
        world_size=world_size,
        driver_name=driver_name,
        stop_requested=False,
        report_seq=0,
    )
    session.add(attempt)
    return attempt


def end_attempt(
    session: Session,
    job: Job,
    *,
    outcome: str,
    error: WorkerError | None = None,
    step: int | None = None,
    count_restart: bool = False,
) -> Attempt | None:
    """Close the job's current attempt. A failure is also the job's `last_error`, and may
    count against `failure.max_restarts`."""
    row = current_attempt(session, job)
    if row is None or row.ended_at is not None:
        return None
    row.ended_at = utcnow()
    row.outcome = outcome
    if error is not None:
        row.error = error.summary()[-2000:]
        row.failure = {**error.to_dict(), "step": step if step is not None else error.step}
        job.last_error = error.summary()
    if count_restart:
        job.restarts += 1
    return row


def request_stop(session: Session, job: Job) -> None:
    """The current attempt is asked to checkpoint and stop (a resize)."""
    row = current_attempt(session, job)
    if row is not None:
        row.stop_requested = True


def last_entered(session: Session, job: Job, state: JobState) -> datetime | None:
    """When the job last moved to `state` (None: never)."""
    return session.scalars(
        select(Event.at)
        .where(Event.job_id == job.id, Event.to_state == state.value)
        .order_by(Event.id.desc())
        .limit(1)
    ).first()


def last_entry(session: Session, job: Job, state: JobState) -> Event | None:
    """The event of the job's last move to `state` (None: never)."""
    return session.scalars(
        select(Event)
        .where(Event.job_id == job.id, Event.to_state == state.value)
        .order_by(Event.id.desc())
        .limit(1)
    ).first()


def current_attempt(session: Session, job: Job) -> Attempt | None:
    return session.scalars(
        select(Attempt).where(Attempt.job_id == job.id, Attempt.number == job.attempt)
    ).one_or_none()


def list_events(session: Session, job_id: int) -> Sequence[Event]:
    return session.scalars(select(Event).where(Event.job_id == job_id).order_by(Event.id)).all()
