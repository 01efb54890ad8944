"""Tracking destinations are the operator's (issue 45, item 4): the pure check, row by row,
then the real API with auth on: a loopback listener named as a job's tracker, a `file://`
store and the service's own database are 422s naming the field, and the listener is never
connected to; the operator's credentials go to the operator's tracker only."""

from __future__ import annotations

import os
import socket
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient

from elastrain.api.main import create_app
from elastrain.contracts.spec import JobSpec
from elastrain.service.settings import Settings
from elastrain.service.tracking import make_tracker
from elastrain.service.tracking.base import TrackerError
from elastrain.service.tracking.destinations import (
    is_internal,
    is_operator_tracker,
    mlflow_uri_problem,
    parse_allowed,
)
from tests.factories import spec_dict

ALLOWED = parse_allowed(["https://mlflow.example.com", "http://10.0.0.5:5000"])
OPERATOR = "https://tracker.internal.example:8443"


@pytest.mark.parametrize(
    ("uri", "ok"),
    [
        (None, True),  # the operator's tracker
        (OPERATOR, True),
        (OPERATOR + "/some/path", True),
        ("https://mlflow.example.com", True),
        ("https://MLflow.Example.com./api", True),  # case and a trailing dot: the same host
        ("https://mlflow.example.com:443", True),  # the default port is the same origin
        ("http://10.0.0.5:5000", True),  # internal, but listed by the operator
        ("http://mlflow.example.com", False),  # another scheme
        ("https://mlflow.example.com:8443", False),  # another port
        ("https://evil.example.com", False),
        ("https://mlflow.example.com@127.0.0.1/", False),  # user info: whose host?
        ("http://127.0.0.1:5000", False),
        ("http://localhost:5000", False),
        ("http://[::1]:5000", False),
        ("http://169.254.169.254/latest", False),  # the cloud metadata address
        ("http://10.0.0.6:5000", False),
        ("file:///srv/storage/data/b/mlruns", False),
        ("/srv/mlruns", False),
        ("sqlite:////srv/elastrain.db", False),
        ("postgresql://postgres@127.0.0.1/test", False),
        ("mysql+pymysql://u:p@db/x", False),
        ("databricks", False),
    ],
)
def test_which_destinations_a_job_may_name(uri: str | None, ok: bool) -> None:
    problem = mlflow_uri_problem(uri, allowed=ALLOWED, operator_uri=OPERATOR)
    assert (problem is None) == ok, problem
    if problem is not None:
        assert problem.startswith("tracking.mlflow.tracking_uri: ")


def test_no_operator_tracker_means_a_job_must_name_a_listed_one() -> None:
    problem = mlflow_uri_problem(None, allowed=[], operator_uri=None)
    assert problem is not None and "ELASTRAIN_MLFLOW_TRACKING_URI" in problem


@pytest.mark.parametrize(
    ("host", "internal"),
    [
        ("127.0.0.1", True),
        ("::1", True),
        ("::ffff:127.0.0.1", True),
        ("10.1.2.3", True),
        ("192.168.0.1", True),
        ("169.254.169.254", True),
        ("localhost", True),
        ("a.localhost", True),
        ("0.0.0.0", True),
        ("8.8.8.8", False),
        ("mlflow.example.com", False),
    ],
)
def test_internal_addresses(host: str, internal: bool) -> None:
    assert is_internal(host) == internal


def test_the_allow_list_holds_origins_only() -> None:
    for bad in ("file:///x", "https://host/path", "https://u@host", "host:5000"):
        with pytest.raises(ValueError, match="ELASTRAIN_TRACKING_ALLOWED_URIS"):
            parse_allowed([bad])
    with pytest.raises(ValueError, match="TRACKING_ALLOWED_URIS"):
        Settings(tracking_allowed_uris="https://ok.example,file:///x")  # type: ignore[arg-type]


def test_operator_credentials_go_to_the_operators_tracker_only() -> None:
    assert is_operator_tracker("https://tracker.internal.example:8443/x", OPERATOR)
    assert not is_operator_tracker("https://mlflow.example.com", OPERATOR)
    assert not is_operator_tracker("https://mlflow.example.com", None)


def test_the_forwarder_refuses_a_stored_destination_and_calls_others_without_credentials(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A job stored before the rule: its tracker is refused when made (nothing sent).
    An allowed server that is not the operator's: MLflow sees no credentials on a call."""
    from elastrain.service.tracking.mlflow_tracker import MlflowTracker

    settings = Settings(
        mlflow_tracking_uri=OPERATOR, tracking_allowed_uris=["https://mlflow.example.com"]
    )
    stored = JobSpec.model_validate(
        spec_dict(tracking={"mlflow": {"tracking_uri": "http://127.0.0.1:9"}})
    )
    with pytest.raises(TrackerError, match="refused, nothing sent"):
        make_tracker("mlflow", stored, settings)

    monkeypatch.setenv("MLFLOW_TRACKING_TOKEN", "operator-secret")
    other = make_tracker(
        "mlflow",
        JobSpec.model_validate(
            spec_dict(tracking={"mlflow": {"tracking_uri": "https://mlflow.example.com"}})
        ),
        settings,
    )
    mine = make_tracker(
        "mlflow", JobSpec.model_validate(spec_dict(tracking={"mlflow": {}})), settings
    )
    assert isinstance(other, MlflowTracker) and isinstance(mine, MlflowTracker)
    seen: list[str | None] = []
    other._call(lambda: seen.append(os.environ.get("MLFLOW_TRACKING_TOKEN")))
    mine._call(lambda: seen.append(os.environ.get("MLFLOW_TRACKING_TOKEN")))
    assert seen == [None, "operator-secret"]
    assert os.environ["MLFLOW_TRACKING_TOKEN"] == "operator-secret"  # restored


class Listener:
    """A real TCP listener on loopback that records every connection made to it."""

    def __init__(self) -> None:
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen()
        self.sock.settimeout(0.2)
        self.port: int = self.sock.getsockname()[1]
        self.connections = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self.sock.accept()
            except OSError:
                continue
            self.connections += 1
            conn.close()

    def close(self) -> None:
        self._stop.set()
        self._thread.join(2)
        self.sock.close()


@pytest.fixture
def served(tmp_path: Path) -> Iterator[tuple[TestClient, Listener, Settings]]:
    listener = Listener()
    settings = Settings(
        database_url=f"sqlite:///{tmp_path / 'db.sqlite'}",
        storage_path=tmp_path / "storage",
        api_token="operator-admin-token-0123456789",  # type: ignore[arg-type]
        mlflow_tracking_uri="https://tracker.internal.example",
        tracking_allowed_uris=["https://mlflow.example.com"],
    )
    try:
        with TestClient(create_app(settings)) as client:
            client.headers["Authorization"] = "Bearer operator-admin-token-0123456789"
            yield client, listener, settings
    finally:
        listener.close()


def test_the_api_refuses_a_tenants_own_destinations_and_never_connects(
    served: tuple[TestClient, Listener, Settings],
) -> None:
    client, listener, settings = served
    uris: list[Any] = [
        f"http://127.0.0.1:{listener.port}",
        f"http://localhost:{listener.port}/api",
        f"file://{settings.storage_path}/data/b/mlruns",
        settings.database_url,  # the service's own database
    ]
    for uri in uris:
        answer = client.post("/v1/jobs", json=spec_dict(tracking={"mlflow": {"tracking_uri": uri}}))
        assert answer.status_code == 422, answer.text
        assert answer.json()["message"].startswith("tracking.mlflow.tracking_uri: "), answer.text
    assert client.get("/v1/jobs").json()["total"] == 0  # nothing stored
    ok = client.post("/v1/jobs", json=spec_dict(tracking={"mlflow": {}}))
    assert ok.status_code == 201, ok.text
    assert listener.connections == 0
