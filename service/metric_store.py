"""A job's metric curve at any length: bucket summaries kept as rows arrive, downsampled
reads from them, and retention that thins old finished jobs to the rows their curve
needs (`elastrain.service.metric_summary` holds the pure part). Like `elastrain.service.jobs`, no commits."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from datetime import datetime
from typing import Any, cast

from sqlalchemy import Row, Table, and_, bindparam, delete, func, insert, select, tuple_, update
from sqlalchemy.orm import Session

from elastrain.service.metric_summary import (
    WIDTHS,
    Summary,
    merge,
    representative_steps,
    summarize,
    width_for,
)
from elastrain.service.models import Job, Metric, MetricBucket
from elastrain.service.states import TERMINAL

_KEY = ["job_id", "width", "bucket"]
_FIELDS = ("lo_step", "lo_loss", "hi_step", "hi_loss", "slow_step", "slow_s", "eval_step")
#: Retention keeps each finished job's representative rows at this width (and the first
#: and last): about 4 rows in 64, every held-out loss up to one per 64 steps.
THIN_WIDTH = 64
#: Steps handled per delete when thinning, buckets looked up per query (bounded statement
#: sizes on any database).
_THIN_WINDOW = 8192
_KEYS_PER_QUERY = 500


def _summary(row: Sequence[Any]) -> Summary:
    """A row of `MetricBucket`'s `_FIELDS` columns, in that order."""
    lo_step, lo_loss, hi_step, hi_loss, slow_step, slow_s, eval_step = row
    return Summary(lo_step=lo_step, lo_loss=lo_loss, hi_step=hi_step, hi_loss=hi_loss,
                   slow_step=slow_step, slow_s=slow_s, eval_step=eval_step)  # fmt: skip


#: What a metric read returns per row (plain rows, not ORM objects: a read of thousands
#: of rows spent most of its time building objects nobody changes).
POINT_COLUMNS = (Metric.step, Metric.attempt, Metric.at, Metric.values)


def update_summaries(
    session: Session, job_id: int, points: Iterable[tuple[int, Mapping[str, Any]]]
) -> None:
    """Fold newly stored (step, values) of one job into its bucket summaries."""
    update_summaries_of(session, {job_id: points})


#: A bucket summary's key: (job id, width, bucket).
BucketKey = tuple[int, int, int]


def update_summaries_of(
    session: Session,
    points_by_job: Mapping[int, Iterable[tuple[int, Mapping[str, Any]]]],
    *,
    known: Mapping[BucketKey, Summary | None] | None = None,
) -> dict[BucketKey, Summary]:
    """Fold newly stored (step, values) of each job into its bucket summaries: one read of
    the buckets they touch (all jobs at once) that `known` does not answer (None there: no
    row), the merge here (`metric_summary.merge`), one insert of the new buckets' rows and
    one update of the changed ones'. Returns every touched bucket's summary as stored now.
    One writer per job (the scheduler, under the job's row lock), so read-merge-write is
    safe."""
    fresh = {
        (job_id, *key): summary
        for job_id, points in points_by_job.items()
        for key, summary in summarize(points).items()
    }
    if not fresh:
        return {}
    known = known or {}
    stored = {key: known[key] for key in fresh if key in known}
    if missing := [key for key in fresh if key not in known]:
        stored.update(_stored_summaries(session, missing))
    merged_all: dict[BucketKey, Summary] = {}
    new: list[dict[str, Any]] = []
    changed: list[dict[str, Any]] = []
    for key, summary in fresh.items():
        old = stored.get(key)
        merged = summary if old is None else merge(old, summary)
        merged_all[key] = merged
        if old is None:
            new.append({"job_id": key[0], "width": key[1], "bucket": key[2], **_fields(merged)})
        elif merged != old:  # most points set no new extreme in a coarse bucket
            changed.append({"k_job_id": key[0], "k_width": key[1], "k_bucket": key[2],
                            **_fields(merged)})  # fmt: skip
    if new:
        session.execute(_INSERT_BUCKETS, new)
    if changed:
        session.execute(_UPDATE_BUCKETS, changed)
    return merged_all


def _fields(summary: Summary) -> dict[str, Any]:
    return {f: getattr(summary, f) for f in _FIELDS}


class OpenBuckets:
    """Each running job's summaries of the buckets that hold its last stored step (one per
    width), as this process stored them, so that storing the job's next steps reads no
    summary: the scheduler is the one writer of a running job's summaries while it holds
    the lease, and steps arrive in order, so every bucket a new step (above the last) falls
    in is either one of these or has no row yet (summaries exist only for stored steps).

    An entry is tied to the job's attempt and last step when it was stored: if the job's
    row says otherwise, something else stored steps and the entry is not used. Whoever
    writes a job's summaries another way (a report that recomputes steps, a backfill)
    must `forget` the job; losing the lease must `clear` all (another scheduler may have
    written meanwhile)."""

    def __init__(self) -> None:
        self._jobs: dict[int, tuple[tuple[int, int], dict[int, Summary | None]]] = {}

    def known(
        self, job_id: int, *, attempt: int, step: int, new_steps: Iterable[int]
    ) -> dict[BucketKey, Summary | None] | None:
        """What is stored (None: no row) of the buckets that `new_steps` fall in, steps
        after `step`, the job's last stored one with `attempt` current; or None when this
        cache cannot say (it has no entry tied to that attempt and step)."""
        entry = self._jobs.get(job_id)
        if entry is None or entry[0] != (attempt, step):
            return None
        steps = set(new_steps)
        if min(steps, default=step + 1) <= step:  # not steps after `step`: not this cache's
            return None
        open_ = entry[1]
        out: dict[BucketKey, Summary | None] = {}
        for width in WIDTHS:
            last = step // width  # the open bucket; those after it have no row yet
            for bucket in {s // width for s in steps}:
                out[(job_id, width, bucket)] = open_.get(width) if bucket == last else None
        return out

    def remember(
        self, job_id: int, *, attempt: int, step: int, stored: Mapping[BucketKey, Summary]
    ) -> None:
        """After a commit: the job's summaries now stored (`update_summaries_of`'s answer)
        of the buckets holding `step`, its last stored step."""
        self._jobs[job_id] = (
            (attempt, step),
            {width: stored.get((job_id, width, step // width)) for width in WIDTHS},
        )

    def forget(self, job_id: int) -> None:
        self._jobs.pop(job_id, None)

    def keep_only(self, job_ids: Iterable[int]) -> None:
        """Drop the jobs not in `job_ids` (no longer running: they will send no steps)."""
        keep = set(job_ids)
        self._jobs = {k: v for k, v in self._jobs.items() if k in keep}

    def clear(self) -> None:
        self._jobs.clear()


_KEY_COLUMNS = tuple_(MetricBucket.job_id, MetricBucket.width, MetricBucket.bucket)
_STORED = select(*_KEY_COLUMNS.clauses, *(getattr(MetricBucket, f) for f in _FIELDS)).where(
    _KEY_COLUMNS.in_(bindparam("keys", expanding=True))
)


def _stored_summaries(
    session: Session, keys: list[tuple[int, int, int]]
) -> dict[tuple[int, int, int], Summary]:
    """The stored summaries of those (job, width, bucket) keys that have a row."""
    rows: list[Sequence[Any]] = []
    for start in range(0, len(keys), _KEYS_PER_QUERY):
        rows += session.execute(_STORED, {"keys": keys[start : start + _KEYS_PER_QUERY]}).all()
    return {(row[0], row[1], row[2]): _summary(row[3:]) for row in rows}


#: Bucket rows written as many parameter sets of one statement text (the driver batches
#: them): new buckets inserted, changed ones' summary columns overwritten by key.
_BUCKETS = cast(Table, MetricBucket.__table__)
_INSERT_BUCKETS = insert(_BUCKETS)
_UPDATE_BUCKETS = (
    update(_BUCKETS)
    .where(*(_BUCKETS.c[k] == bindparam(f"k_{k}") for k in _KEY))
    .values({f: bindparam(f) for f in _FIELDS})
)


def _buckets(session: Session, job_id: int, width: int, first: int, last: int) -> list[Summary]:
    """The summaries at `width` of the buckets holding steps first..last, in step order."""
    rows = session.execute(
        select(*(getattr(MetricBucket, name) for name in _FIELDS))
        .where(
            MetricBucket.job_id == job_id,
            MetricBucket.width == width,
            MetricBucket.bucket >= first // width,
            MetricBucket.bucket <= last // width,
        )
        .order_by(MetricBucket.bucket)
    )
    return [_summary(row) for row in rows]


def insert_bulk(
    session: Session,
    job_id: int,
    points: Sequence[tuple[int, dict[str, Any]]],
    *,
    attempt: int,
    at: datetime,
) -> None:
    """Insert (step, values) rows of steps the job has no row for yet, and their summaries,
    in one statement: for loaders (benches, imports, test seeds), not for what attempts
    report (that is `elastrain.service.reports.record_metrics`, with its fencing and goodput)."""
    rows = [
        {"job_id": job_id, "step": step, "attempt": attempt, "at": at, "values": values}
        for step, values in points
    ]
    if rows:
        session.execute(insert(Metric), rows)
        update_summaries(session, job_id, points)


def downsampled(
    session: Session,
    job_id: int,
    *,
    since_step: int,
    until_step: int,
    max_points: int,
    thinned: bool = False,
) -> Sequence[Row[Any]]:
    """At most `max_points` real rows (`POINT_COLUMNS`) of steps since..until that keep the
    curve's shape: all of them when they fit, else each bucket group's lowest and highest
    loss, slowest step and last held-out loss, and the range's first and last rows."""
    in_range = and_(Metric.job_id == job_id, Metric.step >= since_step, Metric.step <= until_step)
    first, last = session.execute(
        select(func.min(Metric.step), func.max(Metric.step)).where(in_range)
    ).one()
    if first is None:
        return []
    width = width_for(first, last, max_points, THIN_WIDTH if thinned else WIDTHS[0])
    if width is None:  # at most one row per step: all of them fit
        return session.execute(select(*POINT_COLUMNS).where(in_range).order_by(Metric.step)).all()
    buckets = _buckets(session, job_id, width, first, last)
    steps = representative_steps(buckets, max_points, first, last)
    return session.execute(
        select(*POINT_COLUMNS)
        .where(Metric.job_id == job_id, Metric.step.in_(steps))
        .order_by(Metric.step)
    ).all()


def jobs_to_thin(session: Session, *, finished_before: datetime, limit: int = 10) -> list[Job]:
    """Finished jobs, done before `finished_before`, whose rows were never thinned."""
    return list(
        session.scalars(
            select(Job)
            .where(
                Job.state.in_(list(TERMINAL)),
                Job.finished_at.is_not(None),
                Job.finished_at < finished_before,
                Job.metrics_thinned_at.is_(None),
            )
            .order_by(Job.finished_at)
            .limit(limit)
        )
    )


def thin(session: Session, job: Job, *, now: datetime) -> int:
    """Delete the job's per-step rows that no summary at `THIN_WIDTH` names (keeping the
    first and last); returns how many. Every coarser summary names only kept rows, so a
    downsampled read at any zoom coarser than `THIN_WIDTH` is unchanged."""
    in_job = Metric.job_id == job.id
    first, last = session.execute(
        select(func.min(Metric.step), func.max(Metric.step)).where(in_job)
    ).one()
    deleted = 0
    if first is not None:
        for lo in range(first - first % _THIN_WINDOW, last + 1, _THIN_WINDOW):
            hi = lo + _THIN_WINDOW - 1
            keep = {first, last}
            for summary in _buckets(session, job.id, THIN_WIDTH, lo, hi):
                keep |= summary.steps()
            result = session.execute(
                delete(Metric).where(
                    in_job, Metric.step >= lo, Metric.step <= hi, Metric.step.not_in(sorted(keep))
                )
            )
            deleted += int(getattr(result, "rowcount", 0) or 0)
    # The finer summaries would name rows that are gone; the coarser ones answer.
    session.execute(
        delete(MetricBucket).where(MetricBucket.job_id == job.id, MetricBucket.width < THIN_WIDTH)
    )
    job.metrics_thinned_at = now
    return deleted
