"""`store_submitted_job`, the API's submit: on PostgreSQL one statement in autocommit (a
data-modifying CTE on the pool's DBAPI connection), elsewhere `insert_job`'s portable
statements. Both must store the same rows; the PostgreSQL path must also behave as
SQLAlchemy's execution would when the statement fails.
"""

from __future__ import annotations

from typing import Any, cast

import psycopg
import pytest
from sqlalchemy import JSON, Engine, Table, Text, event, insert, select
from sqlalchemy import cast as sql_cast
from sqlalchemy.exc import DataError, OperationalError
from sqlalchemy.orm import Session

from contracts.spec import JobSpec
from service.db import make_engine, migrate
from service.jobs import insert_job, job_row_values, store_submitted_job
from service.models import Event, Job, JobLabel
from tests.conftest import PG_ADMIN_URL
from tests.factories import spec_dict

_JOBS = cast(Table, Job.__table__)
_EVENTS = cast(Table, Event.__table__)
_LABELS = cast(Table, JobLabel.__table__)
#: Differ between two submits by nature: ids, and the clock read for each.
_PER_SUBMIT = {"id", "job_id", "created_at", "updated_at", "at"}


def _stored(session: Session, table: Table, key: Any, job_id: int) -> list[dict[str, Any]]:
    """The rows of `table` for the job, every column but the per-submit ones; JSON columns
    also as their stored text, so SQL NULL and JSON null differ."""
    columns = [c for c in table.c if c.name not in _PER_SUBMIT]
    texts = [sql_cast(c, Text).label(f"{c.name}_text") for c in columns if isinstance(c.type, JSON)]
    rows = session.execute(select(*columns, *texts).where(key == job_id).order_by(*table.c))
    return [dict(row._mapping) for row in rows]


def _everything(session: Session, job_id: int) -> dict[str, list[dict[str, Any]]]:
    return {
        "job": _stored(session, _JOBS, _JOBS.c.id, job_id),
        "labels": _stored(session, _LABELS, _LABELS.c.job_id, job_id),
        "events": _stored(session, _EVENTS, _EVENTS.c.job_id, job_id),
    }


@pytest.mark.parametrize(
    "overrides",
    [
        {"labels": {"team": "cv", "tier": "gold"}, "priority": 3},
        {"labels": {}},  # no labels: the PostgreSQL statement inserts none
        {"strategy": {"kind": "fsdp"}, "workload": {"name": "gpt", "params": {"n_layer": 2}}},
    ],
)
def test_store_submitted_job_stores_what_insert_job_stores(
    engine: Engine, overrides: dict[str, Any]
) -> None:
    spec = JobSpec.model_validate(spec_dict(**overrides))
    with Session(engine) as session:
        portable = insert_job(session, spec=spec, owner="acme")
        # The spec's columns alone, Core filling in the rest from the columns' defaults:
        # what `new_job_values` must agree with.
        core_id = session.scalar(
            insert(_JOBS).returning(_JOBS.c.id), job_row_values(spec, owner="acme")
        )
        session.commit()
    returned = store_submitted_job(engine, spec=spec, owner="acme")
    with Session(engine) as session:
        assert _everything(session, returned["id"]) == _everything(session, portable.id)
        assert (
            _stored(session, _JOBS, _JOBS.c.id, core_id) == _everything(session, portable.id)["job"]
        )
        row = session.execute(select(_JOBS).where(_JOBS.c.id == returned["id"])).one()
        event_at = session.scalars(
            select(_EVENTS.c.at).where(_EVENTS.c.job_id == returned["id"])
        ).one()
    # What the route answers with is the stored row, clock readings included.
    assert returned == dict(row._mapping)
    assert event_at == row.created_at  # as insert_job: the event is the job's creation
    assert 0 <= (row.updated_at - row.created_at).total_seconds() < 1
    assert returned["spec"]["labels"] == spec.labels


@pytest.fixture
def pg_engine(pg_database: str) -> Any:
    engine = make_engine(pg_database)
    migrate(engine)
    yield engine
    engine.dispose()


def _driver_autocommit(engine: Engine) -> bool:
    with engine.connect() as conn:
        return bool(conn.connection.driver_connection.autocommit)  # type: ignore[union-attr]


def test_a_failed_postgresql_submit_raises_sqlalchemys_error_and_leaves_the_pool_sound(
    pg_engine: Engine,
) -> None:
    spec = JobSpec.model_validate(spec_dict())
    with pytest.raises(DataError):  # the owner column is 100 characters at most
        store_submitted_job(pg_engine, spec=spec, owner="x" * 101)
    assert pg_engine.pool.checkedout() == 0
    assert _driver_autocommit(pg_engine) is False  # as every other user expects it
    job = store_submitted_job(pg_engine, spec=spec, owner="acme")
    with Session(pg_engine) as session:
        assert session.scalar(select(_JOBS.c.owner).where(_JOBS.c.id == job["id"])) == "acme"
        # Nothing of the failed submit was stored (one statement: all or nothing).
        assert session.scalar(select(_JOBS.c.id).where(_JOBS.c.owner != "acme")) is None


def test_a_connection_lost_mid_submit_is_an_operational_error_and_is_replaced(
    pg_engine: Engine,
) -> None:
    """The API answers an OperationalError with a 503; the lost connection must not go
    back to the pool."""
    spec = JobSpec.model_validate(spec_dict())
    store_submitted_job(pg_engine, spec=spec, owner="acme")  # a pooled connection to kill

    def kill(dbapi_conn: Any, *_: Any) -> None:  # after the pool's ping: lost mid-submit
        with psycopg.connect(PG_ADMIN_URL, autocommit=True) as admin:
            admin.execute("SELECT pg_terminate_backend(%s)", [dbapi_conn.info.backend_pid])

    event.listen(pg_engine, "checkout", kill)
    try:
        with pytest.raises(OperationalError) as lost:
            store_submitted_job(pg_engine, spec=spec, owner="acme")
        assert lost.value.connection_invalidated
    finally:
        event.remove(pg_engine, "checkout", kill)
    assert pg_engine.pool.checkedout() == 0
    job = store_submitted_job(pg_engine, spec=spec, owner="acme")
    assert job["id"] > 0 and _driver_autocommit(pg_engine) is False
