"""A real job on real Ray, tracked in a real MLflow file store and a real offline W&B run:
its loss points, its spec (as params) and how it ended reach both trackers, forwarded by
the control plane (the workers have no tracker configuration at all)."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from fastapi.testclient import TestClient
from mlflow.tracking import MlflowClient
from sqlalchemy import select

from elastrain.service.db import session_scope
from elastrain.service.models import TrackerRun
from tests.integration.ray_service import losses, ray_service, submit, tiny_gpt_spec
from tests.integration.ray_service import wait_terminal as wait_job
from tests.integration.wandb_offline import read_run

# On a local Ray of its own, no timing asserted: `make test` runs it beside the other Ray tests.
pytestmark = [pytest.mark.ray, pytest.mark.beside]

STEPS = 12


@pytest.fixture(scope="module")
def tracked(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[TestClient, Path]]:
    tmp = tmp_path_factory.mktemp("tracking")
    with pytest.MonkeyPatch.context() as env:
        # The control plane's environment, not the job's: the forwarder runs there.
        env.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # MLflow 3 wants an opt-in for it
        env.setenv("WANDB_DIR", str(tmp / "wandb"))
        # An unreachable server fails fast (MLflow's client retries for minutes by default).
        env.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
        env.setenv("MLFLOW_HTTP_REQUEST_TIMEOUT", "5")
        (tmp / "wandb").mkdir()
        with ray_service(
            tmp,
            num_cpus=2,
            tracking_interval_s=0.3,
            # The operator's tracker (a file store), and a server nobody listens on that
            # the operator allows jobs to name.
            mlflow_tracking_uri=f"file://{tmp / 'mlruns'}",
            tracking_allowed_uris=["http://127.0.0.1:9"],
        ) as client:
            yield client, tmp


def forwarded(client: TestClient, job_id: int, timeout: float = 120) -> list[TrackerRun]:
    """The job's cursors once every tracker has been told the job ended."""
    sessions = client.app.state.session_factory  # type: ignore[attr-defined]
    deadline = time.monotonic() + timeout
    while True:
        with session_scope(sessions) as s:
            rows = list(s.scalars(select(TrackerRun).where(TrackerRun.job_id == job_id)))
        if rows and all(r.done for r in rows):
            return rows
        assert time.monotonic() < deadline, [(r.tracker, r.failures, r.last_error) for r in rows]
        time.sleep(0.3)


def test_a_job_is_tracked_in_mlflow_and_wandb(tracked: tuple[TestClient, Path]) -> None:
    client, tmp = tracked
    uri = f"file://{tmp / 'mlruns'}"
    spec = tiny_gpt_spec(
        "tracked",
        scaling={"min_workers": 1, "max_workers": 1},
        training={"max_steps": STEPS},
        checkpoint={"every_steps": 6},
        tracking={
            "mlflow": {"experiment": "elastrain-it"},  # the operator's tracker
            "wandb": {"project": "elastrain-it", "mode": "offline"},
        },
    )
    job_id = submit(client, spec)
    assert wait_job(client, job_id, timeout=400)["state"] == "SUCCEEDED"
    rows = forwarded(client, job_id)
    assert {r.tracker: (r.failures, r.metric_step) for r in rows} == {
        "mlflow": (0, STEPS),
        "wandb": (0, STEPS),
    }
    stored = losses(client, job_id)
    assert sorted(stored) == list(range(1, STEPS + 1))

    # MLflow: read back from the file store with MLflow's own client.
    mlflow = MlflowClient(tracking_uri=uri)
    experiment = mlflow.get_experiment_by_name("elastrain-it")
    assert experiment is not None
    [run] = mlflow.search_runs([experiment.experiment_id])
    assert run.info.run_id == next(r.run_id for r in rows if r.tracker == "mlflow")
    assert run.info.run_name == f"tracked-{job_id}"
    assert run.info.status == "FINISHED"
    history = {m.step: m.value for m in mlflow.get_metric_history(run.info.run_id, "loss")}
    assert history == pytest.approx(stored)
    params = run.data.params
    assert params["training.max_steps"] == str(STEPS)
    assert params["workload.name"] == "gpt" and params["workload.params.n_layer"] == "2"
    assert run.data.tags["elastrain.state"] == "SUCCEEDED"
    transitions = [v for k, v in sorted(run.data.tags.items()) if ".transition." in k]
    assert transitions[0].startswith("- -> PENDING")
    assert transitions[-1].split(":")[0].endswith("-> SUCCEEDED")

    # W&B: the offline run file, read record by record.
    [path] = (tmp / "wandb").glob("wandb/offline-run-*/run-*.wandb")
    offline = read_run(path)
    assert offline.run_id == next(r.run_id for r in rows if r.tracker == "wandb")
    assert offline.name == f"tracked-{job_id}"
    wb_losses = {h["_step"]: h["loss"] for h in offline.history if "loss" in h}
    assert wb_losses == pytest.approx(stored)
    assert offline.config["training.max_steps"] == str(STEPS)
    assert offline.summary["elastrain/state"] == "SUCCEEDED"
    assert offline.exit_code == 0

    events = client.get(f"/v1/jobs/{job_id}/events").json()
    assert not [e for e in events if e["kind"] == "tracking"]  # nothing failed


def test_an_unreachable_tracker_never_fails_the_job(tracked: tuple[TestClient, Path]) -> None:
    """A tracking server nobody listens on: the job trains to the end all the same, and
    its events say forwarding failed."""
    client, _ = tracked
    spec = tiny_gpt_spec(
        "untracked",
        scaling={"min_workers": 1, "max_workers": 1},
        training={"max_steps": 4},
        tracking={"mlflow": {"tracking_uri": "http://127.0.0.1:9", "experiment": "x"}},
    )
    job_id = submit(client, spec)
    assert wait_job(client, job_id, timeout=400)["state"] == "SUCCEEDED"
    deadline = time.monotonic() + 120
    while True:
        events = client.get(f"/v1/jobs/{job_id}/events").json()
        failed = [e for e in events if e["kind"] == "tracking"]
        if failed:
            break
        assert time.monotonic() < deadline, events
        time.sleep(0.5)
    assert "forwarding to mlflow failed" in failed[0]["reason"]
