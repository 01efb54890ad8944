"""The application factory: lifespan wiring, scheduler start/stop, cheap import."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import inspect

from elastrain.api.main import create_app
from elastrain.service.settings import Settings


class FakeSchedulerHandle:
    def __init__(self) -> None:
        self.stopped = False

    def stop(self) -> None:
        self.stopped = True


def _settings(tmp_path: Path) -> Settings:
    return Settings(database_url=f"sqlite:///{tmp_path / 'app.db'}", storage_path=tmp_path / "st")


def test_lifespan_migrates_and_starts_no_scheduler_by_default(tmp_path: Path) -> None:
    app = create_app(_settings(tmp_path))
    with TestClient(app) as client:
        assert "jobs" in inspect(app.state.engine).get_table_names()
        assert app.state.scheduler is None
        assert client.get("/healthz").json()["scheduler"] is False
    assert (tmp_path / "st").is_dir()


def test_scheduler_is_started_and_stopped_with_the_app(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import elastrain.service.scheduler

    started: list[tuple[Any, Any]] = []
    handle = FakeSchedulerHandle()

    def fake_start(settings: Settings, session_factory: Any) -> FakeSchedulerHandle:
        started.append((settings, session_factory))
        return handle

    monkeypatch.setattr(elastrain.service.scheduler, "start_scheduler_thread", fake_start)
    settings = _settings(tmp_path)
    app = create_app(settings, start_scheduler=True)
    with TestClient(app) as client:
        assert started == [(settings, app.state.session_factory)]
        assert client.get("/healthz").json()["scheduler"] is True
        assert not handle.stopped
    assert handle.stopped


def test_storage_path_is_made_absolute(tmp_path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """Ray workers run elsewhere: a relative storage path (the default) must not reach them."""
    from elastrain.service.settings import Settings

    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("ELASTRAIN_STORAGE_PATH", raising=False)
    assert Settings().storage_path == tmp_path / ".elastrain" / "storage"
    assert Settings(storage_path="rel/dir").storage_path == tmp_path / "rel" / "dir"
