"""What running attempts report, stored: metric points, the checkpoint catalogue, and the
driver's report that carries both (with placement, resumes and worker errors as events).

Everything an attempt reports is fenced by its number (`service.jobs.check_attempt`):
what an older attempt sends is refused. Like `service.jobs`, functions never commit.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass, replace
from datetime import datetime
from typing import Any, cast

from sqlalchemy import (
    ARRAY,
    BigInteger,
    Executable,
    Row,
    Table,
    TextClause,
    and_,
    any_,
    bindparam,
    delete,
    insert,
    select,
    text,
    update,
)
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
from service.metric_store import (
    POINT_COLUMNS,
    BucketKey,
    OpenBuckets,
    update_summaries,
    update_summaries_of,
)
from service.metric_summary import Summary
from service.models import Attempt, CheckpointRecord, Job, Metric, utcnow
from service.states import JobState

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


@dataclass(slots=True)
class Running:
    """A running job's columns that a steady report changes (and those that say whether the
    job moved), with its current attempt's, as `lock_running` read them under the job's row
    lock: plain columns, written back by `persist_steady_reports` in one statement per
    table (loading a hundred jobs and attempts as ORM objects and flushing them cost more
    than storing their steps)."""

    id: int
    state: JobState
    attempt: int
    step: int
    latest_loss: float | None
    compute_s: float | None
    kept_s: float | None
    stall_s: float | None
    attempt_id: int
    report_seq: int


_RUNNING = (
    select(Job.id, Job.state, Job.attempt, Job.step, Job.latest_loss, Job.compute_s,
           Job.kept_s, Job.stall_s, Attempt.id.label("attempt_id"), Attempt.report_seq)
    .join(Attempt, and_(Attempt.job_id == Job.id, Attempt.number == Job.attempt))
    .order_by(Job.id)
    .with_for_update(of=Job)
)  # fmt: skip
#: PostgreSQL: the ids as one array, so the statement's text never changes (an IN list's
#: does with its length, and is compiled and planned anew).
_RUNNING_BY_ARRAY = _RUNNING.where(Job.id == any_(bindparam("ids", type_=ARRAY(BigInteger))))
_RUNNING_BY_LIST = _RUNNING.where(Job.id.in_(bindparam("ids", expanding=True)))


def lock_running(session: Session, job_ids: Sequence[int]) -> dict[int, Running]:
    """The jobs' rows with their current attempts', the jobs' locked for update in id order
    (two lockers of overlapping sets then never wait on each other in a cycle). Jobs
    without an attempt, and missing ids, are left out."""
    stmt = _RUNNING_BY_ARRAY if _on_postgresql(session) else _RUNNING_BY_LIST
    rows = session.execute(stmt, {"ids": list(job_ids)})
    return {row.id: Running(**row._mapping) for row in rows}


def appends_only(job: Running, report: DriverReport) -> bool:
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

    jobs: list[Running]
    summaries: dict[BucketKey, Summary]

    def remember(self, buckets: OpenBuckets) -> None:
        for job in self.jobs:
            buckets.remember(job.id, attempt=job.attempt, step=job.step, stored=self.summaries)


def persist_steady_reports(
    session: Session,
    reports: Sequence[tuple[Running, DriverReport]],
    *,
    buckets: OpenBuckets | None = None,
) -> SteadyStored:
    """Store many jobs' steady reports (`is_steady` and `appends_only`) as `persist_report`
    would, in a fixed number of statements whatever the number of jobs: one insert of every
    new metric row, one read (of what `buckets` does not know) and one upsert of the bucket
    summaries they touch, one update of the jobs' rows and one of the attempts'."""
    rows: list[tuple[Running, StepMetrics]] = []
    fresh: dict[int, list[tuple[int, dict[str, Any]]]] = {}
    known: dict[BucketKey, Summary | None] = {}
    advanced: list[Running] = []
    acknowledged: list[Running] = []
    for job, report in reports:
        points = [storable(m) for m in report.messages if isinstance(m, StepMetrics)]
        if points:
            if not appends_only(job, report):
                raise ValueError(f"job {job.id}: a report that recomputes steps is not steady")
            stored = _last_of_each_step(points)
            rows.extend((job, p) for p in stored)
            fresh[job.id] = [(p.step, p.values) for p in stored]
            if buckets is not None:
                steps = [p.step for p in stored]
                known.update(buckets.known(job.id, attempt=job.attempt, step=job.step,
                                           new_steps=steps) or {})  # fmt: skip
            _advance(job, stored)
            advanced.append(job)
        if report.seq > job.report_seq:
            job.report_seq = report.seq
            acknowledged.append(job)
    _insert_metrics(session, rows)
    summaries = update_summaries_of(session, fresh, known=known)
    _update_jobs(session, advanced)
    _update_attempts(session, acknowledged)
    return SteadyStored(jobs=advanced, summaries=summaries)


def _on_postgresql(session: Session) -> bool:
    return session.get_bind().dialect.name == "postgresql"


#: PostgreSQL statements that take each column as an array (`unnest`): one statement for
#: any number of rows, whose text never changes (psycopg prepares it once it has run a few
#: times on a connection), where an executemany ran one statement per row.
_INSERT_METRICS_BY_ARRAYS = text(
    "INSERT INTO metrics (job_id, step, attempt, at, values) "
    "SELECT v.job_id, v.step, v.attempt, :at, CAST(v.vals AS jsonb) "
    "FROM unnest(CAST(:job_id AS bigint[]), CAST(:step AS integer[]), "
    "CAST(:attempt AS integer[]), CAST(:vals AS text[])) AS v(job_id, step, attempt, vals)"
)
_UPDATE_JOBS_BY_ARRAYS = text(
    "UPDATE jobs SET step = v.step, latest_loss = v.latest_loss, compute_s = v.compute_s, "
    "kept_s = v.kept_s, stall_s = v.stall_s, updated_at = :now "
    "FROM unnest(CAST(:b_id AS bigint[]), CAST(:b_step AS integer[]), "
    "CAST(:b_latest_loss AS double precision[]), CAST(:b_compute_s AS double precision[]), "
    "CAST(:b_kept_s AS double precision[]), CAST(:b_stall_s AS double precision[])) "
    "AS v(id, step, latest_loss, compute_s, kept_s, stall_s) WHERE jobs.id = v.id"
)
_UPDATE_ATTEMPTS_BY_ARRAYS = text(
    "UPDATE attempts SET report_seq = v.report_seq "
    "FROM unnest(CAST(:b_id AS bigint[]), CAST(:b_report_seq AS integer[])) "
    "AS v(id, report_seq) WHERE attempts.id = v.id"
)
#: Elsewhere (SQLite, in process: a statement per row costs no round trip), executemany.
_JOBS = cast(Table, Job.__table__)
_ATTEMPTS = cast(Table, Attempt.__table__)
_UPDATE_JOBS = (
    update(_JOBS)
    .where(_JOBS.c.id == bindparam("b_id"))
    .values(
        {c: bindparam(f"b_{c}") for c in ("step", "latest_loss", "compute_s", "kept_s", "stall_s")}
        | {"updated_at": bindparam("now")}
    )
)
_UPDATE_ATTEMPTS = (
    update(_ATTEMPTS)
    .where(_ATTEMPTS.c.id == bindparam("b_id"))
    .values(report_seq=bindparam("b_report_seq"))
)


def _insert_metrics(session: Session, rows: Sequence[tuple[Running, StepMetrics]]) -> None:
    if not rows:
        return
    if _on_postgresql(session):
        session.execute(
            _INSERT_METRICS_BY_ARRAYS,
            {"job_id": [job.id for job, _ in rows], "step": [p.step for _, p in rows],
             "attempt": [job.attempt for job, _ in rows],
             "vals": [json.dumps(p.values) for _, p in rows], "at": utcnow()},
        )  # fmt: skip
        return
    # The table, not the ORM entity: an ORM bulk insert spent more in Python than the
    # database spent storing the rows. `at` takes its column default.
    session.execute(
        _INSERT_METRICS,
        [{"job_id": job.id, "step": p.step, "attempt": job.attempt, "values": p.values}
         for job, p in rows],
    )  # fmt: skip


def _update_jobs(session: Session, jobs: Sequence[Running]) -> None:
    columns: dict[str, list[Any]] = {
        "b_id": [j.id for j in jobs], "b_step": [j.step for j in jobs],
        "b_latest_loss": [j.latest_loss for j in jobs], "b_compute_s": [j.compute_s for j in jobs],
        "b_kept_s": [j.kept_s for j in jobs], "b_stall_s": [j.stall_s for j in jobs],
    }  # fmt: skip
    _update(session, _UPDATE_JOBS_BY_ARRAYS, _UPDATE_JOBS, columns, now=utcnow())


def _update_attempts(session: Session, jobs: Sequence[Running]) -> None:
    columns = {"b_id": [j.attempt_id for j in jobs], "b_report_seq": [j.report_seq for j in jobs]}
    _update(session, _UPDATE_ATTEMPTS_BY_ARRAYS, _UPDATE_ATTEMPTS, columns)


def _update(
    session: Session,
    by_arrays: TextClause,
    by_rows: Executable,
    columns: dict[str, list[Any]],
    **constants: Any,
) -> None:
    """Rows given as `columns` (name -> one value per row): on PostgreSQL as arrays, in one
    statement; elsewhere executemany, a parameter set per row."""
    if not columns["b_id"]:
        return
    if _on_postgresql(session):
        session.execute(by_arrays, {**columns, **constants})
        return
    names = list(columns)
    session.execute(
        by_rows,
        [
            dict(zip(names, row, strict=True), **constants)
            for row in zip(*columns.values(), strict=True)
        ],
    )


def _last_of_each_step(points: Sequence[StepMetrics]) -> list[StepMetrics]:
    """One point per step, the last reported winning (a step re-sent after a retry)."""
    return list({p.step: p for p in points}.values())


def _advance(job: Job | Running, stored: Sequence[StepMetrics]) -> None:
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


def _account(job: Job | Running, points: Sequence[StepMetrics]) -> None:
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
