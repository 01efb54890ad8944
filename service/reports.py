"""What running attempts report, stored: metric points, the checkpoint catalogue, and the
driver's report that carries both (with placement, resumes and worker errors as events).

Everything an attempt reports is fenced by its number (`elastrain.service.jobs.check_attempt`):
what an older attempt sends is refused. Like `elastrain.service.jobs`, functions never commit.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any, NamedTuple, cast

from sqlalchemy import Row, Table, and_, bindparam, delete, func, insert, select
from sqlalchemy.orm import Session, load_only

from elastrain.contracts.messages import (
    CheckpointCommitted,
    DriverReport,
    EventKind,
    Resumed,
    SavedTraining,
    StepMetrics,
    Timeline,
    WorkerEvent,
    WorkerFailed,
)
from elastrain.service import telemetry
from elastrain.service.goodput import step_seconds
from elastrain.service.jobs import check_attempt, current_attempt, record_event
from elastrain.service.metric_limits import MetricBudgets, describe
from elastrain.service.metric_store import (
    POINT_COLUMNS,
    BucketKey,
    OpenBuckets,
    update_summaries,
    update_summaries_of,
)
from elastrain.service.metric_summary import Summary
from elastrain.service.models import Attempt, CheckpointRecord, Event, Job, Metric, utcnow


def persist_report(
    session: Session, job: Job, report: DriverReport, *, budgets: MetricBudgets | None = None
) -> None:
    """Store what the current attempt's driver reported, in order, and remember how far
    (`report_seq`), so the next poll acknowledges exactly what was stored. Its metric
    points within `budgets` (`elastrain.service.metric_limits`; None: all of them)."""
    attempt = current_attempt(session, job)
    if attempt is None:
        return
    if report.placement is not None and not attempt.nodes:
        placement = report.placement
        attempt.nodes = list(placement.node_list())
        record_event(
            session,
            job,
            kind=EventKind.PLACEMENT,
            reason=f"{len(placement.nodes)} workers on {len(set(placement.nodes.values()))} node(s)",
            details={
                "ranks": {str(r): n for r, n in sorted(placement.nodes.items())},
                "pids": {str(r): p for r, p in sorted(placement.pids.items())},
            },
        )
    batch: list[StepMetrics] = []
    for message in report.messages:
        if isinstance(message, StepMetrics):
            batch.append(message)
            continue
        record_metrics(session, job, attempt=attempt.number, points=batch, budgets=budgets)
        batch = []
        if isinstance(message, CheckpointCommitted):
            record_checkpoint(
                session,
                job,
                attempt=attempt.number,
                step=message.step,
                world_size=message.world_size or attempt.world_size,
                path=message.path,
                size_bytes=message.bytes,
                manifest=SavedTraining.without_points(message.manifest),
            )
        elif isinstance(message, Resumed):
            backfill_metrics(
                session,
                job,
                attempt=message.saved_attempt,
                points=message.metrics,
                budgets=budgets,
            )
            record_event(
                session,
                job,
                kind=EventKind.RESUMED,
                reason=message.describe(),
                details={
                    "step": message.step,
                    "source": message.source.value,
                    "path": message.path,
                    "saved_world_size": message.saved_world_size,
                    "steps_recomputed": message.steps_recomputed,
                },
            )
        elif isinstance(message, Timeline):
            record_event(
                session,
                job,
                kind=EventKind.TIMELINE,
                reason=message.describe(),
                details={
                    "attempt": attempt.number,
                    "cause": message.cause,
                    "total_s": round(message.total_s, 3),
                    "phases": message.phases(),
                },
            )
        elif isinstance(message, WorkerEvent):
            record_event(session, job, kind=message.event, reason=message.reason,
                         details=message.details)  # fmt: skip
        elif isinstance(message, WorkerFailed):
            record_event(
                session,
                job,
                kind=EventKind.WORKER_ERROR,
                reason=message.error.summary(),
                details=message.error.to_dict(),
            )
    record_metrics(session, job, attempt=attempt.number, points=batch, budgets=budgets)
    _acknowledge(attempt, report)


def is_steady(report: DriverReport, *, placed: bool) -> bool:
    """A report of training steps only, from an attempt whose placement is stored: what
    every running job sends every pass, and what `persist_steady_reports` stores in bulk."""
    return (report.placement is None or placed) and all(
        isinstance(m, StepMetrics) for m in report.messages
    )


class Running(NamedTuple):
    """A running job and its current attempt, as `lock_running` read them."""

    job: Job
    attempt: Attempt


#: Only what a steady report reads and changes (a hundred jobs' specs and other JSON
#: would be decoded every pass for nothing). Reading any other column raises: a lazy load
#: would be a query per job.
_STEADY_COLUMNS = (
    load_only(Job.id, Job.state, Job.attempt, Job.step, Job.latest_loss, Job.compute_s,
              Job.kept_s, Job.stall_s, raiseload=True),
    load_only(Attempt.id, Attempt.job_id, Attempt.number, Attempt.report_seq, raiseload=True),
)  # fmt: skip
_RUNNING = (
    select(Job, Attempt)
    .join(Attempt, and_(Attempt.job_id == Job.id, Attempt.number == Job.attempt))
    .where(Job.id.in_(bindparam("ids", expanding=True)))
    .order_by(Job.id)
    .with_for_update(of=Job)
    .options(*_STEADY_COLUMNS)
)


def lock_running(session: Session, job_ids: Sequence[int]) -> dict[int, Running]:
    """The jobs with their current attempts, the jobs' rows locked for update in id order
    (two lockers of overlapping sets then never wait on each other in a cycle). Jobs
    without an attempt, and missing ids, are left out."""
    rows = session.execute(_RUNNING, {"ids": list(job_ids)})
    return {job.id: Running(job, attempt) for job, attempt in rows}


def appends_only(job: Job, report: DriverReport) -> bool:
    """Whether `report` only adds steps after the job's last stored one (what a running job
    sends every pass), so that `persist_steady_reports` may store it. A report that
    recomputes stored steps (after a resume) replaces rows: `persist_report` stores it."""
    steps = [m.step for m in report.messages if isinstance(m, StepMetrics)]
    return not steps or min(steps) > job.step


@dataclass(frozen=True, slots=True)
class SteadyStored:
    """What `persist_steady_reports` stored, for `metric_store.OpenBuckets` once committed:
    the jobs whose steps it stored (as they are now) and the summaries of every bucket
    those steps fell in."""

    jobs: list[Job]
    summaries: dict[BucketKey, Summary]

    def remember(self, buckets: OpenBuckets) -> None:
        for job in self.jobs:
            buckets.remember(job.id, attempt=job.attempt, step=job.step, stored=self.summaries)


def persist_steady_reports(
    session: Session,
    reports: Sequence[tuple[Running, DriverReport]],
    *,
    buckets: OpenBuckets | None = None,
    budgets: MetricBudgets | None = None,
) -> SteadyStored:
    """Store many running jobs' steady reports (`is_steady` and `appends_only`) as
    `persist_report` stores each, with the same writers, but every job's steps at once
    (`_store_steps`: one insert of all metric rows, one read of the bucket summaries
    `buckets` does not know and one write of those that changed)."""
    steps: list[tuple[Job, int, Sequence[StepMetrics]]] = []
    for (job, attempt), report in reports:
        if not appends_only(job, report):
            raise ValueError(f"job {job.id}: a report that recomputes steps is not steady")
        points = [m for m in report.messages if isinstance(m, StepMetrics)]
        if points:
            steps.append((job, attempt.number, points))
        _acknowledge(attempt, report)
    summaries = _store_steps(session, steps, buckets=buckets, budgets=budgets)
    return SteadyStored(jobs=[job for job, _, _ in steps], summaries=summaries)


def _acknowledge(attempt: Attempt, report: DriverReport) -> None:
    """The attempt's messages up to the report's are stored: the next poll acknowledges
    them, and the driver sends them no more."""
    attempt.report_seq = max(attempt.report_seq, report.seq)


#: Metric rows in bulk through the table: an ORM unit of work spent more in Python than
#: the database spent storing the rows.
_INSERT_METRICS = insert(cast(Table, Metric.__table__))


def _store_steps(
    session: Session,
    steps: Sequence[tuple[Job, int, Sequence[StepMetrics]]],
    *,
    buckets: OpenBuckets | None = None,
    budgets: MetricBudgets | None = None,
) -> dict[BucketKey, Summary]:
    """Store each (job, attempt, points) as the steps that attempt computed (fenced): the
    metric rows, the bucket summaries, the job's last step and loss and its goodput sums.
    Every report's steps are stored here, one job's or many jobs' at once. A point
    re-sent for a step replaces the earlier one; steps at or below the job's last stored
    one (recomputed after a resume) replace their rows, and the replaced seconds stop
    counting as kept training (goodput). Steps after it have no row: every writer of
    metric rows moves the job's step to its newest. Returns the touched buckets'
    summaries as stored now."""
    rows: list[dict[str, Any]] = []
    fresh: dict[int, list[tuple[int, dict[str, Any]]]] = {}
    known: dict[BucketKey, Summary | None] = {}
    for job, attempt, points in steps:
        if not points:
            continue
        check_attempt(job, attempt)
        points = _within_limits(session, job, points, budgets)
        if not points:
            continue
        stored = _last_of_each_step([p.finite() for p in points])
        new_steps = [p.step for p in stored]
        if min(new_steps) <= job.step:
            _drop_recomputed(session, job, new_steps)
        elif buckets is not None:
            cached = buckets.known(job.id, attempt=job.attempt, step=job.step, new_steps=new_steps)
            known.update(cached or {})
        rows += _metric_rows(job, attempt, stored)
        fresh.setdefault(job.id, []).extend((p.step, p.to_values()) for p in stored)
        _advance(job, stored)
    if rows:
        session.execute(_INSERT_METRICS, rows)
    return update_summaries_of(session, fresh, known=known)


def _within_limits(
    session: Session, job: Job, points: Sequence[StepMetrics], budgets: MetricBudgets | None
) -> Sequence[StepMetrics]:
    """The points the job may store (`budgets`; None: all), each limit that cut some said
    once in the job's events and counted on /metrics."""
    if budgets is None:
        return points

    def stored() -> int:
        return session.scalar(select(func.count()).where(Metric.job_id == job.id)) or 0

    def reported() -> set[str]:
        details = session.scalars(
            select(Event.details).where(Event.job_id == job.id, Event.kind == EventKind.LIMIT.value)
        )
        return {str(d.get("limit")) for d in details if d}

    cut = budgets.admit(job.id, points, stored=stored, reported=reported)
    for kind, count in cut.counts.items():
        telemetry.METRIC_POINTS_LIMITED.labels(limit=kind).inc(count)
    for kind in sorted(budgets.first_report(job.id, cut.kinds)):
        # Written as a row: the steady path's jobs are loaded with only what it needs.
        session.add(
            Event(
                job_id=job.id,
                kind=EventKind.LIMIT.value,
                reason=describe(kind, budgets.limits),
                attempt=job.attempt,
                details={"limit": kind},
            )
        )
    return cut.points


def _metric_rows(job: Job, attempt: int, points: Sequence[StepMetrics]) -> list[dict[str, Any]]:
    # `at` takes its column's default.
    return [
        {"job_id": job.id, "step": p.step, "attempt": attempt, "values": p.to_values()}
        for p in points
    ]


def _drop_recomputed(session: Session, job: Job, steps: Sequence[int]) -> None:
    """Delete the job's rows of `steps` (recomputed by a later attempt); their seconds stop
    counting as kept training."""
    where = (Metric.job_id == job.id, Metric.step.in_(steps))
    replaced = session.scalars(select(Metric.values).where(*where)).all()
    if replaced:
        session.execute(delete(Metric).where(*where))
        job.kept_s = (job.kept_s or 0.0) - sum(step_seconds(v)[0] for v in replaced)


def _last_of_each_step(points: Sequence[StepMetrics]) -> list[StepMetrics]:
    """One point per step, the last reported winning (a step re-sent after a retry)."""
    return list({p.step: p for p in points}.values())


def _advance(job: Job, stored: Sequence[StepMetrics]) -> None:
    """The job's goodput sums, last step and last loss after storing `stored`."""
    _account(job, stored)
    last = max(stored, key=lambda p: p.step)
    job.step = max(job.step, last.step)
    if last.loss is not None:
        job.latest_loss = last.loss


def record_metrics(
    session: Session,
    job: Job,
    *,
    attempt: int,
    points: Sequence[StepMetrics | dict[str, Any]],
    budgets: MetricBudgets | None = None,
) -> int:
    """Persist metric points (`StepMetrics`, or dicts with a 'step'); fenced by attempt.
    Returns how many steps were stored."""
    typed = [p if isinstance(p, StepMetrics) else StepMetrics.from_point(p) for p in points]
    _store_steps(session, [(job, attempt, typed)], budgets=budgets)
    return len({p.step for p in typed})


def backfill_metrics(
    session: Session,
    job: Job,
    *,
    attempt: int,
    points: Sequence[StepMetrics],
    budgets: MetricBudgets | None = None,
) -> int:
    """Store the points of steps the job has no row for, as computed by `attempt`: what a
    checkpoint carried of reports that never arrived (they were in flight when that
    attempt was stopped). Steps already stored are left alone, and so is the job's last
    loss. Returns how many."""
    if not points:
        return 0
    steps = {p.step for p in points}
    stored = set(
        session.scalars(select(Metric.step).where(Metric.job_id == job.id, Metric.step.in_(steps)))
    )
    # Only the missing ones are charged to the job's budget: a resume carries up to a few
    # hundred points the service mostly has, and charging those emptied the bucket, so the
    # next attempt's live points were dropped as "too fast" (CI: 25 steps missing after
    # four hand-overs in the drain test).
    missing = _last_of_each_step([p for p in points if p.step not in stored])
    missing = [p.finite() for p in _within_limits(session, job, missing, budgets)]
    if missing:
        session.execute(_INSERT_METRICS, _metric_rows(job, attempt, missing))
        update_summaries(session, job.id, ((p.step, p.to_values()) for p in missing))
        _account(job, missing)
        job.step = max(job.step, max(p.step for p in missing))
    return len(missing)


def _account(job: Job, points: Sequence[StepMetrics]) -> None:
    """Add newly stored points' seconds to the job's goodput sums."""
    for point in points:
        step_s, stall_s = point.step_time_s or 0.0, point.checkpoint_stall_s or 0.0
        job.compute_s = (job.compute_s or 0.0) + step_s
        job.kept_s = (job.kept_s or 0.0) + step_s
        job.stall_s = (job.stall_s or 0.0) + stall_s


def list_metrics(
    session: Session,
    job_id: int,
    *,
    since_step: int = 0,
    until_step: int | None = None,
    limit: int = 10_000,
) -> Sequence[Row[Any]]:
    """Rows of `metric_store.POINT_COLUMNS` (step, attempt, at, values), in step order."""
    where = [Metric.job_id == job_id, Metric.step >= since_step]
    if until_step is not None:
        where.append(Metric.step <= until_step)
    return session.execute(
        select(*POINT_COLUMNS).where(*where).order_by(Metric.step).limit(limit)
    ).all()


def list_checkpoints(session: Session, job_id: int) -> Sequence[CheckpointRecord]:
    return session.scalars(
        select(CheckpointRecord)
        .where(CheckpointRecord.job_id == job_id)
        .order_by(CheckpointRecord.step.desc())
    ).all()


def delete_checkpoint_rows(session: Session, job: Job, *, paths: Sequence[str]) -> None:
    """Drop catalogue rows of checkpoints that retention deletes."""
    if paths:
        session.execute(
            delete(CheckpointRecord).where(
                CheckpointRecord.job_id == job.id, CheckpointRecord.path.in_(list(paths))
            )
        )


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
