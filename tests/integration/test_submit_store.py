"""A submit: `elastrain.service.jobs.insert_job` in the API's one transaction stores the job's row,
its labels and its "submitted" event, whole or not at all, and answers with the row it
stored. On SQLite and PostgreSQL (the fixtures run each test on both)."""

from __future__ import annotations

from pathlib import Path
from typing import Any, cast

import psycopg
import pytest
from fastapi.testclient import TestClient
from sqlalchemy import Engine, Table, event, func, select
from sqlalchemy.exc import OperationalError
from sqlalchemy.orm import Session, sessionmaker

from elastrain.api.main import create_app
from elastrain.contracts.spec import JobSpec
from elastrain.service.jobs import create_job, insert_job
from elastrain.service.models import Event, Job, JobLabel
from elastrain.service.settings import Settings
from tests.conftest import PG_ADMIN_URL
from tests.factories import spec_dict

_JOBS = cast(Table, Job.__table__)

#: What a new job's row holds besides what its spec gives and its clock readings.
NEW_JOB = {
    "state": "PENDING", "state_reason": None, "attempt": 0, "restarts": 0,
    "world_size": None, "step": 0, "latest_loss": None, "last_error": None,
    "cancel_requested": False, "checkpoint_requested": False, "started_at": None,
    "finished_at": None, "below_min_since": None, "seconds_in": {}, "state_since": None,
    "compute_s": 0.0, "kept_s": 0.0, "stall_s": 0.0, "metrics_thinned_at": None,
}  # fmt: skip


@pytest.mark.parametrize(
    "overrides",
    [
        {"labels": {"team": "cv", "tier": "gold"}, "priority": 3},
        {"labels": {}},
        {"strategy": {"kind": "fsdp"}, "workload": {"name": "gpt", "params": {"n_layer": 2}}},
    ],
    ids=["labels", "no-labels", "fsdp-gpt"],
)
def test_a_submit_stores_the_job_its_labels_and_its_event(
    engine: Engine, overrides: dict[str, Any]
) -> None:
    spec = JobSpec.model_validate(spec_dict(**overrides))
    with Session(engine) as session:
        job = insert_job(session, spec=spec, owner="acme")
        session.commit()
    answered = dict(job._mapping)
    with Session(engine) as session:
        row = dict(session.execute(select(_JOBS).where(_JOBS.c.id == job.id)).one()._mapping)
        loaded = create_job(session, spec=spec, owner="acme")  # the same, as an ORM object
        assert {c.name: getattr(loaded, c.name) for c in _JOBS.c} == {
            **row, "id": loaded.id, "created_at": loaded.created_at,
            "updated_at": loaded.updated_at,
        }  # fmt: skip
        labels = {
            key: value
            for key, value in session.execute(
                select(JobLabel.key, JobLabel.value).where(JobLabel.job_id == job.id)
            )
        }
        [submitted] = session.scalars(select(Event).where(Event.job_id == job.id)).all()
    # The job it returns (what the API answers with) is the row as stored, to the column.
    assert answered == row
    assert {k: row[k] for k in NEW_JOB} == NEW_JOB
    assert row["spec"] == spec.model_dump(mode="json")
    assert (row["owner"], row["name"], row["priority"]) == ("acme", spec.name, spec.priority)
    assert (row["strategy"], row["min_workers"], row["max_workers"], row["max_steps"]) == (
        spec.strategy.label, spec.scaling.min_workers, spec.scaling.max_workers,
        spec.training.max_steps,
    )  # fmt: skip
    assert 0 <= (row["updated_at"] - row["created_at"]).total_seconds() < 1
    assert labels == spec.labels
    assert (submitted.kind, submitted.from_state, submitted.to_state, submitted.reason) == (
        "transition", None, "PENDING", "submitted",
    )  # fmt: skip
    assert (submitted.attempt, submitted.step, submitted.details) == (0, None, None)
    assert submitted.at == row["created_at"]  # the event is the job's creation


def _stored(sessions: sessionmaker[Session]) -> tuple[int, int, int]:
    with sessions() as s:
        return (
            s.scalar(select(func.count()).select_from(Job)) or 0,
            s.scalar(select(func.count()).select_from(JobLabel)) or 0,
            s.scalar(select(func.count()).select_from(Event)) or 0,
        )


def test_a_submit_that_fails_midway_stores_nothing(
    client: TestClient, app_sessions: sessionmaker[Session]
) -> None:
    """The database goes away between the job's INSERT and its event's: the API answers
    503 as for any lost database, and no job without its event (or labels without their
    job) is left behind. The next submit stores its job whole."""
    engine: Engine = client.app.state.engine  # type: ignore[attr-defined]

    def fail_at_the_event(_conn: Any, _cursor: Any, sql: str, *_: Any) -> None:
        if sql.upper().startswith("INSERT INTO EVENTS"):
            raise OperationalError(sql, None, ConnectionError("server closed the connection"))

    event.listen(engine, "before_cursor_execute", fail_at_the_event)
    try:
        response = client.post("/v1/jobs", json=spec_dict(labels={"team": "cv"}))
    finally:
        event.remove(engine, "before_cursor_execute", fail_at_the_event)
    assert response.status_code == 503, response.text
    assert response.json() == {"detail": "the database is unavailable; try again shortly"}
    assert _stored(app_sessions) == (0, 0, 0)
    assert client.post("/v1/jobs", json=spec_dict(labels={"team": "cv"})).status_code == 201
    assert _stored(app_sessions) == (1, 1, 1)


def test_a_postgresql_connection_lost_mid_submit_is_a_503_and_is_replaced(
    pg_database: str, tmp_path: Path
) -> None:
    """A real lost connection (its server process terminated after the pool handed it
    out): 503, and the pool gives the next submit a sound connection."""
    settings = Settings(database_url=pg_database, storage_path=tmp_path / "storage")
    with TestClient(create_app(settings, start_scheduler=False)) as client:
        engine: Engine = client.app.state.engine  # type: ignore[attr-defined]
        sessions: sessionmaker[Session] = client.app.state.session_factory  # type: ignore[attr-defined]
        assert client.post("/v1/jobs", json=spec_dict()).status_code == 201  # one to kill

        def kill(dbapi_conn: Any, *_: Any) -> None:  # after the pool's ping: lost mid-submit
            with psycopg.connect(PG_ADMIN_URL, autocommit=True) as admin:
                admin.execute("SELECT pg_terminate_backend(%s)", [dbapi_conn.info.backend_pid])

        event.listen(engine, "checkout", kill)
        try:
            lost = client.post("/v1/jobs", json=spec_dict())
        finally:
            event.remove(engine, "checkout", kill)
        assert lost.status_code == 503, lost.text
        assert client.post("/v1/jobs", json=spec_dict()).status_code == 201
        assert _stored(sessions) == (2, 2, 2)
        assert engine.pool.checkedout() == 0  # type: ignore[attr-defined]
