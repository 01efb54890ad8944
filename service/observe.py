"""Read the DB into the typed facts `elastrain.service.decisions` decides on (no writes, no Ray)."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

from sqlalchemy import and_, select
from sqlalchemy.orm import Session

from elastrain.contracts.messages import WorkerError
from elastrain.contracts.spec import JobSpec
from elastrain.service.decisions import AttemptOutcome, AttemptView, JobView, PastFailure
from elastrain.service.models import Attempt, Job, as_utc
from elastrain.service.states import ACTIVE, JobState


def view_of(session: Session, job: Job) -> JobView:
    """The view of one job as it stands in this session (its pending changes flushed)."""
    row = session.execute(_VIEWS.where(Job.id == job.id)).one()
    return _view_of_row(row, JobSpec.from_stored(job.spec))


class ViewCache:
    """The views of the jobs a scheduler pass reads, by job id, built anew only from rows
    that changed since the last pass, and their parsed specs (a spec never changes after
    submit). A pass reads every queued and running job: parsing each spec (JSON, then
    validation) was most of a pass with a thousand jobs queued, and building a thousand
    views from rows that mostly did not change then was the largest part of reading them."""

    def __init__(self) -> None:
        self._specs: dict[int, JobSpec] = {}
        self._views: dict[int, tuple[tuple[Any, ...], JobView]] = {}
        self.unreadable: dict[int, str] = {}
        """Jobs of the last `specs` call whose stored spec does not read back (a row
        written around the API, or from before a bound): job id -> why. They get no view:
        the scheduler fails them, and decides about every other job as usual."""

    def specs(self, session: Session, ids: Sequence[int]) -> dict[int, JobSpec]:
        """The specs of `ids`, reading only those not seen before; forgets the others
        (jobs that left the states asked about), and their views."""
        missing = [i for i in ids if i not in self._specs]
        self.unreadable = {}
        for start in range(0, len(missing), 500):
            chunk = missing[start : start + 500]
            for job_id, raw in session.execute(select(Job.id, Job.spec).where(Job.id.in_(chunk))):
                try:
                    self._specs[job_id] = JobSpec.from_stored(raw)
                except Exception as exc:  # any row, any error: never the whole pass
                    self.unreadable[job_id] = unreadable_reason(exc)
        self._specs = {i: self._specs[i] for i in ids if i in self._specs}
        self._views = {i: v for i, v in self._views.items() if i in self._specs}
        return self._specs

    def view(self, row: Any) -> JobView:
        """The view of a `_VIEW_COLUMNS` row whose job's spec `specs` has read: the last
        one built when the row is the same (views are immutable)."""
        values = tuple(row)
        seen = self._views.get(values[0])
        if seen is not None and seen[0] == values:
            return seen[1]
        view = _view_of_row(row, self._specs[values[0]])
        self._views[values[0]] = (values, view)
        return view


#: What a decision reads of a job and of its newest attempt: plain columns, no ORM objects
#: (building a thousand queued jobs' objects every pass cost more than the query).
_VIEW_COLUMNS = (
    Job.id, Job.state, Job.owner, Job.step, Job.world_size, Job.restarts, Job.state_reason,
    Job.cancel_requested, Job.checkpoint_requested, Job.below_min_since, Job.created_at,
    Attempt.number.label("a_number"), Attempt.world_size.label("a_world_size"),
    Attempt.nodes.label("a_nodes"), Attempt.ended_at.label("a_ended_at"),
    Attempt.stop_requested.label("a_stop_requested"), Attempt.report_seq.label("a_report_seq"),
    Attempt.driver_name.label("a_name"), Attempt.started_at.label("a_started_at"),
)  # fmt: skip


#: Each job with its newest attempt, if any.
_VIEWS = select(*_VIEW_COLUMNS).outerjoin(
    Attempt, and_(Attempt.job_id == Job.id, Attempt.number == Job.attempt)
)


def jobs_in(
    session: Session, states: Iterable[JobState], *, cache: ViewCache | None = None
) -> list[JobView]:
    """Jobs in `states` with their newest attempt, oldest job first: one query, and one
    more for the specs `cache` does not hold yet (all of them without a cache)."""
    rows = session.execute(
        _VIEWS.where(Job.state.in_(list(states))).order_by(Job.created_at, Job.id)
    ).all()
    cache = cache or ViewCache()
    specs = cache.specs(session, [row.id for row in rows])
    return [cache.view(row) for row in rows if row.id in specs]


def unreadable_reason(exc: Exception) -> str:
    """Why a stored spec does not read back, in a job's reason: the fields and what is
    wrong with them (pydantic's errors), or the exception's own words."""
    errors = getattr(exc, "errors", None)
    if callable(errors):
        try:
            found = errors()
            parts = [
                f"{'.'.join(str(p) for p in e['loc']) or 'spec'}: "
                f"{str(e['msg']).removeprefix('Value error, ')}"
                for e in found[:5]
            ]
            return "its stored spec is invalid: " + "; ".join(parts)
        except Exception:  # not pydantic's shape after all
            pass
    return f"its stored spec is invalid: {type(exc).__name__}: {exc}"[:1000]


def _view_of_row(row: Any, spec: JobSpec) -> JobView:
    """A JobView of a `_VIEW_COLUMNS` row."""
    attempt = None
    if row.a_number is not None:
        attempt = AttemptView(
            number=row.a_number,
            world_size=row.a_world_size,
            nodes=tuple(row.a_nodes or ()),
            ended=row.a_ended_at is not None,
            stop_requested=row.a_stop_requested,
            report_seq=row.a_report_seq,
            name=row.a_name,
            started_at=as_utc(row.a_started_at).timestamp(),
        )
    since = row.below_min_since
    return JobView(
        id=row.id,
        state=row.state,
        spec=spec,
        owner=row.owner,
        step=row.step,
        world_size=row.world_size,
        restarts=row.restarts,
        state_reason=row.state_reason,
        attempt=attempt,
        cancel_requested=row.cancel_requested,
        checkpoint_requested=row.checkpoint_requested,
        below_min_since=as_utc(since).timestamp() if since is not None else None,
        submitted_at=as_utc(row.created_at).timestamp(),
    )


def active_jobs(session: Session, *, cache: ViewCache | None = None) -> list[JobView]:
    return jobs_in(session, ACTIVE, cache=cache)


def pending_jobs(session: Session, *, cache: ViewCache | None = None) -> list[JobView]:
    return jobs_in(session, [JobState.PENDING], cache=cache)


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
