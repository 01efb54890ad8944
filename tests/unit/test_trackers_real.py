"""The real MLflow and W&B trackers under the forwarder, without Ray: a control plane
that restarts mid-job goes on in the same MLflow run and the same W&B run id, and every
point arrives once. (tests/integration/test_tracking_ray.py runs a real job.)"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from mlflow.tracking import MlflowClient
from sqlalchemy.orm import Session, sessionmaker

from elastrain.contracts.spec import JobSpec
from elastrain.service import jobs
from elastrain.service.db import session_scope
from elastrain.service.models import TrackerRun
from elastrain.service.states import JobState
from elastrain.service.tracking.forwarder import Forwarder
from tests.factories import spec_dict
from tests.integration.wandb_offline import read_run
from tests.unit.test_tracking_forwarder import report, start


@pytest.fixture
def tracker_env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    yield tmp_path


def test_a_restarted_forwarder_goes_on_in_the_same_runs(
    session_factory: sessionmaker[Session], tracker_env: Path
) -> None:
    uri = f"file://{tracker_env / 'mlruns'}"
    tracking: dict[str, Any] = {
        "mlflow": {"tracking_uri": uri, "experiment": "unit"},
        "wandb": {"project": "unit", "mode": "offline"},
    }
    spec = JobSpec.model_validate(spec_dict(tracking=tracking))
    with session_scope(session_factory) as s:
        job_id = jobs.create_job(s, spec=spec).id
    start(session_factory, job_id)
    report(session_factory, job_id, range(1, 4))
    first = Forwarder(session_factory)
    assert first.run_pass() == 2
    first.close()  # the control plane stops

    report(session_factory, job_id, range(4, 7))
    with session_scope(session_factory) as s:
        jobs.set_job_state(s, jobs.get_job(s, job_id), JobState.SUCCEEDED, reason="done")
    Forwarder(session_factory).run_pass()

    with session_scope(session_factory) as s:
        runs = {r.tracker: r for r in s.query(TrackerRun).filter_by(job_id=job_id)}
    assert all(r.done and r.failures == 0 and r.metric_step == 6 for r in runs.values())

    client = MlflowClient(tracking_uri=uri)
    experiment = client.get_experiment_by_name("unit")
    assert experiment is not None
    [run] = client.search_runs([experiment.experiment_id])
    assert run.info.run_id == runs["mlflow"].run_id and run.info.status == "FINISHED"
    history = client.get_metric_history(run.info.run_id, "loss")
    assert sorted((m.step, m.value) for m in history) == [(i, 10.0 - i) for i in range(1, 7)]

    # W&B writes one offline file per process that had the run open: one run id, the
    # points split between them, none twice.
    files = sorted(tracker_env.glob("wandb/offline-run-*/run-*.wandb"))
    assert len(files) == 2
    parts = [read_run(f) for f in files]
    assert {p.run_id for p in parts} == {runs["wandb"].run_id}
    steps = [h["_step"] for p in parts for h in p.history if "loss" in h]
    assert sorted(steps) == list(range(1, 7))
    assert parts[-1].summary["elastrain/state"] == "SUCCEEDED" and parts[-1].exit_code == 0
