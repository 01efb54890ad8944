"""Read the DB into the typed facts `service.decisions` decides on (no writes, no Ray)."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from sqlalchemy import and_, select
from sqlalchemy.orm import Session

from contracts.messages import WorkerError
from contracts.spec import JobSpec
from service.decisions import AttemptOutcome, AttemptView, JobView, PastFailure
from service.models import Attempt, Job, as_utc
from service.states import ACTIVE, JobState


def attempt_view(row: Attempt) -> AttemptView:
    return AttemptView(
        number=row.number,
        world_size=row.world_size,
        nodes=tuple(row.nodes or ()),
        ended=row.ended_at is not None,
        stop_requested=row.stop_requested,
        report_seq=row.report_seq,
    )


def job_view(job: Job, attempt: Attempt | None, failures: Sequence[PastFailure] = ()) -> JobView:
    return JobView(
        id=job.id,
        state=job.state,
        spec=JobSpec.from_stored(job.spec),
        owner=job.owner,
        step=job.step,
        world_size=job.world_size,
        restarts=job.restarts,
        state_reason=job.state_reason,
        attempt=attempt_view(attempt) if attempt is not None else None,
        cancel_requested=job.cancel_requested,
        checkpoint_requested=job.checkpoint_requested,
        below_min_since=as_utc(job.below_min_since).timestamp()
        if job.below_min_since is not None
        else None,
        failures=tuple(failures),
    )


def view_of(session: Session, job: Job) -> JobView:
    attempt = session.scalars(
        select(Attempt).where(Attempt.job_id == job.id, Attempt.number == job.attempt)
    ).one_or_none()
    return job_view(job, attempt)


def jobs_in(session: Session, states: Iterable[JobState]) -> list[JobView]:
    """Jobs in `states` with their newest attempt, oldest job first (one query)."""
    rows = session.execute(
        select(Job, Attempt)
        .outerjoin(Attempt, and_(Attempt.job_id == Job.id, Attempt.number == Job.attempt))
        .where(Job.state.in_(list(states)))
        .order_by(Job.created_at, Job.id)
    ).all()
    return [job_view(job, attempt) for job, attempt in rows]


def active_jobs(session: Session) -> list[JobView]:
    return jobs_in(session, ACTIVE)


def pending_jobs(session: Session) -> list[JobView]:
    return jobs_in(session, [JobState.PENDING])


def failure_history(session: Session, job_id: int) -> tuple[PastFailure, ...]:
    """The job's failed attempts, oldest first: what failed and at which step."""
    rows = session.scalars(
        select(Attempt.failure)
        .where(Attempt.job_id == job_id, Attempt.outcome == AttemptOutcome.FAILED.value)
        .order_by(Attempt.number)
    ).all()
    history = []
    for failure in rows:
        if not failure:
            continue
        step = failure.get("step")
        history.append(
            PastFailure(
                signature=WorkerError.from_dict(failure).signature,
                step=int(step) if step is not None else -1,
            )
        )
    return tuple(history)


def placed_jobs(session: Session) -> dict[int, list[str]]:
    """Job id -> the node of each rank, for jobs whose live attempt has been placed."""
    rows = session.execute(
        select(Job.id, Attempt.nodes)
        .join(Attempt, and_(Attempt.job_id == Job.id, Attempt.number == Job.attempt))
        .where(Job.state.in_(list(ACTIVE)), Attempt.ended_at.is_(None))
    ).all()
    return {job_id: list(nodes or ()) for job_id, nodes in rows}
