"""The forwarder: follows every tracked job's stored metric points and state changes and
hands them to its trackers, after they were committed, on a thread of its own.

It is a reader of what `elastrain.service.reports` and `elastrain.service.jobs` committed, never a second
way in: each pass reads, per open cursor (`tracker_runs`), the job's state, then the
metric rows past the cursor's step and the events past its event id; forwards them with
no transaction open (a slow or unreachable tracker holds no row and no scheduler pass);
then moves the cursor. The job's state is read before its points, so once a job is seen
ended, every point it stored is in the same read or an earlier one, and the run is
finished only after the last of them.

A tracker that fails costs the job nothing: the cursor stays where it was, the attempt
is retried with exponential backoff, and the job gets one `tracking` event when the
failures start (and one when they stop). Points forwarded just before a failure may be
sent again on the retry (at least once, not exactly once). Steps an attempt recomputes
after a restart are not sent again: the tracker keeps the values first reported.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import or_, select, update
from sqlalchemy.orm import Session, sessionmaker

from elastrain.contracts.messages import EventKind
from elastrain.contracts.spec import JobSpec
from elastrain.service import jobs
from elastrain.service.db import session_scope
from elastrain.service.models import Event, Job, Metric, TrackerRun, utcnow
from elastrain.service.states import JobState
from elastrain.service.tracking import make_tracker
from elastrain.service.tracking.base import (
    Change,
    Point,
    RunInfo,
    Tracker,
    flatten_params,
    numeric_values,
)

log = logging.getLogger("elastrain.tracking")

#: Metric rows and events forwarded per job and tracker in one go.
BATCH = 500
#: Backoff after the first failure, doubled per failure in a row up to the cap.
FIRST_BACKOFF_S = 2.0
MAX_BACKOFF_S = 300.0
#: Failures in a row after which an ended job's tracker is given up on (a running job's
#: is retried for as long as it runs: the tracker may come back).
GIVE_UP_AFTER = 12

MakeTracker = Callable[[str, JobSpec], Tracker]


@dataclass(frozen=True, slots=True)
class Cursor:
    job_id: int
    tracker: str
    run_id: str | None
    metric_step: int
    event_id: int
    failures: int

    @property
    def key(self) -> tuple[int, str]:
        return (self.job_id, self.tracker)


@dataclass(frozen=True, slots=True)
class Batch:
    """What one pass read for one cursor, in one transaction."""

    job_name: str
    owner: str
    state: JobState
    finished_at: datetime | None
    spec: dict[str, Any]
    points: list[Point]
    last_step: int
    changes: list[Change]
    last_event: int
    complete: bool  # nothing left past this batch (both reads came back short)


def backoff_s(failures: int) -> float:
    return float(min(MAX_BACKOFF_S, FIRST_BACKOFF_S * 2 ** max(0, failures - 1)))


class Forwarder:
    def __init__(
        self,
        sessions: sessionmaker[Session],
        *,
        make: MakeTracker = make_tracker,
        clock: Callable[[], datetime] = utcnow,
        batch: int = BATCH,
    ) -> None:
        self.sessions = sessions
        self.make = make
        self.clock = clock
        self.batch = batch
        #: Trackers with their run open in this process, kept between passes.
        self.live: dict[tuple[int, str], Tracker] = {}

    def run_pass(self) -> int:
        """Forward whatever is new for every due cursor; returns how many cursors moved."""
        moved = 0
        for cursor in self._due():
            try:
                moved += self.forward(cursor)
            except Exception:  # the database; this cursor's problem, not the pass's
                log.exception("job %s: forwarding to %s failed", cursor.job_id, cursor.tracker)
        return moved

    def close(self) -> None:
        """Let go of every open run (they stay open in their trackers: a later process
        resumes them by id)."""
        for key in list(self.live):
            self._drop(key)

    def _due(self) -> list[Cursor]:
        now = self.clock()
        with session_scope(self.sessions) as s:
            rows = s.execute(
                select(
                    TrackerRun.job_id,
                    TrackerRun.tracker,
                    TrackerRun.run_id,
                    TrackerRun.metric_step,
                    TrackerRun.event_id,
                    TrackerRun.failures,
                )
                .where(TrackerRun.done.is_(False))
                .where(or_(TrackerRun.retry_at.is_(None), TrackerRun.retry_at <= now))
                .order_by(TrackerRun.job_id, TrackerRun.tracker)
            ).all()
        due = [Cursor(*row) for row in rows]
        open_keys = {c.key for c in due}
        for key in [k for k in self.live if k not in open_keys]:
            self._drop(key)  # its job was deleted, or another process finished its run
        return due

    def forward(self, cursor: Cursor) -> int:
        """One cursor: read, forward, move it (or count the failure). 1 when it moved."""
        batch = self._read(cursor)
        if batch is None:
            return 0  # the job is gone (its cursor went with it)
        ending = batch.state.is_terminal and batch.complete
        run_id = cursor.run_id
        try:
            tracker = self.live.get(cursor.key)
            if tracker is None:
                tracker = self.make(cursor.tracker, JobSpec.from_stored(batch.spec))
                info = RunInfo(
                    job_id=cursor.job_id,
                    job_name=batch.job_name,
                    owner=batch.owner,
                    params=flatten_params(batch.spec),
                )
                run_id = tracker.open(info, cursor.run_id)
                self.live[cursor.key] = tracker
            tracker.log_points(batch.points)
            tracker.log_changes(batch.changes)
            if ending:
                tracker.finish(batch.state, batch.finished_at)
                self.live.pop(cursor.key, None)
        except Exception as exc:
            log.warning("job %s: forwarding to %s failed: %s", cursor.job_id, cursor.tracker, exc)
            self._drop(cursor.key)
            self._failed(cursor, run_id, exc, ended=batch.state.is_terminal)
            return 0
        moved = (batch.last_step, batch.last_event, run_id) != (
            cursor.metric_step,
            cursor.event_id,
            cursor.run_id,
        )
        if not (moved or ending):
            return 0  # nothing new: no write
        self._advance(cursor, run_id, batch, done=ending)
        return 1

    def _read(self, cursor: Cursor) -> Batch | None:
        with session_scope(self.sessions) as s:
            # The job first: whatever it stored before it was seen ended is read below.
            job = s.execute(
                select(Job.name, Job.owner, Job.state, Job.finished_at, Job.spec).where(
                    Job.id == cursor.job_id
                )
            ).one_or_none()
            if job is None:
                return None
            metrics = s.execute(
                select(Metric.step, Metric.at, Metric.values)
                .where(Metric.job_id == cursor.job_id, Metric.step > cursor.metric_step)
                .order_by(Metric.step)
                .limit(self.batch)
            ).all()
            events = s.execute(
                select(Event)
                .where(Event.job_id == cursor.job_id, Event.id > cursor.event_id)
                .order_by(Event.id)
                .limit(self.batch)
            ).scalars().all()  # fmt: skip
        points = [
            Point(step=m.step, at=m.at, values=values)
            for m in metrics
            if (values := numeric_values(m.values or {}))
        ]
        changes = [
            Change(
                event_id=e.id,
                at=e.at,
                from_state=e.from_state,
                to_state=e.to_state,
                reason=e.reason,
                step=e.step,
                world_size=e.world_size_after,
            )
            for e in events
            if e.kind == EventKind.TRANSITION.value and e.to_state is not None
        ]
        return Batch(
            job_name=job.name,
            owner=job.owner,
            state=JobState(job.state),
            finished_at=job.finished_at,
            spec=job.spec,
            points=points,
            last_step=metrics[-1].step if metrics else cursor.metric_step,
            changes=changes,
            last_event=events[-1].id if events else cursor.event_id,
            complete=len(metrics) < self.batch and len(events) < self.batch,
        )

    def _advance(self, cursor: Cursor, run_id: str | None, batch: Batch, *, done: bool) -> None:
        with session_scope(self.sessions) as s:
            s.execute(
                update(TrackerRun)
                .where(TrackerRun.job_id == cursor.job_id, TrackerRun.tracker == cursor.tracker)
                .values(
                    run_id=run_id,
                    metric_step=batch.last_step,
                    event_id=batch.last_event,
                    done=done,
                    failures=0,
                    last_error=None,
                    retry_at=None,
                )
            )
            if cursor.failures:
                job = jobs.get_job(s, cursor.job_id)
                jobs.record_event(
                    s,
                    job,
                    kind=EventKind.TRACKING,
                    reason=f"forwarding to {cursor.tracker} works again after "
                    f"{cursor.failures} failed tries",
                    details={"tracker": cursor.tracker, "run_id": run_id},
                )

    def _failed(self, cursor: Cursor, run_id: str | None, exc: Exception, *, ended: bool) -> None:
        failures = cursor.failures + 1
        give_up = ended and failures >= GIVE_UP_AFTER
        message = f"{type(exc).__name__}: {exc}"[:2000]
        with session_scope(self.sessions) as s:
            s.execute(
                update(TrackerRun)
                .where(TrackerRun.job_id == cursor.job_id, TrackerRun.tracker == cursor.tracker)
                .values(
                    run_id=run_id,  # a run made before the failure is the one to go on with
                    failures=failures,
                    last_error=message,
                    retry_at=self.clock() + timedelta(seconds=backoff_s(failures)),
                    done=give_up,
                )
            )
            if failures == 1 or give_up:
                job = jobs.get_job(s, cursor.job_id)
                what = (
                    f"gave up forwarding to {cursor.tracker} after {failures} failed tries"
                    if give_up
                    else f"forwarding to {cursor.tracker} failed; retrying with backoff"
                )
                jobs.record_event(
                    s,
                    job,
                    kind=EventKind.TRACKING,
                    reason=f"{what}: {message}"[:2000],
                    details={"tracker": cursor.tracker, "failures": failures},
                )

    def _drop(self, key: tuple[int, str]) -> None:
        tracker = self.live.pop(key, None)
        if tracker is None:
            return
        try:
            tracker.close()
        except Exception as exc:  # letting go must not fail the pass
            log.warning("job %s: closing its %s run failed: %s", key[0], key[1], exc)


class ForwarderThread:
    """Runs forwarding passes on a background thread until `stop()`, while `leading()`
    says this process is the one scheduler (so two replicas never forward the same
    points)."""

    def __init__(
        self, forwarder: Forwarder, interval_s: float, leading: Callable[[], bool]
    ) -> None:
        self.forwarder = forwarder
        self.interval_s = interval_s
        self.leading = leading
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="elastrain-tracking", daemon=True)

    def start(self) -> ForwarderThread:
        self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.is_set():
            started = time.monotonic()
            try:
                if self.leading():
                    self.forwarder.run_pass()
                else:
                    self.forwarder.close()
            except Exception:
                log.exception("tracking pass failed")
            self._stop.wait(max(0.0, self.interval_s - (time.monotonic() - started)))

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=30)
        self.forwarder.close()
