"""What a job's rank 0 reports is bounded where the control plane stores it (issue 45,
item 5): per point (names, bytes), per second and per job; what is cut is dropped and said
once per kind in the job's events. Pure limits row by row, then a flood of real messages
through the scheduler into a real database."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
from sqlalchemy import Engine

from elastrain.contracts.messages import DriverStatus, StepMetrics
from elastrain.service import jobs, reports, telemetry
from elastrain.service.db import make_session_factory, session_scope
from elastrain.service.metric_limits import MetricBudgets, MetricLimits, TokenBucket, bound_point
from elastrain.service.scheduler import Scheduler
from elastrain.service.settings import Settings
from tests.fake_launcher import FakeLauncher
from tests.unit.test_scheduler import Clock, submit

SMALL = MetricLimits(names_per_point=20, point_bytes=1024, points_per_s=10, points_per_job=150)


@pytest.mark.parametrize(
    ("custom", "cut", "kept"),
    [
        ({"acc": 0.5}, None, 1),
        (
            {f"m{i}": 1.0 for i in range(100)},
            "names_per_point",
            20 - 4,
        ),  # loss, wall_time, lr, stall
        ({"x" * 2000: 1.0}, "point_bytes", 0),
    ],
)
def test_a_point_keeps_its_built_in_fields_and_as_many_names_as_fit(
    custom: dict[str, float | int | None], cut: str | None, kept: int
) -> None:
    point = StepMetrics(step=1, loss=2.0, wall_time=1.0, lr=0.1, custom=custom)
    bounded, why = bound_point(point, SMALL)
    assert why == cut
    assert len(bounded.custom) == kept
    assert bounded.loss == 2.0 and bounded.lr == 0.1
    assert len(json.dumps(bounded.to_values())) <= SMALL.point_bytes


def test_a_planted_text_field_is_cut() -> None:
    point = StepMetrics(step=1, loss=1.0, mfu_basis="y" * 100_000)
    bounded, why = bound_point(point, SMALL)
    assert why == "point_bytes" and len(json.dumps(bounded.to_values())) <= SMALL.point_bytes


def test_the_token_bucket_lets_a_burst_through_then_the_rate() -> None:
    bucket = TokenBucket(rate=10, burst=100, tokens=100, at=0.0)
    assert sum(bucket.take(0.0) for _ in range(500)) == 100
    assert sum(bucket.take(1.0) for _ in range(500)) == 10
    assert sum(bucket.take(100.0) for _ in range(500)) == 100  # never more than the burst


def test_budgets_count_a_jobs_stored_points_from_the_database_once() -> None:
    reads = []
    budgets = MetricBudgets(SMALL, clock=lambda: 0.0)
    points = [StepMetrics(step=i, loss=1.0) for i in range(20)]

    def stored() -> int:
        reads.append(1)
        return 145

    cut = budgets.admit(1, points, stored=stored)
    assert len(cut.points) == 5 and cut.kinds == {"points_per_job"}
    assert budgets.admit(1, points, stored=stored).points == []
    assert reads == [1]
    assert budgets.first_report(1, {"points_per_job"}) == {"points_per_job"}
    assert budgets.first_report(1, {"points_per_job"}) == set()


@pytest.fixture
def small(
    engine: Engine, tmp_path: Path
) -> Iterator[tuple[object, FakeLauncher, Scheduler, Clock]]:
    """A scheduler with small metric limits, on SQLite and on PostgreSQL."""
    factory = make_session_factory(engine)
    settings = Settings(
        database_url=str(engine.url),
        storage_path=tmp_path / "storage",
        restart_backoff_s=0,
        metric_names_per_point=SMALL.names_per_point,
        metric_point_bytes=SMALL.point_bytes,
        metric_points_per_s=SMALL.points_per_s,
        metric_points_per_job=SMALL.points_per_job,
    )
    launcher = FakeLauncher({"n1": 1})
    clock = Clock()
    sched = Scheduler(session_factory=factory, launcher=launcher, settings=settings, clock=clock)
    yield factory, launcher, sched, clock


def test_a_metric_flood_stores_within_the_limits_and_says_so_once(small) -> None:  # type: ignore[no-untyped-def]
    factory, launcher, sched, clock = small
    limited_before = _limited()
    jid = submit(factory, scaling={"min_workers": 1, "max_workers": 1})
    sched.run_pass()
    driver = launcher.driver(jid)
    driver.status, driver.placement = DriverStatus.RUNNING, {0: "n1"}
    fat = {f"m{i}": float(i) for i in range(500)}  # names a hostile rank 0 made up
    step = 0
    for _ in range(5):  # five passes a second apart, 1,000 points each
        driver.metrics = [{"step": step + i, "loss": 1.0, **fat} for i in range(1, 1001)]
        step += 1000
        sched.run_pass()
        clock.t += 1.0
    with session_scope(factory) as s:
        rows = reports.list_metrics(s, jid)
        limits = [e for e in jobs.list_events(s, jid) if e.kind == "limit"]
    # The burst (10 s of 10/s), then 10 a second, never past 150 in all.
    assert len(rows) == 100 + 4 * 10
    assert all(len(r.values) <= SMALL.names_per_point for r in rows)
    assert all(len(json.dumps(r.values)) <= SMALL.point_bytes for r in rows)
    assert sorted((e.details or {})["limit"] for e in limits) == ["names_per_point", "points_per_s"]
    assert "ELASTRAIN_METRIC_POINTS_PER_S" in next(
        e.reason for e in limits if (e.details or {})["limit"] == "points_per_s"
    )
    # As a restarted scheduler would: the job's total and what was said, from the database.
    assert sched.executor.metric_budgets is not None
    sched.executor.metric_budgets.clear()
    for _ in range(3):  # later passes: the job's total
        driver.metrics = [{"step": step + i, "loss": 1.0, **fat} for i in range(1, 11)]
        step += 10
        sched.run_pass()
        clock.t += 1.0
    with session_scope(factory) as s:
        assert len(reports.list_metrics(s, jid)) == SMALL.points_per_job
        kinds = [(e.details or {})["limit"] for e in jobs.list_events(s, jid) if e.kind == "limit"]
    assert sorted(kinds) == ["names_per_point", "points_per_job", "points_per_s"]
    # /metrics counts the cut points by kind of limit, never by job or tenant.
    limited = {kind: n - limited_before.get(kind, 0) for kind, n in _limited().items()}
    assert limited["points_per_s"] == 5000 - 140 and limited["names_per_point"] == 150
    assert limited["points_per_job"] == 20  # 10 of the 30 last points fit in the 150


def test_a_resume_is_charged_only_for_the_points_the_service_never_stored(small) -> None:  # type: ignore[no-untyped-def]
    """A resume hands back the newest few hundred points, most of them stored: charging
    those emptied the bucket, so the points it was there to restore, and the next
    attempt's, were dropped (CI: 25 steps missing after four hand-overs)."""
    factory, _, sched, _ = small
    budgets = sched.executor.metric_budgets
    jid = submit(factory, scaling={"min_workers": 1, "max_workers": 1})
    points = [StepMetrics(step=i, loss=1.0) for i in range(1, 91)]  # 10 left of the 100
    with session_scope(factory) as s:
        job = jobs.get_job(s, jid)
        reports.record_metrics(s, job, attempt=job.attempt, points=points[:80], budgets=budgets)
        assert (
            reports.backfill_metrics(s, job, attempt=job.attempt, points=points, budgets=budgets)
            == 10
        )
        live = [StepMetrics(step=i, loss=1.0) for i in range(91, 101)]
        reports.record_metrics(s, job, attempt=job.attempt, points=live, budgets=budgets)
    with session_scope(factory) as s:
        assert [r.step for r in reports.list_metrics(s, jid)] == list(range(1, 101))


def _limited() -> dict[str, float]:
    return {
        sample.labels["limit"]: sample.value
        for family in telemetry.REGISTRY.collect()
        if family.name == "elastrain_metric_points_limited"
        for sample in family.samples
        if sample.name.endswith("_total")
    }
