"""Running jobs' reports as a scheduler pass stores them (`Executor.execute_steady`: every
job's steady report together in one transaction, one that recomputes stored steps alone
afterwards): the metric rows, the bucket summaries, the jobs' last step, loss and goodput
sums, the attempts' acknowledged sequence numbers. On SQLite and PostgreSQL, also when
something the batch's cache of open bucket summaries did not see wrote between passes,
and in the same statements whatever the number of jobs."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import Engine, select
from sqlalchemy.orm import Session, sessionmaker

from elastrain.contracts.messages import DriverReport, DriverStatus, StepMetrics
from elastrain.contracts.spec import JobSpec
from elastrain.service import jobs, observe, reports
from elastrain.service.db import make_session_factory, session_scope
from elastrain.service.decisions import PersistReport
from elastrain.service.executor import Executor, Timers
from elastrain.service.metric_summary import Summary, summarize
from elastrain.service.models import Job, Metric, MetricBucket
from tests.fake_launcher import FakeLauncher
from tests.integration.test_api import recorded_statements, run

JOBS = 3


def report(seq: int, *steps: int, loss_of: Any = lambda step: 10.0 / step) -> DriverReport:
    points = tuple(
        StepMetrics(step=s, loss=loss_of(s), step_time_s=0.1 * s, checkpoint_stall_s=0.01)
        for s in steps
    )  # fmt: skip
    return DriverReport(status=DriverStatus.RUNNING, messages=points, seq=seq)


@dataclass(frozen=True)
class Between:
    """Something done to the `job`th job between two passes, and the report it stored of
    that job's steps, if any."""

    do: Callable[[sessionmaker[Session], list[int], Executor], None]
    job: int
    report: DriverReport | None = None


Pass = list[DriverReport]


def single_path(job: int, r: DriverReport) -> Between:
    """The executor stores `r` of the job alone (as for a report with more than steps in
    it)."""

    def do(sessions: sessionmaker[Session], ids: list[int], executor: Executor) -> None:
        executor.execute(view(sessions, ids[job]), [PersistReport(report=r)])

    return Between(do, job, r)


def elsewhere(job: int, r: DriverReport) -> Between:
    """`r` of the job stored behind the executor's back (by another scheduler, once the
    lease was its)."""

    def do(sessions: sessionmaker[Session], ids: list[int], executor: Executor) -> None:
        with session_scope(sessions) as s:
            reports.persist_report(s, jobs.get_job(s, ids[job]), r)

    return Between(do, job, r)


def relaunch(job: int) -> Between:
    """The job's attempt ends and the next starts (as the scheduler's single-job decisions
    would do), behind the executor's back."""

    def do(sessions: sessionmaker[Session], ids: list[int], executor: Executor) -> None:
        with session_scope(sessions) as s:
            row = jobs.get_job(s, ids[job])
            jobs.end_attempt(s, row, outcome="stopped")
            jobs.start_attempt(s, row, world_size=1, driver_name=f"d-{row.id}-{row.attempt + 1}")

    return Between(do, job)


def view(sessions: sessionmaker[Session], job_id: int) -> Any:
    with session_scope(sessions) as s:
        return observe.view_of(s, jobs.get_job(s, job_id))


def running_jobs(sessions: sessionmaker[Session], n: int) -> list[int]:
    ids = []
    with session_scope(sessions) as s:
        for i in range(n):
            spec = JobSpec.model_validate({"name": f"j{i}", "workload": {"name": "synthetic"}})
            ids.append(jobs.create_job(s, spec=spec).id)
    for job_id in ids:
        run(sessions, job_id, world_size=1)
    return ids


def play(sessions: sessionmaker[Session], plan: list[Pass | Between], tmp: Path) -> list[int]:
    """Play `plan` on new running jobs, each pass's reports stored as a scheduler pass
    stores them, with one executor (and so one cache) throughout. Returns the jobs' ids."""
    ids = running_jobs(sessions, JOBS)
    executor = Executor(
        sessions=sessions, launcher=FakeLauncher({}), storage_path=tmp, timers=Timers()
    )
    for step in plan:
        if isinstance(step, Between):
            step.do(sessions, ids, executor)
        else:
            executor.execute_steady(
                [(view(sessions, i), PersistReport(report=r)) for i, r in zip(ids, step, strict=True)]
            )  # fmt: skip
    return ids


def metric_rows(sessions: sessionmaker[Session], job_id: int) -> dict[int, tuple[int, float]]:
    """step -> (attempt, loss) of the job's stored rows."""
    with session_scope(sessions) as s:
        rows = s.scalars(select(Metric).where(Metric.job_id == job_id))
        return {m.step: (m.attempt, m.values["loss"]) for m in rows}


def stored_buckets(sessions: sessionmaker[Session], job_id: int) -> dict[tuple[int, int], Summary]:
    fields = ("lo_step", "lo_loss", "hi_step", "hi_loss", "slow_step", "slow_s", "eval_step")
    with session_scope(sessions) as s:
        rows = s.scalars(select(MetricBucket).where(MetricBucket.job_id == job_id))
        return {(b.width, b.bucket): Summary(**{f: getattr(b, f) for f in fields}) for b in rows}


def every_point(plan: list[Pass | Between], job: int) -> list[tuple[int, dict[str, Any]]]:
    """Each (step, values) the plan has the `job`th job report, in order, wherever stored:
    what the job's bucket summaries must summarize (a replaced step's old values too)."""
    reported: list[DriverReport] = []
    for step in plan:
        if not isinstance(step, Between):
            reported.append(step[job])
        elif step.job == job and step.report is not None:
            reported.append(step.report)
    return [
        (m.step, m.to_values()) for r in reported for m in r.messages if isinstance(m, StepMetrics)
    ]


def job_row(sessions: sessionmaker[Session], job_id: int) -> tuple[Any, ...]:
    with session_scope(sessions) as s:
        j = s.get(Job, job_id)
        assert j is not None
        seq = jobs.current_attempt(s, j).report_seq  # type: ignore[union-attr]
        return (j.step, j.latest_loss, round(j.compute_s, 9), round(j.kept_s, 9),
                round(j.stall_s, 9), seq)  # fmt: skip


#: Per pass, each job's report: new steps; a step sent twice (the last wins); then steps
#: recomputed after a resume (at or below the job's last step: they replace stored rows).
PASSES: list[Pass | Between] = [
    [report(1, 1, 2), report(1, 1), report(0)],
    [report(2, 3, 4, 4), report(3, 2, 3), report(1, 1, 2, 3)],
    [report(3, 3, 4, 5, loss_of=lambda s: 1.0 / s), report(4, 4), report(2, 70, 71)],
]


def test_a_pass_stores_new_steps_resent_steps_and_recomputed_steps(
    engine: Engine, tmp_path: Path
) -> None:
    sessions = make_session_factory(engine)
    ids = play(sessions, PASSES, tmp_path)
    # Job 0's steps 3 and 4 were recomputed in the third pass: their rows now hold the new
    # losses; step 4, sent twice in the second pass, was stored once.
    assert metric_rows(sessions, ids[0]) == {
        1: (1, 10.0), 2: (1, 5.0), 3: (1, 1 / 3), 4: (1, 1 / 4), 5: (1, 1 / 5)
    }  # fmt: skip
    assert metric_rows(sessions, ids[1]) == {s: (1, 10.0 / s) for s in (1, 2, 3, 4)}
    assert metric_rows(sessions, ids[2]) == {s: (1, 10.0 / s) for s in (1, 2, 3, 70, 71)}
    # (last step, last loss, compute s, kept s, stall s, acknowledged seq): compute counts
    # every step stored (job 0: 0.3 + 0.7 + 1.2), kept only those still stored (the
    # recomputed steps' first 0.7 s were lost), stall 0.01 s per step stored.
    assert job_row(sessions, ids[0]) == (5, 0.2, 2.2, 1.5, 0.07, 3)
    assert job_row(sessions, ids[1]) == (4, 2.5, 1.0, 1.0, 0.04, 4)
    assert job_row(sessions, ids[2]) == (71, 10.0 / 71, 14.7, 14.7, 0.05, 2)
    for n, job_id in enumerate(ids):
        assert stored_buckets(sessions, job_id) == summarize(every_point(PASSES, n)), n


#: Steps 1-4 of job 0 (job 2's first report comes later): what the batch's cache then
#: holds of their open buckets.
OPENING: list[Pass | Between] = [
    [report(1, 1, 2), report(1, 1, 2), report(0)],
    [report(2, 3, 4), report(2, 3), report(1, 1)],
]
#: The next passes' steps: each job's next, and some opening new buckets (8, 64, 512).
GOING_ON: list[Pass | Between] = [
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
def test_bucket_summaries_hold_what_was_written_between_passes(
    engine: Engine, tmp_path: Path, between: Between
) -> None:
    """Each job's summaries are those of every point it reported, in order, whoever stored
    them: the batch's cache of open buckets never hides another write."""
    sessions = make_session_factory(engine)
    plan: list[Pass | Between] = [*OPENING, between, *GOING_ON]
    ids = play(sessions, plan, tmp_path)
    for n, job_id in enumerate(ids):
        assert stored_buckets(sessions, job_id) == summarize(every_point(plan, n)), n
    # Job 0's first bucket of 8 steps: its lowest loss is the one written between passes
    # (0.01), else step 6's (0.5).
    lowest = 0.01 if between.report is not None else 0.5
    assert stored_buckets(sessions, ids[0])[(8, 0)].lo_loss == lowest


def test_a_pass_stores_any_number_of_jobs_in_the_same_statements(
    engine: Engine, tmp_path: Path
) -> None:
    """A pass's steady reports cost a fixed set of statements and one commit, however many
    jobs report: what keeps a pass of a hundred running jobs short."""

    def statements_of_two_passes(n: int) -> list[list[str]]:
        sessions = make_session_factory(engine)
        ids = running_jobs(sessions, n)
        executor = Executor(
            sessions=sessions, launcher=FakeLauncher({}), storage_path=tmp_path, timers=Timers()
        )
        passes = []
        # Steps 3-4, then 7-8: the second pass finds its open buckets in the executor's
        # cache, changes them and opens new ones.
        for seq in (1, 2):
            batch = [(view(sessions, i), PersistReport(report=report(seq, 4 * seq - 1, 4 * seq)))
                     for i in ids]  # fmt: skip
            with recorded_statements(engine) as statements:
                executor.execute_steady(batch)
            passes.append(statements)
            for job_id in ids:
                assert sorted(metric_rows(sessions, job_id)) == [3, 4, 7, 8][: 2 * seq]
        return passes

    few, many = statements_of_two_passes(2), statements_of_two_passes(7)
    assert few == many, (few, many)
    for statements in few:
        assert statements[0].startswith("SELECT JOBS.") and statements[-1] == "COMMIT"
        assert statements.count("INSERT INTO METRICS") == 1
    assert "INSERT INTO METRIC_BUCKETS" in few[1] and "UPDATE METRIC_BUCKETS SET" in few[1]
