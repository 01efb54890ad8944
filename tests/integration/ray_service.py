"""A real elastrain service over a real local Ray, for integration tests: the API in a
TestClient, the scheduler thread on, jobs submitted and watched over REST."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest
import ray
from fastapi.testclient import TestClient

from elastrain.api.main import create_app
from elastrain.service.settings import Settings

TERMINAL = {"SUCCEEDED", "FAILED", "CANCELLED"}


def tiny_gpt_spec(name: str, **overrides: Any) -> dict[str, Any]:
    spec: dict[str, Any] = {
        "name": name,
        "workload": {
            "name": "gpt",
            "params": {"n_layer": 2, "n_embd": 32, "n_head": 2, "seq_len": 32},
        },
        "strategy": {"kind": "ddp"},
        "scaling": {"min_workers": 2, "max_workers": 2, "cpus_per_worker": 1},
        "training": {
            "global_batch_size": 16,
            "micro_batch_size": 8,
            "learning_rate": 0.003,
            "max_steps": 30,
            "seed": 0,
        },
        "checkpoint": {"every_steps": 10, "keep_last": 2, "async_save": False},
        "failure": {"max_restarts": 0},
    }
    for key, value in overrides.items():
        if isinstance(value, dict) and isinstance(spec.get(key), dict):
            spec[key] = {**spec[key], **value}
        else:
            spec[key] = value
    return spec


@contextmanager
def ray_service(
    tmp: Path, *, num_cpus: int = 4, num_gpus: int | None = None, **settings_kw: Any
) -> Iterator[TestClient]:
    """Start a local Ray with `num_cpus` logical CPUs (and `num_gpus` GPUs; None: those
    Ray detects) and the service on top of it."""
    ray.init(
        num_cpus=num_cpus, num_gpus=num_gpus, namespace="elastrain-test", include_dashboard=False
    )
    settings = Settings(
        **{
            "database_url": f"sqlite:///{tmp / 'elastrain.db'}",
            "storage_path": tmp / "storage",
            "ray_namespace": "elastrain-test",
            "scheduler_interval_s": 0.3,  # tests: quicker reactions than the default
            **settings_kw,
        }
    )
    try:
        with TestClient(create_app(settings, start_scheduler=True)) as client:
            yield client
    finally:
        ray.shutdown()


def submit(client: TestClient, spec: dict[str, Any]) -> int:
    resp = client.post("/v1/jobs", json=spec)
    assert resp.status_code == 201, resp.text
    return int(resp.json()["id"])


def wait_for(
    client: httpx.Client,  # a TestClient, or a client of a real server
    job_id: int,
    predicate: Callable[[dict[str, Any]], bool],
    *,
    timeout: float = 300,
    what: str = "condition",
    poll_s: float = 0.5,
) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    job: dict[str, Any] = {}
    while time.monotonic() < deadline:
        job = client.get(f"/v1/jobs/{job_id}").json()
        if predicate(job):
            return job
        if job["state"] in TERMINAL:
            break
        time.sleep(poll_s)
    events = client.get(f"/v1/jobs/{job_id}/events").json()
    raise AssertionError(f"job {job_id}: {what} not reached; job={job}\nevents={events}")


def cancel_at_step(
    client: httpx.Client, job_id: int, step: int, *, timeout: float = 300
) -> dict[str, Any]:
    """Let the job train to `step` (or end first), then cancel it; its final state."""
    wait_for(client, job_id, lambda j: j["step"] >= step, what=f"step {step}", timeout=timeout)
    client.post(f"/v1/jobs/{job_id}/cancel")  # 409 if it has just ended: fine
    return wait_terminal(client, job_id, timeout=120)


def wait_terminal(
    client: httpx.Client, job_id: int, timeout: float = 300, poll_s: float = 0.5
) -> dict[str, Any]:
    return wait_for(
        client,
        job_id,
        lambda j: j["state"] in TERMINAL,
        timeout=timeout,
        what="terminal state",
        poll_s=poll_s,
    )


def losses(client: TestClient, job_id: int) -> dict[int, float]:
    return {m["step"]: m["loss"] for m in client.get(f"/v1/jobs/{job_id}/metrics").json()}


def run_cli(client: TestClient, monkeypatch: pytest.MonkeyPatch, *args: str) -> Any:
    """`elastrain ARGS...` against the in-process service `client` talks to."""
    from typer.testing import CliRunner

    from elastrain.api import cli
    from elastrain.api.cli.connection import Api

    def connected(url: str, token: str | None) -> Api:
        made = Api(url, token)
        made.http = client  # type: ignore[assignment]  # (an httpx.Client underneath)
        return made

    monkeypatch.setattr(cli, "Api", connected)
    return CliRunner().invoke(cli.app, list(args))
