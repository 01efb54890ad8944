"""`GET /v1/jobs/{id}/metrics?max_points=`: a long curve in a few real rows, its shape kept,
on SQLite and PostgreSQL; retention thins a finished job's rows without changing it."""

from __future__ import annotations

import math
from datetime import UTC, datetime, timedelta
from typing import Any

from fastapi.testclient import TestClient
from sqlalchemy import func, select

from elastrain.service import metric_store
from elastrain.service.db import session_scope
from elastrain.service.jobs import get_job, set_job_state
from elastrain.service.models import Metric
from elastrain.service.reports import record_metrics
from elastrain.service.states import JobState
from tests.integration.test_api import Sessions, run, submit

STEPS = 20_000
SPIKE, DIP, STALL = 4_321, 15_555, 9_999


def values(step: int) -> dict[str, Any]:
    point: dict[str, Any] = {
        "step": step,
        "loss": 3.0 * math.exp(-step / 5000) + 0.01 * math.sin(step),
        "step_time_s": 0.1,
    }
    if step == SPIKE:
        point["loss"] = 40.0
    if step == DIP:
        point["loss"] = -2.0
    if step == STALL:
        point["step_time_s"] = 30.0
    if step % 500 == 0:
        point["eval_loss"] = point["loss"] + 0.1
    return point


def long_job(client: TestClient, sessions: Sessions) -> int:
    job_id: int = submit(client)["id"]
    run(sessions, job_id)
    # As the scheduler stores them: one report's points at a time.
    for start in range(1, STEPS + 1, 1000):
        with session_scope(sessions) as s:
            points = [values(i) for i in range(start, min(start + 1000, STEPS + 1))]
            record_metrics(s, get_job(s, job_id), attempt=1, points=points)
    return job_id


def get(client: TestClient, job_id: int, **params: Any) -> list[dict[str, Any]]:
    response = client.get(f"/v1/jobs/{job_id}/metrics", params=params)
    assert response.status_code == 200, response.text
    rows: list[dict[str, Any]] = response.json()
    return rows


def test_downsampled_curve_keeps_its_shape(client: TestClient, app_sessions: Sessions) -> None:
    job_id = long_job(client, app_sessions)
    got = get(client, job_id, max_points=500)
    steps = [p["step"] for p in got]
    assert len(got) <= 500 and steps == sorted(steps)
    assert steps[0] == 1 and steps[-1] == STEPS
    assert {SPIKE, DIP, STALL} <= set(steps)
    for p in got:  # real rows: every value of that step, as reported
        assert p["loss"] == values(p["step"])["loss"] and p["attempt"] == 1
    evals = [p for p in got if "eval_loss" in p]
    assert len(evals) >= 30  # of 40 held-out points, at most one per group is kept

    # A range: the first and last step of it, inside it.
    window = get(client, job_id, max_points=100, since_step=4000, until_step=6000)
    assert window[0]["step"] == 4000 and window[-1]["step"] == 6000 and len(window) <= 100
    assert SPIKE in {p["step"] for p in window}
    # Fits: every step.
    assert [
        p["step"] for p in get(client, job_id, max_points=300, since_step=101, until_step=400)
    ] == list(range(101, 401))
    # Without max_points: pages of raw rows, as before.
    assert len(get(client, job_id, since_step=1)) == 10_000


def test_max_points_bounds_are_422(client: TestClient) -> None:
    job_id = submit(client)["id"]
    for bad in (1, 10_001, -5):
        response = client.get(f"/v1/jobs/{job_id}/metrics", params={"max_points": bad})
        assert response.status_code == 422, response.text
        assert "max_points" in response.json()["message"]


def test_retention_thins_a_finished_job_and_the_curve_stays(
    client: TestClient, app_sessions: Sessions
) -> None:
    job_id = long_job(client, app_sessions)
    before = get(client, job_id, max_points=500)
    now = datetime.now(UTC)
    with session_scope(app_sessions) as s:
        job = get_job(s, job_id)
        # Not finished: never thinned.
        assert metric_store.jobs_to_thin(s, finished_before=now) == []
        set_job_state(s, job, JobState.SUCCEEDED, reason="done")
    with session_scope(app_sessions) as s:
        assert metric_store.jobs_to_thin(s, finished_before=now - timedelta(days=1)) == []
        [job] = metric_store.jobs_to_thin(s, finished_before=now + timedelta(seconds=5))
        deleted = metric_store.thin(s, job, now=now)
    with session_scope(app_sessions) as s:
        left = s.scalar(select(func.count()).select_from(Metric).where(Metric.job_id == job_id))
        assert metric_store.jobs_to_thin(s, finished_before=now + timedelta(seconds=5)) == []
    assert left is not None and deleted == STEPS - left
    assert left < STEPS / 10  # about 4 rows in 64 (fewer where they coincide)
    after = get(client, job_id, max_points=500)
    assert after == before  # the same rows, from a tenth of the table
    # Zoomed in further than retention kept: fewer points, the extremes still there.
    window = get(client, job_id, max_points=2000, since_step=4000, until_step=6000)
    assert SPIKE in {p["step"] for p in window} and len(window) < 2001 - 1000
