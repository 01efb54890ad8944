"""Stragglers through the real app and scheduler (fake launcher), on SQLite and PostgreSQL:
the straggler watch's event and nodes (what the runtime's driver reports) become an event
row and a Prometheus gauge; with `failure.stragglers: evict` the job leaves the node at a
step boundary as a drain would (no restart counted), is placed elsewhere for the cooldown,
and may grow back onto it after. The watch itself runs on real Ray in
tests/integration/test_hangs_ray.py."""

from __future__ import annotations

from fastapi.testclient import TestClient
from sqlalchemy.orm import Session, sessionmaker

from elastrain.contracts.messages import DriverStatus, EventKind
from elastrain.service.scheduler import Scheduler
from elastrain.service.settings import Settings
from tests.factories import spec_dict
from tests.fake_launcher import FakeLauncher
from tests.integration.test_metrics_endpoint import scrape, value

STRAGGLER = {
    "kind": EventKind.STRAGGLER.value,
    "reason": "rank 1 on node n2 is a straggler",
    "details": {"rank": 1, "node_id": "n2"},
}


def test_an_evicting_job_leaves_a_straggler_node_for_the_cooldown_then_may_return(
    client: TestClient, app_sessions: sessionmaker[Session], settings: Settings
) -> None:
    spec = spec_dict(
        name="slow",
        scaling={"min_workers": 1, "max_workers": 2},
        failure={"stragglers": "evict", "straggler_cooldown_s": 600},
    )
    job_id = client.post("/v1/jobs", json=spec).json()["id"]
    now = [1_000_000.0]
    launcher = FakeLauncher({"n1": 1, "n2": 1})
    sched = Scheduler(
        session_factory=app_sessions, launcher=launcher, settings=settings, clock=lambda: now[0]
    )
    sched.run_pass()
    first = launcher.driver(job_id)
    assert first.request.world_size == 2
    first.status, first.placement = DriverStatus.RUNNING, {0: "n1", 1: "n2"}
    first.metrics = [{"step": 1, "loss": 1.0, "step_time_s": 0.1}]
    sched.run_pass()

    first.events, first.slow_nodes = [STRAGGLER], ("n2",)
    sched.run_pass()
    job = client.get(f"/v1/jobs/{job_id}").json()
    assert job["state"] == "RESIZING" and "kept off (a straggler ran there" in job["state_reason"]
    assert job["restarts"] == 0
    kinds = [e["kind"] for e in client.get(f"/v1/jobs/{job_id}/events").json()]
    assert "straggler" in kinds and "node_draining" in kinds
    gauge = {"job_id": str(job_id), "tenant": "default"}
    assert value(scrape(client), "elastrain_job_stragglers", **gauge) == 1

    first.status = DriverStatus.STOPPED  # it left at the step boundary, state in memory
    sched.run_pass()
    sched.run_pass()
    second = launcher.driver(job_id)
    assert second.request.attempt == 2
    assert second.request.world_size == 1 and second.request.avoid_nodes == ("n2",)
    assert value(scrape(client), "elastrain_job_stragglers", **gauge) == 0  # a new attempt

    # The cooldown over, the node is the job's again: it may grow back onto it.
    second.status, second.placement = DriverStatus.RUNNING, {0: "n1"}
    now[0] += 601
    sched.run_pass()
    assert job_id not in sched.timers.kept_off
    for _ in range(3):  # running, spare capacity noticed, grown after the interval
        now[0] += settings.grow_interval_s + 1
        sched.run_pass()
    job = client.get(f"/v1/jobs/{job_id}").json()
    assert job["state"] == "RESIZING" and job["world_size"] == 2, job["state_reason"]


def test_a_reporting_job_only_reports_a_straggler(
    client: TestClient, app_sessions: sessionmaker[Session], settings: Settings
) -> None:
    job_id = client.post(
        "/v1/jobs", json=spec_dict(name="slow", scaling={"min_workers": 1, "max_workers": 2})
    ).json()["id"]
    launcher = FakeLauncher({"n1": 1, "n2": 1})
    sched = Scheduler(session_factory=app_sessions, launcher=launcher, settings=settings)
    sched.run_pass()
    d = launcher.driver(job_id)
    d.status, d.placement = DriverStatus.RUNNING, {0: "n1", 1: "n2"}
    d.metrics = [{"step": 1, "loss": 1.0, "step_time_s": 0.1}]
    d.events, d.slow_nodes = [STRAGGLER], ("n2",)
    sched.run_pass()
    sched.run_pass()
    assert client.get(f"/v1/jobs/{job_id}").json()["state"] == "RUNNING"
    assert not d.stop_requested and not sched.timers.kept_off
    assert (
        value(scrape(client), "elastrain_job_stragglers", job_id=str(job_id), tenant="default") == 1
    )
