"""The scheduler's control logic, stepped one pass at a time against a fake launcher.

Real DB (SQLite file), no Ray: each test runs in milliseconds.
"""

from __future__ import annotations

import time
from dataclasses import replace
from datetime import timedelta
from pathlib import Path

import pytest
from sqlalchemy import select

from elastrain.contracts.messages import (
    DriverReport,
    DriverStatus,
    ErrorKind,
    StepMetrics,
    WorkerError,
)
from elastrain.contracts.spec import JobSpec
from elastrain.service import jobs, lease, reports
from elastrain.service.db import make_engine, make_session_factory, migrate, session_scope
from elastrain.service.models import Attempt, MetricBucket, utcnow
from elastrain.service.scheduler import Scheduler, track_gone
from elastrain.service.settings import Settings
from elastrain.service.states import JobState
from tests.fake_launcher import FakeLauncher


class Clock:
    """The scheduler's clock, moved by hand (it starts at the real time: the DB's
    timestamps, such as when a wait below min began, are compared with it)."""

    def __init__(self) -> None:
        self.t = time.time()

    def __call__(self) -> float:
        return self.t


@pytest.fixture
def env(tmp_path: Path):
    engine = make_engine(f"sqlite:///{tmp_path / 'db.sqlite'}")
    migrate(engine)
    factory = make_session_factory(engine)
    settings = Settings(
        database_url=str(engine.url),
        storage_path=tmp_path / "storage",
        grow_interval_s=5,
        below_min_timeout_s=30,
        restart_backoff_s=0,
    )
    launcher = FakeLauncher({"n1": 1, "n2": 1, "n3": 1})
    clock = Clock()
    sched = Scheduler(session_factory=factory, launcher=launcher, settings=settings, clock=clock)
    yield factory, launcher, sched, clock
    engine.dispose()


def submit(factory, **overrides) -> int:  # type: ignore[no-untyped-def]
    body = {
        "name": "j",
        "workload": {"name": "synthetic"},
        "scaling": {"min_workers": 1, "max_workers": 3},
    }
    body.update(overrides)
    with session_scope(factory) as s:
        return jobs.create_job(s, spec=JobSpec.model_validate(body)).id


def job(factory, job_id: int):  # type: ignore[no-untyped-def]
    with session_scope(factory) as s:
        return jobs.get_job(s, job_id)


def events(factory, job_id: int) -> list[tuple[str | None, str | None, str]]:
    with session_scope(factory) as s:
        return [(e.from_state, e.to_state, e.reason) for e in jobs.list_events(s, job_id)]


def test_admits_at_largest_size_and_runs_to_success(env) -> None:
    factory, launcher, sched, _ = env
    jid = submit(factory)
    sched.run_pass()
    assert job(factory, jid).state == JobState.STARTING
    assert launcher.launches[0].world_size == 3
    d = launcher.driver(jid)
    d.status = DriverStatus.RUNNING
    d.placement = {0: "n1", 1: "n2", 2: "n3"}
    d.metrics = [
        {"step": 1, "loss": 2.0, "world_size": 3},
        {"step": 2, "loss": 1.5, "world_size": 3},
    ]
    sched.run_pass()
    j = job(factory, jid)
    assert (j.state, j.step, j.latest_loss) == (JobState.RUNNING, 2, 1.5)
    d.status = DriverStatus.SUCCEEDED
    sched.run_pass()
    assert job(factory, jid).state == JobState.SUCCEEDED
    transitions = [e[1] for e in events(factory, jid) if e[1] is not None]
    assert transitions == ["PENDING", "STARTING", "RUNNING", "SUCCEEDED"]


def test_gang_admission_waits_for_min_and_priority_overtakes(env) -> None:
    factory, launcher, sched, _ = env
    first = submit(factory, scaling={"min_workers": 3, "max_workers": 3})
    sched.run_pass()
    low = submit(factory, scaling={"min_workers": 2, "max_workers": 2}, priority=0)
    high = submit(factory, scaling={"min_workers": 2, "max_workers": 2}, priority=5)
    sched.run_pass()
    assert job(factory, low).state == JobState.PENDING
    assert job(factory, high).state == JobState.PENDING
    launcher.driver(first).status = DriverStatus.SUCCEEDED
    sched.run_pass()  # first ends; high priority admitted in the same pass, low still waits
    assert job(factory, high).state == JobState.STARTING
    assert job(factory, low).state == JobState.PENDING
    assert "queued behind" in (job(factory, low).state_reason or "") or "waiting" in (
        job(factory, low).state_reason or ""
    )


def test_job_larger_than_cluster_does_not_block_queue(env) -> None:
    factory, _, sched, _ = env
    huge = submit(factory, scaling={"min_workers": 10, "max_workers": 10})
    small = submit(factory, scaling={"min_workers": 1, "max_workers": 1})
    sched.run_pass()
    assert job(factory, huge).state == JobState.PENDING
    assert "whole cluster holds 3" in (job(factory, huge).state_reason or "")
    assert job(factory, small).state == JobState.STARTING


def test_node_loss_recovers_smaller_then_grows_back(env) -> None:
    factory, launcher, sched, clock = env
    jid = submit(factory)
    sched.run_pass()
    d = launcher.driver(jid, 1)
    d.status = DriverStatus.RUNNING
    d.placement = {0: "n1", 1: "n2", 2: "n3"}
    sched.run_pass()
    launcher.remove_node("n3")
    sched.run_pass()
    assert d.killed
    j = job(factory, jid)
    assert j.state == JobState.RECOVERING and j.attempt == 2
    assert launcher.driver(jid, 2).request.world_size == 2
    d2 = launcher.driver(jid, 2)
    d2.status, d2.placement, d2.resumed_from_step = DriverStatus.RUNNING, {0: "n1", 1: "n2"}, 20
    sched.run_pass()
    assert job(factory, jid).state == JobState.RUNNING
    evs = events(factory, jid)
    assert any("node" in r and "lost" in r for _, _, r in evs)
    assert ("RUNNING", "RECOVERING") in [(f, t) for f, t, _ in evs]
    assert any("resumed from step 20 at world size 2" in r for _, _, r in evs)
    # The node comes back: grow after the hysteresis interval, not before. The grow's
    # timeline starts when it joined (after attempt 2 started), then its process was warm.
    launcher.add_node("n4", 1)
    joined = time.time()
    launcher.nodes["n4"] = replace(launcher.nodes["n4"], joined_at=joined, warm_at=joined + 0.001)
    time.sleep(0.002)  # the decision's event is stamped with the real time
    sched.run_pass()
    assert job(factory, jid).state == JobState.RUNNING
    clock.t += 6
    sched.run_pass()
    assert job(factory, jid).state == JobState.RESIZING and d2.stop_requested
    d2.metrics = [{"step": 25, "loss": 1.0, "world_size": 2}]  # trains on until it checkpoints
    sched.run_pass()
    assert job(factory, jid).state == JobState.RESIZING
    d2.status = DriverStatus.STOPPED
    sched.run_pass()
    assert launcher.driver(jid, 3).request.world_size == 3
    d3 = launcher.driver(jid, 3)
    d3.status = DriverStatus.RUNNING
    sched.run_pass()
    j = job(factory, jid)
    assert (j.state, j.world_size, j.restarts) == (JobState.RUNNING, 3, 0)
    # Each launch says why it starts and since when (its timeline's first mark): the
    # submission, the end of the attempt that lost its node, the grow decision (before the
    # old attempt had checkpointed and stopped). Released attempts keep their processes'
    # state for the next one: the job goes on.
    causes = [(r.cause, r.detected_at) for r in launcher.launches]
    assert [c for c, _ in causes] == ["submitted", "node lost", "resize"]
    with session_scope(factory) as s:
        rows = s.scalars(select(Attempt).where(Attempt.job_id == jid)).all()
        ended = {a.number: a.ended_at for a in rows}
        resizing = jobs.last_entered(s, jobs.get_job(s, jid), JobState.RESIZING)
    assert resizing is not None and causes[2][1] == _epoch(resizing) < _epoch(ended[2])
    assert causes[1][1] == _epoch(ended[1])
    grow = launcher.launches[2]
    assert (grow.joined_at, grow.warm_at) == (joined, joined + 0.001) and grow.warm_at < causes[2][
        1
    ]
    assert [(r.joined_at, r.warm_at) for r in launcher.launches[:2]] == [(0.0, 0.0)] * 2
    assert [final for _, final in launcher.releases] == [False, False]


def test_a_node_its_driver_found_dead_is_left_before_ray_says_so(env) -> None:
    """Rank 2's process died with n3's raylet (the driver's probe was refused) while Ray
    still lists n3 alive (its health checks take 15 s): the job resumes at once on the
    two others, no restart counted, nothing placed on n3: the relaunch keeps its bundles
    off n3, where Ray would try to prepare them (ray#64693: a group removed while preparing
    on a dead node leaks its bundles and stops Ray placing any later group)."""
    factory, launcher, sched, _ = env
    jid = submit(factory)
    sched.run_pass()
    d = launcher.driver(jid, 1)
    d.status, d.placement = DriverStatus.RUNNING, {0: "n1", 1: "n2", 2: "n3"}
    sched.run_pass()
    died = WorkerError(type="ConnectionRefusedError", message="the raylet refuses",
                       kind=ErrorKind.NODE_DIED, rank=2, node_id="n3")  # fmt: skip
    d.status, d.error = DriverStatus.FAILED, died
    sched.run_pass()
    sched.run_pass()
    j = job(factory, jid)
    assert (j.attempt, j.restarts) == (2, 0)
    assert launcher.driver(jid, 2).request.world_size == 2
    assert launcher.driver(jid, 2).request.avoid_nodes == ("n3",)
    assert any("node n3 lost (ranks [2])" in r for _, _, r in events(factory, jid))


def test_an_attempt_waiting_for_its_placement_is_relaunched_smaller_when_a_node_leaves(
    env,
) -> None:
    """Attempt 1 at 3 still waits for Ray to reserve its bundles (no placement reported)
    when n3 dies: Ray would never place 3 on the two left, and the driver would ask until
    its placement timeout (120 s), then fail as a restart. The scheduler releases it and
    relaunches at 2 in the pass that sees n3 gone, no restart counted; a start that is
    merely slow is left alone."""
    factory, launcher, sched, clock = env
    jid = submit(factory)
    sched.run_pass()
    assert launcher.driver(jid, 1).request.world_size == 3
    for _ in range(3):  # slow to place, the capacity there: it waits
        clock.t += 10
        sched.run_pass()
    assert job(factory, jid).attempt == 1 and not launcher.driver(jid, 1).killed
    launcher.remove_node("n3")
    sched.run_pass()
    j = job(factory, jid)
    assert (j.state, j.attempt, j.restarts) == (JobState.RECOVERING, 2, 0)
    assert launcher.driver(jid, 1).killed
    assert launcher.driver(jid, 2).request.world_size == 2
    assert launcher.driver(jid, 2).request.cause == "node lost"
    assert any(
        r == "node n3 left before attempt 1 was placed: 2 of its 3 workers fit now"
        for _, _, r in events(factory, jid)
    )
    d2 = launcher.driver(jid, 2)
    d2.status, d2.placement = DriverStatus.RUNNING, {0: "n1", 1: "n2"}
    d2.metrics = [{"step": 1, "loss": 1.0, "world_size": 2}]
    sched.run_pass()
    sched.run_pass()  # no flapping: it trains on at 2
    j = job(factory, jid)
    assert (j.state, j.world_size, j.attempt, j.restarts) == (JobState.RUNNING, 2, 2, 0)


def test_a_placement_that_timed_out_on_a_shrunk_cluster_counts_no_restart(env) -> None:
    """n3 died while no scheduler watched (a restarted one does not know it left): the
    attempt at 3 waits for its placement until the runtime gives up. Its failure is the
    cluster's shrink, not the job's: no restart counted, relaunched at 2 at once."""
    factory, launcher, sched, clock = env
    jid = submit(factory, failure={"max_restarts": 0})
    sched.run_pass()
    launcher.remove_node("n3")
    fresh = _restarted(sched, factory, launcher, clock)
    fresh.run_pass()
    assert job(factory, jid).attempt == 1 and not launcher.driver(jid, 1).killed
    d = launcher.driver(jid, 1)
    d.status = DriverStatus.FAILED
    d.error = WorkerError(
        type="RuntimeError", message="Ray could not reserve the attempt's bundles in 120s"
    )
    fresh.run_pass()
    j = job(factory, jid)
    assert (j.state, j.attempt, j.restarts) == (JobState.RECOVERING, 2, 0)
    assert launcher.driver(jid, 2).request.world_size == 2
    assert any("the cluster shrank, no restart counted" in r for _, _, r in events(factory, jid))


@pytest.mark.parametrize(
    ("gone", "before", "alive", "expected"),
    [
        pytest.param({}, None, {"a"}, {}, id="first-pass: nothing known to have left"),
        pytest.param({}, {"a", "b"}, {"a"}, {"b": 100.0}, id="b left"),
        pytest.param({"b": 90.0}, {"a"}, {"a"}, {"b": 90.0}, id="remembered from when it left"),
        pytest.param({"b": 90.0}, {"a"}, {"a", "b"}, {}, id="alive again: forgotten"),
        pytest.param({"b": 100.0 - 600}, {"a"}, {"a"}, {}, id="after GONE_HOLD_S: forgotten"),
    ],
)
def test_track_gone(
    gone: dict[str, float], before: set[str] | None, alive: set[str], expected: dict[str, float]
) -> None:
    was = frozenset(before) if before is not None else None
    assert track_gone(gone, was, frozenset(alive), now=100.0) == expected


def _epoch(moment) -> float:  # type: ignore[no-untyped-def]
    from datetime import timezone

    return (moment if moment.tzinfo else moment.replace(tzinfo=timezone.utc)).timestamp()


def test_below_min_waits_then_fails_after_timeout(env) -> None:
    factory, launcher, sched, _ = env
    jid = submit(factory, scaling={"min_workers": 2, "max_workers": 3})
    sched.run_pass()
    d = launcher.driver(jid)
    d.status, d.placement = DriverStatus.RUNNING, {0: "n1", 1: "n2", 2: "n3"}
    sched.run_pass()
    launcher.remove_node("n2")
    launcher.remove_node("n3")
    sched.run_pass()
    j = job(factory, jid)
    assert j.state == JobState.RECOVERING and j.below_min_since is not None
    assert "waiting below min" in (j.state_reason or "")
    # Force the timeout by backdating the wait.
    with session_scope(factory) as s:
        row = jobs.get_job(s, jid)
        row.below_min_since = row.below_min_since.replace(year=2000)
    sched.run_pass()
    j = job(factory, jid)
    assert j.state == JobState.FAILED and "below min_workers" in (j.state_reason or "")


def test_below_min_resumes_when_node_returns(env) -> None:
    factory, launcher, sched, _ = env
    jid = submit(factory, scaling={"min_workers": 2, "max_workers": 2})
    sched.run_pass()
    d = launcher.driver(jid)
    d.status, d.placement = DriverStatus.RUNNING, {0: "n1", 1: "n2"}
    sched.run_pass()
    launcher.remove_node("n2")
    launcher.remove_node("n3")
    sched.run_pass()
    assert job(factory, jid).attempt == 1
    launcher.add_node("n9", 1)
    sched.run_pass()
    j = job(factory, jid)
    assert j.attempt == 2 and launcher.driver(jid, 2).request.world_size == 2


def test_worker_error_restarts_then_fails_on_repeated_error(env) -> None:
    factory, launcher, sched, _ = env
    jid = submit(factory, failure={"max_restarts": 10})
    sched.run_pass()
    for attempt in (1, 2, 3):
        d = launcher.driver(jid, attempt)
        d.status, d.error = DriverStatus.FAILED, "rank 1 on node n2: ValueError: boom"
        sched.run_pass()
    j = job(factory, jid)
    assert j.state == JobState.FAILED
    assert "same error" in (j.state_reason or "") and "boom" in (j.last_error or "")
    assert j.restarts == 2


def test_max_restarts_exhausted(env) -> None:
    factory, launcher, sched, _ = env
    jid = submit(factory, failure={"max_restarts": 1})
    sched.run_pass()
    launcher.driver(jid, 1).status = DriverStatus.FAILED
    launcher.driver(jid, 1).error = "first"
    sched.run_pass()
    assert job(factory, jid).state == JobState.RECOVERING
    launcher.driver(jid, 2).status = DriverStatus.FAILED
    launcher.driver(jid, 2).error = "second"
    sched.run_pass()
    j = job(factory, jid)
    assert j.state == JobState.FAILED and "max_restarts" in (j.state_reason or "")


def test_cancel_running_job_kills_driver_and_frees_capacity(env) -> None:
    factory, launcher, sched, _ = env
    a = submit(factory, scaling={"min_workers": 3, "max_workers": 3})
    sched.run_pass()
    b = submit(factory, scaling={"min_workers": 3, "max_workers": 3})
    sched.run_pass()
    assert job(factory, b).state == JobState.PENDING
    with session_scope(factory) as s:
        jobs.get_job(s, a).cancel_requested = True
    sched.run_pass()
    assert job(factory, a).state == JobState.CANCELLED
    assert launcher.driver(a).killed
    assert launcher.releases == [((a, 1), True)]  # the job ended: nothing worth keeping
    assert job(factory, b).state == JobState.STARTING


def _restarted(sched, factory, launcher, clock) -> Scheduler:  # type: ignore[no-untyped-def]
    """The same replica, restarted: nothing remembered but what the database holds."""
    return Scheduler(session_factory=factory, launcher=launcher, settings=sched.settings,
                     clock=clock, holder=sched.holder)  # fmt: skip


def test_driver_lost_after_control_plane_restart_is_relaunched(env) -> None:
    factory, launcher, sched, clock = env
    jid = submit(factory)
    sched.run_pass()
    launcher.driver(jid).killed = True  # the driver died with its node while we were down
    fresh = _restarted(sched, factory, launcher, clock)
    fresh.run_pass()
    assert job(factory, jid).attempt == 2
    assert len([r for r in launcher.launches if r.job_id == jid]) == 2


def test_stale_attempt_reports_are_fenced(env) -> None:
    factory, _, sched, _ = env
    jid = submit(factory)
    sched.run_pass()
    with session_scope(factory) as s, pytest.raises(jobs.StaleAttempt):
        reports.record_metrics(
            s, jobs.get_job(s, jid), attempt=0, points=[{"step": 5, "loss": 1.0}]
        )
    with session_scope(factory) as s, pytest.raises(jobs.StaleAttempt):
        reports.record_checkpoint(
            s, jobs.get_job(s, jid), attempt=0, step=5, world_size=1, path="x", size_bytes=1
        )


def test_second_scheduler_without_lease_does_nothing(env) -> None:
    factory, launcher, sched, clock = env
    submit(factory)
    assert sched.run_pass()
    other = Scheduler(
        session_factory=factory, launcher=launcher, settings=sched.settings, clock=clock
    )
    submit(factory)
    assert other.run_pass() is False


def test_pipeline_world_size_is_a_multiple_of_stages() -> None:
    spec = JobSpec.model_validate(
        {
            "name": "p",
            "workload": {"name": "gpt"},
            "strategy": {"kind": "pipeline", "pipeline_stages": 2},
            "scaling": {"min_workers": 1, "max_workers": 5},
        }
    )
    assert [spec.usable_world_size(c) for c in range(7)] == [0, 0, 2, 2, 4, 4, 4]


def test_job_that_finishes_while_resizing_succeeds(env) -> None:
    factory, launcher, sched, clock = env
    jid = submit(factory, scaling={"min_workers": 1, "max_workers": 3})
    launcher.remove_node("n3")
    sched.run_pass()
    d = launcher.driver(jid)
    d.status, d.placement = DriverStatus.RUNNING, {0: "n1", 1: "n2"}
    sched.run_pass()
    launcher.add_node("n4", 1)
    sched.run_pass()
    clock.t += 6
    sched.run_pass()
    assert job(factory, jid).state == JobState.RESIZING
    d.status = DriverStatus.SUCCEEDED  # the stop arrived at the last step: nothing to resume
    sched.run_pass()
    assert job(factory, jid).state == JobState.SUCCEEDED


def test_a_report_is_stored_once_even_when_its_pass_rolls_back(env, monkeypatch) -> None:
    factory, launcher, sched, _ = env
    jid = submit(factory)
    sched.run_pass()
    d = launcher.driver(jid)
    d.status, d.placement = DriverStatus.RUNNING, {0: "n1", 1: "n2", 2: "n3"}
    d.metrics = [{"step": 1, "loss": 2.0}, {"step": 2, "loss": 1.5}]
    persist = reports.persist_report

    def persist_then_fail(*args, **kwargs):  # type: ignore[no-untyped-def]
        persist(*args, **kwargs)
        raise RuntimeError("the database went away mid-transaction")

    monkeypatch.setattr(reports, "persist_report", persist_then_fail)
    sched.run_pass()  # drained from the driver, then rolled back
    assert job(factory, jid).step == 0
    monkeypatch.setattr(reports, "persist_report", persist)
    sched.run_pass()  # not acknowledged, so the driver sends it again
    with session_scope(factory) as s:
        assert [m.step for m in reports.list_metrics(s, jid)] == [1, 2]
        assert jobs.current_attempt(s, jobs.get_job(s, jid)).report_seq == 2
    d.metrics = [{"step": 3, "loss": 1.2}]
    sched.run_pass()  # acknowledged messages are not sent twice
    with session_scope(factory) as s:
        assert [m.step for m in reports.list_metrics(s, jid)] == [1, 2, 3]
        placements = [e for e in jobs.list_events(s, jid) if e.kind == "placement"]
        assert len(placements) == 1
    assert [seq for seq, _ in d.outbox] == [3]  # only the unacknowledged one is kept


def test_the_cluster_view_is_in_the_database_for_every_api_replica(env) -> None:
    from elastrain.service import cluster

    factory, launcher, sched, _ = env
    jid = submit(factory, scaling={"min_workers": 2, "max_workers": 2})
    sched.run_pass()
    launcher.driver(jid).placement = {0: "n1", 1: "n2"}
    sched.run_pass()
    launcher.remove_node("n3")
    sched.run_pass()
    with session_scope(factory) as s:
        view = cluster.current(s)
    assert view.connected
    by_id = {n.node_id: n for n in view.nodes}
    assert (by_id["n1"].jobs, by_id["n2"].jobs, by_id["n3"].jobs) == ([jid], [jid], [])
    assert (by_id["n1"].cpus_free, by_id["n3"].alive) == (0, False)


def test_cancel_of_a_job_no_driver_holds_is_decided_at_once(env) -> None:
    from elastrain.service import executor

    factory, launcher, sched, _ = env
    jid = submit(factory, scaling={"min_workers": 3, "max_workers": 3})
    sched.run_pass()
    d = launcher.driver(jid)
    d.status, d.placement = DriverStatus.RUNNING, {0: "n1", 1: "n2", 2: "n3"}
    sched.run_pass()
    launcher.remove_node("n3")
    sched.run_pass()  # lost a node: waits below min, no driver
    assert job(factory, jid).state == JobState.RECOVERING
    with session_scope(factory) as s:
        executor.cancel(s, jobs.get_job(s, jid), storage_path=sched.settings.storage_path)
    assert job(factory, jid).state == JobState.CANCELLED
    assert len(launcher.launches) == 1


def test_steps_whose_reports_died_with_their_attempt_come_back_from_the_checkpoint(env) -> None:
    """Rank 0 reported steps 1-2, trained and checkpointed to step 5, and its node died
    before reports 3-5 reached the driver: the attempt that resumes from step 5 hands back
    the points saved with the checkpoint, so the job's history has no hole."""
    from elastrain.contracts.messages import StepMetrics

    factory, launcher, sched, _ = env
    jid = submit(factory, scaling={"min_workers": 1, "max_workers": 2})
    launcher.remove_node("n3")
    sched.run_pass()
    d1 = launcher.driver(jid, 1)
    d1.status, d1.placement = DriverStatus.RUNNING, {0: "n1", 1: "n2"}
    d1.metrics = [{"step": s, "loss": 3.0 - s / 10, "world_size": 2} for s in (1, 2)]
    sched.run_pass()
    launcher.remove_node("n2")
    sched.run_pass()  # node lost: attempt 2 at world size 1
    d2 = launcher.driver(jid, 2)
    saved = tuple(StepMetrics(step=s, loss=3.0 - s / 10, world_size=2) for s in range(1, 6))
    d2.resume(5, path="/ckpt/step_000000005-a1", saved_world_size=2, saved_attempt=1, metrics=saved)
    d2.status = DriverStatus.RUNNING
    d2.metrics = [{"step": 6, "loss": 2.3, "world_size": 1}]
    sched.run_pass()
    with session_scope(factory) as s:
        rows = reports.list_metrics(s, jid)
        assert [(m.step, m.attempt) for m in rows] == [
            (1, 1),
            (2, 1),
            (3, 1),
            (4, 1),
            (5, 1),
            (6, 2),
        ]
        assert jobs.get_job(s, jid).step == 6


def test_the_catalogue_keeps_manifests_without_their_metric_points(env) -> None:
    factory, launcher, sched, _ = env
    jid = submit(factory)
    sched.run_pass()
    d = launcher.driver(jid)
    d.status, d.placement = DriverStatus.RUNNING, {0: "n1", 1: "n2", 2: "n3"}
    manifest = {"step": 2, "extra": {"seed": 0, "metrics": [{"step": 1}, {"step": 2}]}}
    d.commits = [{"step": 2, "path": "/c/2", "bytes": 1, "manifest": manifest}]
    sched.run_pass()
    with session_scope(factory) as s:
        [row] = reports.list_checkpoints(s, jid)
        assert row.manifest == {"step": 2, "extra": {"seed": 0}}


def test_a_stop_lost_on_its_way_to_the_driver_is_sent_again(env, monkeypatch) -> None:
    factory, launcher, sched, clock = env
    jid = submit(factory, scaling={"min_workers": 1, "max_workers": 3})
    launcher.remove_node("n3")
    sched.run_pass()
    d = launcher.driver(jid)
    d.status, d.placement = DriverStatus.RUNNING, {0: "n1", 1: "n2"}
    sched.run_pass()
    launcher.add_node("n4", 1)
    sched.run_pass()
    clock.t += 6
    send = launcher.send_control
    monkeypatch.setattr(launcher, "send_control", lambda key, control: None)  # lost
    sched.run_pass()
    assert job(factory, jid).state == JobState.RESIZING and not d.stop_requested
    monkeypatch.setattr(launcher, "send_control", send)
    sched.run_pass()  # the report says the driver is not stopping: asked again
    assert d.stop_requested


def submit_as(factory, owner: str, **overrides) -> int:  # type: ignore[no-untyped-def]
    body = {"name": "j", "workload": {"name": "synthetic"}, **overrides}
    with session_scope(factory) as s:
        return jobs.create_job(s, spec=JobSpec.model_validate(body), owner=owner).id


def test_tenant_quota_caps_admission_growth_and_recovery(env) -> None:
    from elastrain.service import auth

    factory, launcher, sched, clock = env
    with session_scope(factory) as s:
        auth.set_quota(s, "team-a", 2)
    scaling = {"min_workers": 1, "max_workers": 3}
    first = submit_as(factory, "team-a", scaling=scaling)
    second = submit_as(factory, "team-a", scaling=scaling)
    other = submit_as(factory, "team-b", scaling={"min_workers": 1, "max_workers": 1})
    sched.run_pass()
    # team-a's first job gets its whole quota (not the 3 workers that fit); its second
    # waits for the quota and does not hold up team-b's job behind it.
    assert [(launch.job_id, launch.world_size) for launch in launcher.launches] == [
        (first, 2),
        (other, 1),
    ]
    assert job(factory, second).state == JobState.PENDING
    assert "team-a's quota" in (job(factory, second).state_reason or "")
    d = launcher.driver(first)
    d.status = DriverStatus.RUNNING
    d.placement = {0: "n1", 1: "n2"}
    d.metrics = [{"step": 1, "loss": 1.0, "world_size": 2}]
    launcher.driver(other).status = DriverStatus.RUNNING
    launcher.driver(other).placement = {0: "n3"}
    sched.run_pass()
    launcher.driver(other).status = DriverStatus.SUCCEEDED
    for _ in range(3):  # a free node for longer than grow_interval_s: the quota says no
        clock.t += 10
        sched.run_pass()
    assert job(factory, first).state == JobState.RUNNING
    assert job(factory, first).world_size == 2
    assert job(factory, second).state == JobState.PENDING
    d.status = DriverStatus.SUCCEEDED
    sched.run_pass()  # the quota frees up: the second job starts at 2, not 3
    assert job(factory, second).state == JobState.STARTING
    assert launcher.launches[-1].world_size == 2


def test_default_quota_applies_to_tenants_without_their_own(env, tmp_path: Path) -> None:
    factory, launcher, _, clock = env
    settings = Settings(
        database_url="sqlite://",
        storage_path=tmp_path / "storage",
        default_max_workers_per_tenant=1,
    )
    sched = Scheduler(session_factory=factory, launcher=launcher, settings=settings, clock=clock)
    jid = submit_as(factory, "anyone", scaling={"min_workers": 1, "max_workers": 3})
    too_big = submit_as(factory, "anyone", scaling={"min_workers": 2, "max_workers": 2})
    sched.run_pass()
    assert launcher.launches[0].job_id == jid and launcher.launches[0].world_size == 1
    assert "quota" in (job(factory, too_big).state_reason or "")


def test_an_auto_job_launches_what_the_plan_chose(env) -> None:  # type: ignore[no-untyped-def]
    """The scheduler gives the plan the workers' memory; the workers get the chosen kind,
    the job row says it, and an event says why, at every launch."""
    factory, launcher, sched, _ = env
    sched.settings = sched.settings.model_copy(update={"worker_memory_bytes": 300_000})
    jid = submit(factory, strategy={"kind": "auto"})
    sched.run_pass()
    [request] = launcher.launches
    assert request.spec.strategy.kind.value == "fsdp"  # 20 bytes a parameter do not fit
    assert job(factory, jid).strategy == "fsdp"
    with session_scope(factory) as s:
        [plan] = [e for e in jobs.list_events(s, jid) if e.kind == "plan"]
        assert plan.reason.startswith("at world size 3: fsdp:") and "ddp needs" in plan.reason
        assert plan.details is not None and plan.details["strategy"] == "fsdp"
    roomy = submit(factory, strategy={"kind": "auto"}, scaling={"min_workers": 1, "max_workers": 1})
    sched.settings = sched.settings.model_copy(update={"worker_memory_bytes": 2**30})
    launcher.driver(jid).status = DriverStatus.SUCCEEDED
    sched.run_pass()
    assert launcher.launches[-1].job_id == roomy
    assert launcher.launches[-1].spec.strategy.kind.value == "ddp"


def test_an_auto_job_can_be_launched_tensor_parallel(env) -> None:  # type: ignore[no-untyped-def]
    """Where only splitting the layers fits, the workers get fsdp with a tensor-parallel
    degree and the job row names both."""
    factory, launcher, sched, _ = env
    sched.settings = sched.settings.model_copy(update={"worker_memory_bytes": 30 * 2**30})
    wide = {"n_layer": 4, "n_embd": 8192, "n_head": 16, "seq_len": 8}
    jid = submit(
        factory,
        workload={"name": "gpt", "params": wide},
        strategy={"kind": "auto"},
        scaling={"min_workers": 2, "max_workers": 2},
        training={"activation_checkpointing": "full", "micro_batch_size": 4},
    )
    sched.run_pass()
    [request] = launcher.launches
    assert request.spec.strategy.kind.value == "fsdp"
    assert request.spec.strategy.tensor_parallel == 2
    assert job(factory, jid).strategy == "fsdp+tp2"


def test_running_jobs_reports_are_stored_together_or_one_by_one(env, monkeypatch) -> None:
    """Steady reports (steps only) of every running job go to the DB in one transaction
    per pass; if that transaction fails, each job's report is stored alone, once."""
    factory, launcher, sched, _ = env
    ids = [submit(factory, scaling={"min_workers": 1, "max_workers": 1}) for _ in range(3)]
    sched.run_pass()
    for n, jid in enumerate(ids, start=1):
        d = launcher.driver(jid)
        d.status, d.placement = DriverStatus.RUNNING, {0: f"n{n}"}
        d.metrics = [{"step": 1, "loss": 2.0}]
    sched.run_pass()  # the placement is news: stored job by job
    batches: list[int] = []
    together = reports.persist_steady_reports

    def counted(session, items, **kw):  # type: ignore[no-untyped-def]
        batches.append(len(items))
        return together(session, items, **kw)

    monkeypatch.setattr(reports, "persist_steady_reports", counted)
    for jid in ids:
        launcher.driver(jid).metrics = [{"step": 2, "loss": 1.5}]
    sched.run_pass()
    assert batches == [3]
    assert [job(factory, jid).step for jid in ids] == [2, 2, 2]

    def fail(session, items, **kw):  # type: ignore[no-untyped-def]
        together(session, items, **kw)
        raise RuntimeError("the database went away mid-transaction")

    monkeypatch.setattr(reports, "persist_steady_reports", fail)
    for jid in ids:
        launcher.driver(jid).metrics = [{"step": 3, "loss": 1.2}]
    sched.run_pass()
    with session_scope(factory) as s:
        for jid in ids:
            assert [m.step for m in reports.list_metrics(s, jid)] == [1, 2, 3]
            assert jobs.current_attempt(s, jobs.get_job(s, jid)).report_seq == 3


def test_summaries_another_scheduler_wrote_while_the_lease_lapsed_are_read_again(env) -> None:
    """Between passes the executor remembers each running job's open bucket summaries (it
    is their one writer while it holds the lease). Once its lease may have lapsed, another
    scheduler may have rewritten them: it forgets them all."""
    factory, launcher, sched, _ = env
    now = [0.0]
    sched.lease.clock = lambda: now[0]
    jid = submit(factory, scaling={"min_workers": 1, "max_workers": 1})
    sched.run_pass()
    d = launcher.driver(jid)
    d.status, d.placement = DriverStatus.RUNNING, {0: "n1"}
    d.metrics = [{"step": 1, "loss": 2.0}]
    sched.run_pass()
    d.metrics = [{"step": 2, "loss": 1.5}]
    sched.run_pass()  # stored with the batch, which remembers the open buckets
    now[0] += 100  # this scheduler stalled past its lease's expiry
    assert lease.try_acquire(factory, holder="other", ttl_s=10, now=utcnow() + timedelta(hours=1))
    with session_scope(factory) as s:  # the other one stores step 2 again, lower
        again = StepMetrics(step=2, loss=0.5)
        job_row = jobs.get_job(s, jid)
        reports.persist_report(
            s, job_row, DriverReport(status=DriverStatus.RUNNING, messages=(again,), seq=0)
        )
    lease.release(factory, holder="other")
    d.metrics = [{"step": 3, "loss": 1.0}]
    assert sched.run_pass()
    with session_scope(factory) as s:
        lowest = s.execute(
            select(MetricBucket.lo_step, MetricBucket.lo_loss).where(
                MetricBucket.job_id == jid, MetricBucket.width == 8, MetricBucket.bucket == 0
            )
        ).one()
    assert tuple(lowest) == (2, 0.5)
    assert job(factory, jid).step == 3


def test_a_release_that_fails_is_repaired_by_the_next_pass(env) -> None:
    """The runtime is handed the live attempts every pass: an ended attempt whose release
    call was lost is let go of at the next pass, and its capacity goes to the next job."""
    factory, launcher, sched, _ = env
    a = submit(factory, scaling={"min_workers": 3, "max_workers": 3})
    sched.run_pass()
    with session_scope(factory) as s:
        jobs.get_job(s, a).cancel_requested = True
    launcher.fail_releases = True
    sched.run_pass()
    assert job(factory, a).state == JobState.CANCELLED
    assert launcher.releases == []  # the call never got through
    assert launcher.live_drivers() == [(a, 1)]
    launcher.fail_releases = False
    b = submit(factory, scaling={"min_workers": 3, "max_workers": 3})
    sched.run_pass()
    assert launcher.reconciled == [(a, 1)] and launcher.live_drivers() == [(b, 1)]


def test_a_fresh_database_releases_what_the_runtime_held(env, tmp_path: Path) -> None:
    """A control plane restarted on a database that no longer knows a running job (a
    restored backup, a fresh one) makes the runtime let go of it at its first pass, and
    its own job 1 is a new attempt, not the old one adopted."""
    factory, launcher, sched, clock = env
    old = submit(factory)
    sched.run_pass()
    launcher.driver(old).status = DriverStatus.RUNNING
    engine = make_engine(f"sqlite:///{tmp_path / 'fresh.sqlite'}")
    migrate(engine)
    fresh = make_session_factory(engine)
    restarted = Scheduler(
        session_factory=fresh, launcher=launcher, settings=sched.settings, clock=clock
    )
    old_name = launcher.driver(old).request.name
    restarted.run_pass()
    assert launcher.reconciled == [(old, 1)] and launcher.live_drivers() == []
    new = submit(fresh)
    assert new == old  # the same key as the attempt the runtime held
    restarted.run_pass()
    assert launcher.live_drivers() == [(new, 1)]
    assert launcher.driver(new).request.name != old_name
    engine.dispose()


def test_a_folder_planted_under_the_next_job_id_is_set_aside_at_its_first_launch(env) -> None:
    """Another job's code planted a committed-looking checkpoint under the id the next job
    gets: that job starts from nothing of it, and its events say what was moved aside."""
    factory, _, sched, _ = env
    planted = sched.settings.storage_path / "jobs" / "1" / "checkpoints" / "step_000000900-a1"
    planted.mkdir(parents=True)
    (planted / "manifest.json").write_text("{}")
    jid = submit(factory)
    sched.run_pass()
    assert job(factory, jid).state == "STARTING"
    root = sched.settings.storage_path / "jobs" / str(jid)
    assert not (root / "checkpoints").exists()
    aside = [p for p in root.parent.iterdir() if p.name.startswith(f"{jid}.set-aside")]
    assert len(aside) == 1 and (aside[0] / "checkpoints" / planted.name).is_dir()
    with session_scope(factory) as s:
        kinds = {(e.kind, e.reason) for e in jobs.list_events(s, jid)}
    assert any(k == "folder_set_aside" and aside[0].name in (r or "") for k, r in kinds)


def test_a_failure_names_paths_as_the_tenant_gave_them(env) -> None:
    """A worker's error carries the server's path of the tenant's data: the job's reason
    names it as the tenant wrote it in its spec."""
    factory, launcher, sched, _ = env
    jid = submit(factory, failure={"max_restarts": 0})
    sched.run_pass()
    storage = sched.settings.storage_path
    d = launcher.driver(jid)
    d.status = DriverStatus.FAILED
    d.error = f"workload.params.model: cannot load {storage}/data/default/mymodel (no config)"
    sched.run_pass()
    j = job(factory, jid)
    assert j.state == JobState.FAILED
    assert "cannot load mymodel (no config)" in (j.last_error or ""), j.last_error
    assert str(storage) not in (j.last_error or "")
