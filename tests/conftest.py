"""Shared fixtures: a fresh database per test on SQLite AND PostgreSQL, and an API client.

PostgreSQL is the real server at 127.0.0.1:5432 (override with ELASTRAIN_TEST_PG_ADMIN). If
it cannot be reached the PostgreSQL half of the tests FAILS: a silent skip would let a
broken PostgreSQL path pass CI.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest
from fastapi.testclient import TestClient
from sqlalchemy import Engine
from sqlalchemy.orm import Session, sessionmaker

from elastrain.api.main import create_app
from elastrain.service.db import make_engine, make_session_factory, migrate
from elastrain.service.settings import Settings

# Starlette's TestClient sends `Host: testserver`; every app the tests build must answer it
# (tests of the host check pass their own `allowed_hosts`).
os.environ.setdefault("ELASTRAIN_ALLOWED_HOSTS", "localhost,127.0.0.1,::1,testserver")

PG_ADMIN_URL = os.environ.get(
    "ELASTRAIN_TEST_PG_ADMIN", "postgresql://postgres@127.0.0.1:5432/test"
)
BACKENDS = ("sqlite", "postgresql")


def _pg_server_url(database: str) -> str:
    base, _, _ = PG_ADMIN_URL.rpartition("/")
    return f"{base}/{database}"


@pytest.fixture
def pg_database() -> Iterator[str]:
    """A uniquely named, empty PostgreSQL database, dropped afterwards. Yields its URL."""
    name = f"elastrain_test_{uuid.uuid4().hex[:12]}"
    try:
        admin = psycopg.connect(PG_ADMIN_URL, autocommit=True, connect_timeout=5)
    except psycopg.OperationalError as exc:
        pytest.fail(
            f"PostgreSQL is required for these tests and unreachable at {PG_ADMIN_URL}: {exc}"
        )
    with admin:
        admin.execute(f'CREATE DATABASE "{name}"')
    try:
        yield _pg_server_url(name)
    finally:
        with psycopg.connect(PG_ADMIN_URL, autocommit=True) as admin:
            # FORCE: a connection an engine forgot to close must not leak the database.
            admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


@pytest.fixture(params=BACKENDS)
def db_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """A fresh, empty database: a SQLite file, or a new PostgreSQL database."""
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path / 'elastrain.db'}"
    url: str = request.getfixturevalue("pg_database")
    return url


@pytest.fixture
def engine(db_url: str) -> Iterator[Engine]:
    """A migrated engine on `db_url`."""
    eng = make_engine(db_url)
    migrate(eng)
    yield eng
    eng.dispose()


@pytest.fixture
def session_factory(engine: Engine) -> sessionmaker[Session]:
    return make_session_factory(engine)


@pytest.fixture
def settings(db_url: str, tmp_path: Path) -> Settings:
    return Settings(database_url=db_url, storage_path=tmp_path / "storage")


@pytest.fixture
def client(settings: Settings) -> Iterator[TestClient]:
    """The API on a fresh database, without the scheduler (tests drive state themselves)."""
    with TestClient(create_app(settings, start_scheduler=False)) as test_client:
        yield test_client


@pytest.fixture
def app_sessions(client: TestClient) -> sessionmaker[Session]:
    """Sessions on the client's database, to arrange states the scheduler would reach."""
    factory: sessionmaker[Session] = client.app.state.session_factory  # type: ignore[attr-defined]
    return factory
