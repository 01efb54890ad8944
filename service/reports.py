"""What running attempts report, stored: metric points, the checkpoint catalogue, and the
driver's report that carries both (with placement, resumes and worker errors as events).

Everything an attempt reports is fenced by its number (`service.jobs.check_attempt`):
what an older attempt sends is refused. Like `service.jobs`, functions never commit.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import replace
from datetime import datetime
from typing import Any, cast

from sqlalchemy import Row, Table, delete, insert, select
from sqlalchemy.orm import Session

from contracts.messages import (
    CheckpointCommitted,
    DriverReport,
    EventKind,
    Resumed,
    StepMetrics,
    Timeline,
    WorkerEvent,
    WorkerFailed,
)
from service.goodput import step_seconds
from service.jobs import check_attempt, current_attempt, record_event
from service.metric_store import POINT_COLUMNS, update_summaries, update_summaries_of
from service.models import Attempt, CheckpointRecord, Job, Metric, utcnow

#: Metric rows in bulk through the table (see `persist_steady_reports`).
_INSERT_METRICS = insert(cast(Table, Metric.__table__))


def persist_report(session: Session, job: Job, report: DriverReport) -> None:
    """Store what the current attempt's driver reported, in order, and remember how far
    (`report_seq`), so the next poll acknowledges exactly what was stored."""
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
        record_metrics(session, job, attempt=attempt.number, points=batch)
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
                manifest=_without_metrics(message.manifest),
            )
        elif isinstance(message, Resumed):
            backfill_metrics(session, job, attempt=message.saved_attempt, points=message.metrics)
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
    record_metrics(session, job, attempt=attempt.number, points=batch)
    attempt.report_seq = max(attempt.report_seq, report.seq)


def storable(point: StepMetrics) -> StepMetrics:
    """`point` with its non-finite numbers as null: JSON has no NaN or Infinity and
    PostgreSQL refuses them, so one diverged loss would otherwise fail every transaction
    that stores its report, and the job's metrics would stop there. The chart shows a gap."""
    if _finite(point.values):
        return point
    return replace(point, values=_nulled(point.values))


def _finite(value: Any) -> bool:
    if isinstance(value, float):
        return math.isfinite(value)
    if isinstance(value, dict):
        return all(_finite(v) for v in value.values())
    if isinstance(value, list | tuple):
        return all(_finite(v) for v in value)
    return True


def _nulled(value: Any) -> Any:
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: _nulled(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_nulled(v) for v in value]
    return value


def is_steady(report: DriverReport, *, placed: bool) -> bool:
    """A report of training steps only, from an attempt whose placement is stored: what
    every running job sends every pass, and what `persist_steady_reports` stores in bulk."""
    return (report.placement is None or placed) and all(
        isinstance(m, StepMetrics) for m in report.messages
    )


def persist_steady_reports(
    session: Session, reports: Sequence[tuple[Job, Attempt, DriverReport]]
) -> None:
    """Store many jobs' steady reports (`is_steady`) as `persist_report` would, in a fixed
    number of statements whatever the number of jobs: one insert of every new metric row,
    one read and one upsert of the bucket summaries they touch; the jobs' and attempts'
    changed columns are flushed with the transaction. A report that may replace stored
    rows (a step at or below the job's last stored step: a recomputation after a resume)
    takes `record_metrics`' path, which reads what it replaces."""
    rows: list[dict[str, Any]] = []
    fresh: dict[int, list[tuple[int, dict[str, Any]]]] = {}
    for job, attempt, report in reports:
        points = [storable(m) for m in report.messages if isinstance(m, StepMetrics)]
        if points:
            check_attempt(job, attempt.number)
            if min(p.step for p in points) <= job.step:
                record_metrics(session, job, attempt=attempt.number, points=points)
            else:
                stored = _last_of_each_step(points)
                rows.extend(
                    {"job_id": job.id, "step": p.step, "attempt": attempt.number,
                     "values": p.values}
                    for p in stored
                )  # fmt: skip
                fresh[job.id] = [(p.step, p.values) for p in stored]
                _advance(job, stored)
        attempt.report_seq = max(attempt.report_seq, report.seq)
    if rows:
        # The table, not the ORM entity: an ORM bulk insert spent more in Python than the
        # database spent storing the rows. `at` takes its column default.
        session.execute(_INSERT_METRICS, rows)
    update_summaries_of(session, fresh)


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
) -> int:
    """Persist metric points (`StepMetrics`, or dicts with a 'step'); fenced by attempt.
    Returns how many steps were stored."""
    if not points:
        return 0
    check_attempt(job, attempt)
    typed = [
        storable(p if isinstance(p, StepMetrics) else StepMetrics.from_point(p)) for p in points
    ]
    steps = [p.step for p in typed]
    # A recomputed step (after a resume) replaces what an earlier attempt reported: its
    # seconds stop counting as kept training (goodput).
    where = (Metric.job_id == job.id, Metric.step.in_(steps))
    replaced = session.scalars(select(Metric.values).where(*where)).all()
    if replaced:
        session.execute(delete(Metric).where(*where))
        job.kept_s = (job.kept_s or 0.0) - sum(step_seconds(v)[0] for v in replaced)
    stored = _last_of_each_step(typed)
    for point in stored:
        session.add(Metric(job_id=job.id, step=point.step, attempt=attempt, values=point.values))
    update_summaries(session, job.id, ((p.step, p.values) for p in stored))
    _advance(job, stored)
    return len(stored)


def backfill_metrics(
    session: Session, job: Job, *, attempt: int, points: Sequence[StepMetrics]
) -> int:
    """Store the points of steps the job has no row for, as computed by `attempt`: what a
    checkpoint carried of reports that never arrived (they were in flight when that
    attempt was stopped). Steps already stored are left alone. Returns how many."""
    if not points:
        return 0
    points = [storable(p) for p in points]
    steps = {p.step for p in points}
    stored = set(
        session.scalars(select(Metric.step).where(Metric.job_id == job.id, Metric.step.in_(steps)))
    )
    missing = [p for p in points if p.step not in stored]
    for point in missing:
        session.add(Metric(job_id=job.id, step=point.step, attempt=attempt, values=point.values))
    update_summaries(session, job.id, ((p.step, p.values) for p in missing))
    _account(job, missing)
    if missing:
        job.step = max(job.step, max(p.step for p in missing))
    return len(missing)


def _account(job: Job, points: Sequence[StepMetrics]) -> None:
    """Add newly stored points' seconds to the job's goodput sums."""
    for point in points:
        step_s, stall_s = step_seconds(point.values)
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


def _without_metrics(manifest: dict[str, Any] | None) -> dict[str, Any] | None:
    """The manifest as catalogued: without the metric points it carries (they are in the
    metrics table already; a resume hands back the ones that were not)."""
    if not manifest or "metrics" not in manifest.get("extra", {}):
        return manifest
    extra = {k: v for k, v in manifest["extra"].items() if k != "metrics"}
    return {**manifest, "extra": extra}
