"""Many running jobs' reports stored together (`reports.persist_steady_reports`, what a
scheduler pass does) leave exactly what storing each job's report alone leaves: metric
rows, bucket summaries, the jobs' steps, losses and goodput sums, the attempts'
acknowledged sequence numbers. On SQLite and PostgreSQL."""

from __future__ import annotations

from typing import Any

from sqlalchemy import Engine, select
from sqlalchemy.orm import Session, sessionmaker

from contracts.messages import DriverReport, DriverStatus, StepMetrics
from contracts.spec import JobSpec
from service import jobs, reports
from service.db import make_session_factory, session_scope
from service.models import Job, Metric, MetricBucket
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


def store(sessions: sessionmaker[Session], *, together: bool) -> dict[str, Any]:
    ids = []
    with session_scope(sessions) as s:
        for i in range(JOBS):
            spec = JobSpec.model_validate({"name": f"j{i}", "workload": {"name": "synthetic"}})
            ids.append(jobs.create_job(s, spec=spec).id)
    for job_id in ids:
        run(sessions, job_id, world_size=1)
    for reports_of_pass in PASSES:
        with session_scope(sessions) as s:
            rows = [jobs.get_job(s, job_id) for job_id in ids]
            if together:
                attempts = jobs.current_attempts(s, rows)
                reports.persist_steady_reports(
                    s, [(j, attempts[j.id], r) for j, r in zip(rows, reports_of_pass, strict=True)]
                )
            else:
                for j, r in zip(rows, reports_of_pass, strict=True):
                    reports.persist_report(s, j, r)
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


def test_reports_stored_together_equal_reports_stored_one_by_one(engine: Engine) -> None:
    sessions = make_session_factory(engine)
    together = store(sessions, together=True)  # jobs 1-3
    alone = store(sessions, together=False)  # jobs 4-6, the same reports
    assert together == alone
    # And what the sequences say happened: the last report of a step won, recomputed
    # steps replaced their rows (job 0's step 3 now has the loss of the third pass).
    steps_of_0 = {step: values["loss"] for n, step, _, values in together["metrics"] if n == 0}
    assert sorted(steps_of_0) == [1, 2, 3, 4, 5]
    assert steps_of_0[3] == 1.0 / 3
    assert together["seqs"] == [3, 4, 2]
    assert [row[1] for row in together["jobs"]] == [5, 4, 71]
