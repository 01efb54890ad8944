"""Many running jobs' reports stored together (`Executor.execute_steady`, what a scheduler
pass does) leave exactly what storing each job's report alone leaves (`Executor.execute`):
metric rows, bucket summaries, the jobs' steps, losses and goodput sums, the attempts'
acknowledged sequence numbers. On SQLite and PostgreSQL, also when something the batch's
cache of open bucket summaries did not see wrote between passes."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import Engine, select
from sqlalchemy.orm import Session, sessionmaker

from contracts.messages import DriverReport, DriverStatus, StepMetrics
from contracts.spec import JobSpec
from service import jobs, observe, reports
from service.db import make_session_factory, session_scope
from service.decisions import PersistReport
from service.executor import Executor, Timers
from service.models import Job, Metric, MetricBucket
from tests.fake_launcher import FakeLauncher
from tests.integration.test_api import run

JOBS = 3


def report(seq: int, *steps: int, loss_of: Any = lambda step: 10.0 / step) -> DriverReport:
    points = tuple(
        StepMetrics(step=s, values={"loss": loss_of(s), "step_time_s": 0.1 * s, "checkpoint_stall_s": 0.01})
        for s in steps
    )  # fmt: skip
    return DriverReport(status=DriverStatus.RUNNING, messages=points, seq=seq)


#: Per pass, each job's report: new steps; a step sent twice (the last wins); then steps
#: recomputed after a resume (at or below the job's last step: they replace stored rows).
PASSES = [
    [report(1, 1, 2), report(1, 1), report(0)],
    [report(2, 3, 4, 4), report(3, 2, 3), report(1, 1, 2, 3)],
    [report(3, 3, 4, 5, loss_of=lambda s: 1.0 / s), report(4, 4), report(2, 70, 71)],
]

#: Something done to the jobs between two passes: (sessions, the jobs' ids, the executor).
Between = Callable[[sessionmaker[Session], list[int], Executor], None]
Pass = list[DriverReport]


def store_alone(sessions: sessionmaker[Session], job_id: int, r: DriverReport) -> None:
    """What another writer (another scheduler, once the lease was its) stores of the job."""
    with session_scope(sessions) as s:
        reports.persist_report(s, jobs.get_job(s, job_id), r)


def single_path(job: int, r: DriverReport) -> Between:
    """The executor stores `r` of the `job`th job alone (as for a report with more than
    steps in it)."""

    def between(sessions: sessionmaker[Session], ids: list[int], executor: Executor) -> None:
        executor.execute(view(sessions, ids[job]), [PersistReport(report=r)])

    return between


def elsewhere(job: int, r: DriverReport) -> Between:
    """`r` of the `job`th job stored behind the executor's back."""

    def between(sessions: sessionmaker[Session], ids: list[int], executor: Executor) -> None:
        store_alone(sessions, ids[job], r)

    return between


def relaunch(job: int) -> Between:
    """The `job`th job's attempt ends and the next starts (as the scheduler's single-job
    decisions would do), behind the executor's back."""

    def between(sessions: sessionmaker[Session], ids: list[int], executor: Executor) -> None:
        with session_scope(sessions) as s:
            row = jobs.get_job(s, ids[job])
            jobs.end_attempt(s, row, outcome="stopped")
            jobs.start_attempt(s, row, world_size=1, driver_name=f"d-{row.id}-{row.attempt + 1}")

    return between


def view(sessions: sessionmaker[Session], job_id: int) -> Any:
    with session_scope(sessions) as s:
        return observe.view_of(s, jobs.get_job(s, job_id))


def store(
    sessions: sessionmaker[Session], plan: list[Pass | Between], *, together: bool, tmp: Path
) -> dict[str, Any]:
    """Play `plan` on new jobs: each pass's reports stored together or one by one, with the
    same executor (and so the same cache) throughout."""
    ids = []
    with session_scope(sessions) as s:
        for i in range(JOBS):
            spec = JobSpec.model_validate({"name": f"j{i}", "workload": {"name": "synthetic"}})
            ids.append(jobs.create_job(s, spec=spec).id)
    for job_id in ids:
        run(sessions, job_id, world_size=1)
    executor = Executor(
        sessions=sessions, launcher=FakeLauncher({}), storage_path=tmp, timers=Timers()
    )
    for step in plan:
        if callable(step):
            step(sessions, ids, executor)
            continue
        batch = [
            (view(sessions, i), PersistReport(report=r)) for i, r in zip(ids, step, strict=True)
        ]
        if together:
            executor.execute_steady(batch)
        else:
            for v, action in batch:
                assert executor.execute(v, [action])
    return snapshot(sessions, ids)


def snapshot(sessions: sessionmaker[Session], ids: list[int]) -> dict[str, Any]:
    """What the stored reports left, with the jobs named by their order of creation."""
    order = {job_id: n for n, job_id in enumerate(ids)}
    with session_scope(sessions) as s:
        metrics = sorted(
            (order[m.job_id], m.step, m.attempt, m.values)
            for m in s.scalars(select(Metric).where(Metric.job_id.in_(ids)))
        )
        buckets = sorted(
            (order[b.job_id], b.width, b.bucket, b.lo_step, b.lo_loss, b.hi_step, b.hi_loss,
             b.slow_step, b.slow_s, b.eval_step)
            for b in s.scalars(select(MetricBucket).where(MetricBucket.job_id.in_(ids)))
        )  # fmt: skip
        job_rows = sorted(
            (order[j.id], j.step, j.latest_loss, round(j.kept_s or 0, 9),
             round(j.compute_s or 0, 9), round(j.stall_s or 0, 9))
            for j in s.scalars(select(Job).where(Job.id.in_(ids)))
        )  # fmt: skip
        seqs = [jobs.current_attempt(s, jobs.get_job(s, i)).report_seq for i in ids]  # type: ignore[union-attr]
    return {"metrics": metrics, "buckets": buckets, "jobs": job_rows, "seqs": seqs}


def test_reports_stored_together_equal_reports_stored_one_by_one(
    engine: Engine, tmp_path: Path
) -> None:
    sessions = make_session_factory(engine)
    together = store(sessions, list(PASSES), together=True, tmp=tmp_path)  # jobs 1-3
    alone = store(sessions, list(PASSES), together=False, tmp=tmp_path)  # jobs 4-6, the same
    assert together == alone
    # And what the sequences say happened: the last report of a step won, recomputed
    # steps replaced their rows (job 0's step 3 now has the loss of the third pass).
    steps_of_0 = {step: values["loss"] for n, step, _, values in together["metrics"] if n == 0}
    assert sorted(steps_of_0) == [1, 2, 3, 4, 5]
    assert steps_of_0[3] == 1.0 / 3
    assert together["seqs"] == [3, 4, 2]
    assert [row[1] for row in together["jobs"]] == [5, 4, 71]


#: Steps 1-4 of job 0 (job 2's first report comes later): what the batch's cache then
#: holds of their open buckets.
OPENING = [
    [report(1, 1, 2), report(1, 1, 2), report(0)],
    [report(2, 3, 4), report(2, 3), report(1, 1)],
]
#: The next passes' steps: each job's next, and some opening new buckets (8, 64, 512).
GOING_ON = [
    [report(3, 6, loss_of=lambda s: 0.5), report(3, 4), report(2, 2, 3)],
    [report(4, 7, 9, 65, 513), report(4, 5, 8), report(3, 4, 64)],
]


@pytest.mark.parametrize(
    "between",
    [
        # The open bucket's lowest loss rewritten by the executor's single-job path (a
        # step re-sent): the job's last step and attempt are unchanged.
        single_path(0, report(3, 4, loss_of=lambda s: 0.01)),
        # A step stored by another writer (a scheduler that held the lease meanwhile) with
        # the open bucket's lowest loss: the job's last step moved.
        elsewhere(0, report(3, 5, loss_of=lambda s: 0.01)),
        # The job moved to its next attempt, whose reports start after its last step.
        relaunch(1),
    ],
    ids=["single-job-path-write", "a-step-stored-elsewhere", "job-relaunched"],
)
def test_a_write_the_batch_did_not_make_between_passes(
    engine: Engine, tmp_path: Path, between: Between
) -> None:
    sessions = make_session_factory(engine)
    plan: list[Pass | Between] = [*OPENING, between, *GOING_ON]
    together = store(sessions, plan, together=True, tmp=tmp_path)
    alone = store(sessions, plan, together=False, tmp=tmp_path)
    assert together == alone
