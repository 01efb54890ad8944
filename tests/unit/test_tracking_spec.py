"""The spec's `tracking` section: bad values are 422s naming the field, and a tracker
whose client package the control plane lacks is refused at submit, saying which extra to
install."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import select

from elastrain.api.main import create_app
from elastrain.service.db import session_scope
from elastrain.service.models import TrackerRun
from elastrain.service.settings import Settings
from tests.factories import spec_dict

MLFLOW = {"tracking_uri": "file:///tmp/mlruns", "experiment": "exp"}
WANDB = {"project": "elastrain-runs", "mode": "offline"}


@pytest.fixture(scope="module")
def api(tmp_path_factory: pytest.TempPathFactory) -> Iterator[TestClient]:
    root: Path = tmp_path_factory.mktemp("tracking")
    settings = Settings(
        database_url=f"sqlite:///{root / 'db.sqlite'}",
        storage_path=root / "st",
        mlflow_tracking_uri=MLFLOW["tracking_uri"],  # the operator's own: a file store
    )
    with TestClient(create_app(settings)) as client:
        yield client


def rejected(api: TestClient, tracking: Any) -> str:
    response = api.post("/v1/jobs", json=spec_dict(tracking=tracking))
    assert response.status_code == 422, response.text
    message: str = response.json()["message"]
    return message


@pytest.mark.parametrize(
    ("tracking", "field"),
    [
        ({"mlflow": {"tracking_uri": "file:///elsewhere"}}, "tracking.mlflow.tracking_uri"),
        ({"mlflow": {"tracking_uri": "ftp://host/x"}}, "tracking.mlflow.tracking_uri"),
        ({"mlflow": {"tracking_uri": "file:///a b"}}, "tracking.mlflow.tracking_uri"),
        ({"mlflow": {**MLFLOW, "experiment": ""}}, "tracking.mlflow.experiment"),
        ({"mlflow": {**MLFLOW, "run": "x"}}, "tracking.mlflow.run"),
        ({"wandb": {"mode": "offline"}}, "tracking.wandb.project"),
        ({"wandb": {"project": "a/b"}}, "tracking.wandb.project"),
        ({"wandb": {**WANDB, "mode": "sometimes"}}, "tracking.wandb.mode"),
        ({"neptune": {}}, "tracking.neptune"),
    ],
)
def test_bad_tracking_values_name_the_field(
    api: TestClient, tracking: dict[str, Any], field: str
) -> None:
    assert field in rejected(api, tracking)


def test_wandb_mode_lists_the_allowed_values(api: TestClient) -> None:
    message = rejected(api, {"wandb": {**WANDB, "mode": "sometimes"}})
    assert "offline" in message and "online" in message


@pytest.mark.parametrize(("name", "config"), [("mlflow", MLFLOW), ("wandb", WANDB)])
def test_a_tracker_without_its_client_is_refused_at_submit(
    api: TestClient, monkeypatch: pytest.MonkeyPatch, name: str, config: dict[str, Any]
) -> None:
    # `find_spec` answers None for a module set to None in sys.modules: as if not installed.
    monkeypatch.setitem(sys.modules, name, None)
    message = rejected(api, {name: config})
    assert f"tracking.{name}: install elastrain[{name}]" in message


def test_a_tracked_job_is_accepted_with_a_cursor_per_tracker(api: TestClient) -> None:
    response = api.post("/v1/jobs", json=spec_dict(tracking={"mlflow": MLFLOW, "wandb": WANDB}))
    assert response.status_code == 201, response.text
    job = response.json()
    assert job["spec"]["tracking"]["wandb"]["mode"] == "offline"
    sessions = api.app.state.session_factory  # type: ignore[attr-defined]
    with session_scope(sessions) as s:
        rows = s.scalars(select(TrackerRun).where(TrackerRun.job_id == job["id"])).all()
        assert sorted((r.tracker, r.done, r.metric_step) for r in rows) == [
            ("mlflow", False, -1),
            ("wandb", False, -1),
        ]
