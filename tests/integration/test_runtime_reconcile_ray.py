"""The runtime reconciles with the database on a real multi-node Ray cluster
(`ray.cluster_utils.Cluster`): nothing stays reserved because one release call failed, a
control plane restarted on a database that no longer knows a running job makes the
runtime let go of it, and one restarted on the same database re-attaches.

The scheduler is stepped by hand here (no scheduler thread), so "within two passes" is
counted, not timed.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import ray
from fastapi.testclient import TestClient
from ray.cluster_utils import Cluster

from elastrain.api.main import create_app
from elastrain.service import identity
from elastrain.service.db import make_engine, make_session_factory, migrate
from elastrain.service.runtime_client import RuntimeClient
from elastrain.service.scheduler import Scheduler
from elastrain.service.settings import Settings
from tests.integration.ray_service import submit, tiny_gpt_spec
from tests.waiting import wait_until

pytestmark = [pytest.mark.ray, pytest.mark.timeout(600)]

CLUSTER_CPUS = 2.0


@dataclass
class ControlPlane:
    """An API (to submit and read) and a scheduler stepped one pass at a time."""

    client: TestClient
    scheduler: Scheduler

    def run_until(self, what: str, done: Callable[[], bool], timeout: float = 120) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            self.scheduler.run_pass()
            if done():
                return
            time.sleep(0.2)
        raise AssertionError(f"not reached in {timeout}s: {what}")

    def job(self, job_id: int) -> dict[str, Any]:
        return dict(self.client.get(f"/v1/jobs/{job_id}").json())

    def all_let_go(self) -> bool:
        """No process of the runtime's pool runs or holds a job (asked with this control
        plane's token: the runtime answers no one else)."""
        launcher = self.scheduler.launcher
        assert isinstance(launcher, RuntimeClient)
        return not any(w.busy or w.held is not None for w in launcher.workers())


@pytest.fixture
def cluster() -> Iterator[str]:
    """Two worker nodes of one CPU each; the head (runtime, drivers) holds none."""
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 0})
    for _ in range(2):
        cluster.add_node(num_cpus=1)
    cluster.wait_for_nodes()
    namespace = f"reconcile-{uuid.uuid4().hex[:6]}"
    ray.init(address=cluster.address, namespace=namespace)
    try:
        yield namespace
    finally:
        ray.shutdown()
        cluster.shutdown()


@pytest.fixture
def planes(tmp_path: Path, cluster: str) -> Iterator[Callable[[str], ControlPlane]]:
    """Control planes on databases named by the test, sharing the cluster and storage."""
    with ExitStack() as stack:

        def plane(database: str) -> ControlPlane:
            settings = Settings(
                database_url=f"sqlite:///{tmp_path / f'{database}.db'}",
                storage_path=tmp_path / "storage",
                ray_namespace=cluster,
                restart_backoff_s=0,
            )
            client = stack.enter_context(TestClient(create_app(settings)))
            engine = make_engine(settings.database_url)
            migrate(engine)
            stack.callback(engine.dispose)
            sessions = make_session_factory(engine)
            scheduler = Scheduler(
                session_factory=sessions,
                launcher=RuntimeClient(settings, identity.runtime_control_key(sessions)),
                settings=settings,
            )
            return ControlPlane(client, scheduler)

        yield plane


def reserved_groups(namespace: str) -> list[str]:
    """This namespace's placement groups that Ray still holds resources for."""
    return [
        g["name"]
        for g in ray.util.placement_group_table().values()
        if g["name"].startswith(f"{namespace}:") and g["state"] != "REMOVED"
    ]


def cpus_free() -> bool:
    return ray.available_resources().get("CPU", 0.0) == CLUSTER_CPUS


def spec(name: str) -> dict[str, Any]:
    return tiny_gpt_spec(name, training={"max_steps": 100_000})


def test_a_release_that_fails_leaves_nothing_reserved_after_the_next_pass(
    planes: Callable[[str], ControlPlane], cluster: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    def lost(self: RuntimeClient, *args: Any, **kwargs: Any) -> None:
        raise TimeoutError("the runtime did not answer")

    monkeypatch.setattr(RuntimeClient, "release", lost)
    plane = planes("db")
    job_id = submit(plane.client, spec("cancelled"))
    plane.run_until("running", lambda: plane.job(job_id)["state"] == "RUNNING")
    assert plane.client.post(f"/v1/jobs/{job_id}/cancel").status_code == 202

    plane.scheduler.run_pass()
    assert plane.job(job_id)["state"] == "CANCELLED"
    assert len(reserved_groups(cluster)) == 1  # the release never arrived

    plane.scheduler.run_pass()
    assert reserved_groups(cluster) == []
    # What the runtime finishes on its own after that pass (processes letting go at a step
    # boundary, Ray's resource view catching up): no further passes run.
    wait_until(plane.all_let_go, 60, "the processes let go of the job")
    wait_until(cpus_free, 60, "Ray sees the CPUs free")

    # ... and the next job gets them.
    other = submit(plane.client, spec("next"))
    plane.run_until("the next job runs", lambda: plane.job(other)["state"] == "RUNNING")


def test_a_fresh_database_stops_the_jobs_it_does_not_know_within_two_passes(
    planes: Callable[[str], ControlPlane], cluster: str
) -> None:
    first = planes("first")
    old = submit(first.client, spec("old"))
    first.run_until("past step 3", lambda: first.job(old)["step"] > 3)

    # A control plane on a fresh database (or a backup from before the job) takes over.
    fresh = planes("fresh")
    for _ in range(2):
        fresh.scheduler.run_pass()
    assert reserved_groups(cluster) == []
    wait_until(fresh.all_let_go, 60, "the old job's processes let go")
    wait_until(cpus_free, 60, "Ray sees the CPUs free")

    # Its own job 1 is a new job: a fresh start, not the old job 1's state adopted.
    new = submit(fresh.client, spec("new"))
    assert new == old
    fresh.run_until("running", lambda: fresh.job(new)["step"] >= 1)
    events = fresh.client.get(f"/v1/jobs/{new}/events").json()
    assert not [e for e in events if e["kind"] == "resumed"], events
    first_step = fresh.client.get(f"/v1/jobs/{new}/metrics").json()[0]["step"]
    assert first_step == 1


def test_a_restart_on_the_same_database_reattaches(
    planes: Callable[[str], ControlPlane], cluster: str
) -> None:
    before = planes("same")
    job_id = submit(before.client, spec("kept"))
    before.run_until("past step 3", lambda: before.job(job_id)["step"] > 3)
    attempt = before.job(job_id)["attempt"]

    before.scheduler.lease.release()  # it stopped (else the next takes over in 10 s)
    after = planes("same")  # a new control plane (scheduler, client) on the same database
    step = after.job(job_id)["step"]
    after.run_until("training on", lambda: after.job(job_id)["step"] > step + 5)
    job = after.job(job_id)
    assert job["state"] == "RUNNING" and job["attempt"] == attempt  # nothing relaunched
    assert len(reserved_groups(cluster)) == 1
