"""The tracking forwarder against a real database (SQLite and PostgreSQL) and a fake
tracker: what reaches the tracker, in what order, when the run ends, and what a failing
tracker costs the job (nothing but an event)."""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any

import pytest
from sqlalchemy import select
from sqlalchemy.orm import Session, sessionmaker

from elastrain.contracts.messages import EventKind, StepMetrics
from elastrain.contracts.spec import JobSpec
from elastrain.service import jobs, reports
from elastrain.service.db import session_scope
from elastrain.service.models import Event, TrackerRun, utcnow
from elastrain.service.states import JobState
from elastrain.service.tracking import forwarder as fw
from elastrain.service.tracking.base import Change, Point, RunInfo, flatten_params, numeric_values
from elastrain.service.tracking.forwarder import Forwarder
from tests.factories import spec_dict

TRACKED = {"mlflow": {"tracking_uri": "file:///tmp/nowhere", "experiment": "e"}}


@dataclass
class FakeRun:
    """What one tracker run received (kept across fake tracker instances: a resumed run)."""

    info: RunInfo | None = None
    opened_with: list[str | None] = field(default_factory=list)
    points: list[Point] = field(default_factory=list)
    changes: list[Change] = field(default_factory=list)
    finished: list[tuple[JobState, datetime | None]] = field(default_factory=list)
    closed: int = 0


class FakeTracker:
    name = "mlflow"

    def __init__(self, run: FakeRun, fail: list[bool]) -> None:
        self.run, self.fail = run, fail

    def _maybe_fail(self) -> None:
        if self.fail[0]:
            raise ConnectionError("tracker down")

    def open(self, run: RunInfo, run_id: str | None) -> str:
        self._maybe_fail()
        self.run.opened_with.append(run_id)
        self.run.info = run
        return run_id or "run-1"

    def log_points(self, points: Sequence[Point]) -> None:
        self._maybe_fail()
        self.run.points.extend(points)

    def log_changes(self, changes: Sequence[Change]) -> None:
        self._maybe_fail()
        self.run.changes.extend(changes)

    def finish(self, state: JobState, at: datetime | None) -> None:
        self._maybe_fail()
        self.run.finished.append((state, at))

    def close(self) -> None:
        self.run.closed += 1


class Clock:
    def __init__(self) -> None:
        self.now = utcnow()

    def __call__(self) -> datetime:
        return self.now


@pytest.fixture
def run() -> FakeRun:
    return FakeRun()


@pytest.fixture
def down() -> list[bool]:
    return [False]


@pytest.fixture
def clock() -> Clock:
    return Clock()


def forwarder(
    sessions: sessionmaker[Session], run: FakeRun, down: list[bool], clock: Clock, **kw: Any
) -> Forwarder:
    return Forwarder(sessions, make=lambda name, spec: FakeTracker(run, down), clock=clock, **kw)


def submit(sessions: sessionmaker[Session], **overrides: Any) -> int:
    spec = JobSpec.model_validate(spec_dict(tracking=TRACKED, **overrides))
    with session_scope(sessions) as s:
        return jobs.create_job(s, spec=spec).id


def start(sessions: sessionmaker[Session], job_id: int) -> None:
    with session_scope(sessions) as s:
        job = jobs.get_job(s, job_id)
        jobs.set_job_state(s, job, JobState.STARTING, reason="admitted", world_size=2)
        jobs.start_attempt(s, job, world_size=2, driver_name="d")
        jobs.set_job_state(s, job, JobState.RUNNING, reason="training")


def report(sessions: sessionmaker[Session], job_id: int, steps: range) -> None:
    with session_scope(sessions) as s:
        job = jobs.get_job(s, job_id)
        points = [StepMetrics(step=i, loss=10.0 - i, lr=0.001, world_size=2) for i in steps]
        reports.record_metrics(s, job, attempt=job.attempt, points=points)


def end(sessions: sessionmaker[Session], job_id: int, state: JobState = JobState.SUCCEEDED) -> None:
    with session_scope(sessions) as s:
        jobs.set_job_state(s, jobs.get_job(s, job_id), state, reason="done")


def cursor(sessions: sessionmaker[Session], job_id: int) -> TrackerRun:
    with session_scope(sessions) as s:
        row = s.get(TrackerRun, (job_id, "mlflow"))
        assert row is not None
        return row


def tracking_events(sessions: sessionmaker[Session], job_id: int) -> list[str]:
    with session_scope(sessions) as s:
        return list(
            s.scalars(
                select(Event.reason)
                .where(Event.job_id == job_id, Event.kind == EventKind.TRACKING.value)
                .order_by(Event.id)
            )
        )


def test_an_untracked_job_has_no_cursor(session_factory: sessionmaker[Session]) -> None:
    spec = JobSpec.model_validate(spec_dict())
    with session_scope(session_factory) as s:
        job_id = jobs.create_job(s, spec=spec).id
    with session_scope(session_factory) as s:
        assert s.scalars(select(TrackerRun).where(TrackerRun.job_id == job_id)).all() == []


def test_points_params_and_lifecycle_reach_the_tracker_once(
    session_factory: sessionmaker[Session], run: FakeRun, down: list[bool], clock: Clock
) -> None:
    job_id = submit(session_factory, training={"learning_rate": 0.002})
    f = forwarder(session_factory, run, down, clock)
    assert f.run_pass() == 1  # the run is made while the job is queued
    assert run.info is not None and run.info.run_name == f"gpt-tiny-{job_id}"
    assert run.info.params["training.learning_rate"] == "0.002"
    assert run.info.params["workload.name"] == "synthetic"
    assert [c.to_state for c in run.changes] == ["PENDING"]

    start(session_factory, job_id)
    report(session_factory, job_id, range(1, 6))
    f.run_pass()
    report(session_factory, job_id, range(6, 9))
    end(session_factory, job_id)
    f.run_pass()

    assert [p.step for p in run.points] == list(range(1, 9))
    assert run.points[0].values["loss"] == 9.0 and run.points[0].values["lr"] == 0.001
    assert [c.to_state for c in run.changes] == ["PENDING", "STARTING", "RUNNING", "SUCCEEDED"]
    assert run.changes[1].world_size == 2
    assert [s for s, _ in run.finished] == [JobState.SUCCEEDED]
    assert run.opened_with == [None]  # one run, opened once, kept open between passes
    row = cursor(session_factory, job_id)
    assert (row.done, row.run_id, row.metric_step, row.failures) == (True, "run-1", 8, 0)

    assert f.run_pass() == 0  # done: nothing more, ever
    assert len(run.points) == 8 and len(run.finished) == 1
    assert tracking_events(session_factory, job_id) == []


def test_the_run_ends_only_after_its_last_point(
    session_factory: sessionmaker[Session], run: FakeRun, down: list[bool], clock: Clock
) -> None:
    """A job that ended with more points stored than one batch takes: each pass forwards
    a batch, and the run is finished after the last."""
    job_id = submit(session_factory)
    start(session_factory, job_id)
    report(session_factory, job_id, range(1, 8))
    end(session_factory, job_id, JobState.FAILED)
    f = forwarder(session_factory, run, down, clock, batch=3)
    f.run_pass()
    f.run_pass()
    assert run.finished == [] and [p.step for p in run.points] == [1, 2, 3, 4, 5, 6]
    f.run_pass()
    assert [p.step for p in run.points] == list(range(1, 8))
    assert [s for s, _ in run.finished] == [JobState.FAILED]


def test_a_failing_tracker_backs_off_records_an_event_and_never_touches_the_job(
    session_factory: sessionmaker[Session], run: FakeRun, down: list[bool], clock: Clock
) -> None:
    job_id = submit(session_factory)
    start(session_factory, job_id)
    report(session_factory, job_id, range(1, 4))
    down[0] = True
    f = forwarder(session_factory, run, down, clock)
    f.run_pass()
    row = cursor(session_factory, job_id)
    assert row.failures == 1 and row.metric_step == -1 and "tracker down" in (row.last_error or "")
    assert row.retry_at is not None and row.retry_at > clock.now
    events = tracking_events(session_factory, job_id)
    assert len(events) == 1 and "forwarding to mlflow failed" in events[0]

    f.run_pass()  # backing off: not tried again yet
    assert cursor(session_factory, job_id).failures == 1
    clock.now += timedelta(seconds=fw.backoff_s(1) + 1)
    f.run_pass()  # tried, failed again: no second event, a longer wait
    row = cursor(session_factory, job_id)
    assert row.failures == 2 and len(tracking_events(session_factory, job_id)) == 1
    assert row.retry_at is not None
    assert row.retry_at - clock.now == timedelta(seconds=fw.backoff_s(2))

    with session_scope(session_factory) as s:
        assert jobs.get_job(s, job_id).state == JobState.RUNNING  # the job never noticed

    down[0] = False
    clock.now += timedelta(seconds=fw.MAX_BACKOFF_S)
    f.run_pass()
    assert [p.step for p in run.points] == [1, 2, 3]
    row = cursor(session_factory, job_id)
    assert (row.failures, row.metric_step, row.retry_at) == (0, 3, None)
    assert "works again" in tracking_events(session_factory, job_id)[-1]


def test_an_ended_job_is_given_up_on_after_many_failures(
    session_factory: sessionmaker[Session], run: FakeRun, down: list[bool], clock: Clock
) -> None:
    job_id = submit(session_factory)
    end(session_factory, job_id, JobState.CANCELLED)
    down[0] = True
    f = forwarder(session_factory, run, down, clock)
    for _ in range(fw.GIVE_UP_AFTER):
        assert not cursor(session_factory, job_id).done
        f.run_pass()
        clock.now += timedelta(seconds=fw.MAX_BACKOFF_S + 1)
    assert cursor(session_factory, job_id).done
    assert "gave up forwarding to mlflow" in tracking_events(session_factory, job_id)[-1]


def test_a_restarted_control_plane_goes_on_in_the_same_run(
    session_factory: sessionmaker[Session], run: FakeRun, down: list[bool], clock: Clock
) -> None:
    job_id = submit(session_factory)
    start(session_factory, job_id)
    report(session_factory, job_id, range(1, 3))
    first = forwarder(session_factory, run, down, clock)
    first.run_pass()
    first.close()  # the process stops: the run stays open in the tracker
    assert run.closed == 1 and run.finished == []
    report(session_factory, job_id, range(3, 5))
    forwarder(session_factory, run, down, clock).run_pass()
    assert run.opened_with == [None, "run-1"]
    assert [p.step for p in run.points] == [1, 2, 3, 4]  # none twice


def test_flatten_params_gives_dotted_text_and_leaves_out_nulls() -> None:
    spec = JobSpec.model_validate(spec_dict(tracking=TRACKED)).model_dump(mode="json")
    flat = flatten_params(spec)
    assert flat["scaling.max_workers"] == "2"
    assert flat["labels.team"] == "nlp"
    assert flat["tracking.mlflow.experiment"] == "e"
    assert "tracking.wandb" not in flat and "training.eval_every" not in flat
    assert flatten_params({"a": {"b": [1, 2]}, "c": "x" * 7000}) == {
        "a.b": "[1, 2]",
        "c": "x" * 6000,
    }


def test_numeric_values_keeps_finite_numbers_only() -> None:
    values = {"loss": 1.5, "world_size": 2, "ok": True, "memory": {"a": 1}, "x": None}
    assert numeric_values(values) == {"loss": 1.5, "world_size": 2.0}
    assert numeric_values({"loss": float("nan")}) == {}


def test_only_the_lease_holder_forwards(
    session_factory: sessionmaker[Session], run: FakeRun, down: list[bool], clock: Clock
) -> None:
    """Two control planes on one database: the one without the scheduler's lease forwards
    nothing (else every point would reach the tracker twice)."""
    submit(session_factory)
    leading = [False]
    thread = fw.ForwarderThread(
        forwarder(session_factory, run, down, clock), 0.01, leading=lambda: leading[0]
    ).start()
    try:
        time.sleep(0.3)
        assert run.opened_with == []
        leading[0] = True
        deadline = time.monotonic() + 10
        while not run.opened_with and time.monotonic() < deadline:
            time.sleep(0.05)
        assert run.opened_with == [None]
    finally:
        thread.stop()
    assert run.closed == 1  # stopping lets go of the open run, without finishing it
    assert run.finished == []


def test_rows_with_nothing_to_forward_still_move_the_cursor(
    session_factory: sessionmaker[Session], run: FakeRun, down: list[bool], clock: Clock
) -> None:
    """Events that are not transitions (and points with no numbers) are read past, not
    read again every pass: else a batch of them would block the job's run for good."""
    job_id = submit(session_factory)
    f = forwarder(session_factory, run, down, clock, batch=2)
    f.run_pass()
    with session_scope(session_factory) as s:
        job = jobs.get_job(s, job_id)
        for i in range(5):
            jobs.record_event(s, job, kind=EventKind.BELOW_MIN, reason=f"waiting {i}")
    end(session_factory, job_id, JobState.CANCELLED)
    for _ in range(4):
        f.run_pass()
    assert [c.to_state for c in run.changes] == ["PENDING", "CANCELLED"]
    assert [s for s, _ in run.finished] == [JobState.CANCELLED]
    assert cursor(session_factory, job_id).done
