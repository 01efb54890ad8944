"""Retention as the service runs it: decided in the job's transaction, storage scanned once
that has committed and with no lock held, then catalogue rows and folders deleted for real.

Real databases (SQLite and PostgreSQL), real checkpoint folders; no Ray.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import psycopg
import pytest
from sqlalchemy import select
from sqlalchemy.orm import Session, sessionmaker

from elastrain.checkpoints.layout import step_dir_name
from elastrain.checkpoints.retention import retention_plan
from elastrain.contracts.spec import JobSpec
from elastrain.contracts.storage import JobStorage
from elastrain.service import executor as executor_module
from elastrain.service import jobs, observe
from elastrain.service.db import session_scope
from elastrain.service.decisions import ApplyRetention
from elastrain.service.executor import Executor, Timers
from elastrain.service.models import CheckpointRecord
from tests.unit.test_checkpoints_pure import make_checkpoint


class NoRuntime:
    """Retention needs no runtime: any call to it is a mistake."""

    def __getattr__(self, name: str) -> Any:
        raise AssertionError(f"retention called the runtime's {name}")


def _job_with_checkpoints(sessions: sessionmaker[Session], storage: Path) -> tuple[int, Path]:
    """A job whose storage holds committed steps 1-4 (each in the catalogue), garbage from
    a crashed save of step 2, and a save of step 6 that may be in progress."""
    spec = JobSpec.model_validate(
        {"name": "r", "workload": {"name": "synthetic"}, "checkpoint": {"keep_last": 2}}
    )
    with session_scope(sessions) as session:
        job_id = jobs.create_job(session, spec=spec).id
        root = JobStorage.of(storage, job_id).checkpoints
        for step in range(1, 5):
            path = make_checkpoint(root, step)
            session.add(
                CheckpointRecord(job_id=job_id, step=step, attempt=0, world_size=2, path=str(path))
            )
    make_checkpoint(root, 2, attempt=9, commit=False)
    make_checkpoint(root, 6, commit=False)
    return job_id, root


def _apply_retention(sessions: sessionmaker[Session], storage: Path, job_id: int) -> bool:
    executor = Executor(
        sessions=sessions,
        launcher=NoRuntime(),  # type: ignore[arg-type]
        storage_path=storage,
        timers=Timers(),
    )
    with session_scope(sessions) as session:
        view = observe.view_of(session, jobs.get_job(session, job_id))
    return executor.execute(view, [ApplyRetention(keep_last=2)])


def _catalogued_steps(sessions: sessionmaker[Session], job_id: int) -> list[int]:
    with session_scope(sessions) as session:
        rows = session.scalars(
            select(CheckpointRecord.step)
            .where(CheckpointRecord.job_id == job_id)
            .order_by(CheckpointRecord.step)
        )
        return list(rows)


def test_retention_deletes_rows_and_folders_beyond_the_last_k(
    session_factory: sessionmaker[Session], tmp_path: Path
) -> None:
    storage = tmp_path / "storage"
    job_id, root = _job_with_checkpoints(session_factory, storage)

    assert _apply_retention(session_factory, storage, job_id)

    assert _catalogued_steps(session_factory, job_id) == [3, 4]
    assert sorted(p.name for p in root.iterdir()) == [
        step_dir_name(3, 0),
        step_dir_name(4, 0),
        step_dir_name(6, 0),  # may be a save in progress: kept
    ]
    # Again: nothing more goes; the newest committed and its predecessor stay.
    assert _apply_retention(session_factory, storage, job_id)
    assert _catalogued_steps(session_factory, job_id) == [3, 4]
    assert retention_plan(root, keep_last=2) == []


def test_storage_is_scanned_with_no_lock_on_the_job(
    pg_database: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """While retention reads storage, another writer can take the job's row at once."""
    from elastrain.service.db import make_engine, make_session_factory, migrate

    engine = make_engine(pg_database)
    migrate(engine)
    sessions = make_session_factory(engine)
    storage = tmp_path / "storage"
    job_id, _ = _job_with_checkpoints(sessions, storage)
    scans: list[str] = []

    def scan_while_another_writer_locks_the_job(*args: Any, **kwargs: Any) -> Any:
        with psycopg.connect(pg_database, autocommit=False) as other:
            try:
                other.execute("SELECT id FROM jobs WHERE id = %s FOR UPDATE NOWAIT", (job_id,))
                scans.append("unlocked")
            except psycopg.errors.LockNotAvailable:
                scans.append("locked")
        return retention_plan(*args, **kwargs)

    monkeypatch.setattr(executor_module, "retention_plan", scan_while_another_writer_locks_the_job)
    try:
        assert _apply_retention(sessions, storage, job_id)
    finally:
        engine.dispose()
    assert scans == ["unlocked"]
