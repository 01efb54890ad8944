"""`/metrics` and goodput through the real app and scheduler (fake launcher), on SQLite and
PostgreSQL: what an operator would alert on is there, and moves when things happen."""

from __future__ import annotations

import time

from fastapi.testclient import TestClient
from prometheus_client.parser import text_string_to_metric_families
from pydantic import SecretStr
from sqlalchemy.orm import Session, sessionmaker

from elastrain.api.main import create_app
from elastrain.contracts.messages import DriverStatus, Phase, Timeline, TimelineMark
from elastrain.service.scheduler import Scheduler
from elastrain.service.settings import Settings
from tests.factories import spec_dict
from tests.fake_launcher import FakeLauncher


def scrape(
    client: TestClient, **kw: object
) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    response = client.get("/metrics", **kw)  # type: ignore[arg-type]
    assert response.status_code == 200, response.text
    assert response.headers["content-type"].startswith("text/plain")
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(response.text)
        for s in family.samples
    }


def value(samples: dict, name: str, **labels: str) -> float:  # type: ignore[type-arg]
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)


def test_metrics_follow_the_queue_starts_checkpoints_and_node_losses(
    client: TestClient, app_sessions: sessionmaker[Session], settings: Settings
) -> None:
    first = client.post("/v1/jobs", json=spec_dict(name="m1")).json()["id"]
    client.post("/v1/jobs", json=spec_dict(name="m2", scaling={"min_workers": 3, "max_workers": 3}))
    before = scrape(client)
    assert value(before, "elastrain_jobs", state="PENDING", tenant="default") == 2
    assert value(before, "elastrain_queue_length") == 2
    assert value(before, "elastrain_queue_oldest_wait_seconds") >= 0

    launcher = FakeLauncher({"n1": 1, "n2": 1})
    sched = Scheduler(session_factory=app_sessions, launcher=launcher, settings=settings)
    sched.run_pass()  # m1 admitted at 2; m2 (needs 3) waits
    d = launcher.driver(first)
    d.status = DriverStatus.RUNNING
    d.placement = {0: "n1", 1: "n2"}
    now = time.time()
    d._send(Timeline(cause="submitted", marks=(
        TimelineMark(phase=Phase.DETECTED, at=now - 1.5),
        TimelineMark(phase=Phase.STATE_RESTORED, at=now - 0.5, detail="fresh start"),
        TimelineMark(phase=Phase.FIRST_STEP, at=now),
    )))  # fmt: skip
    d.metrics = [
        {"step": s, "loss": 1.0, "step_time_s": 0.002, "tokens_per_s": 1000.0,
         "checkpoint_stall_s": 0.001 if s == 2 else 0.0}
        for s in (1, 2)
    ]  # fmt: skip
    d.commits = [{"step": 2, "path": "/ckpt/2", "bytes": 4096,
                  "manifest": {"created_at": now, "extra": {"save_started_at": now - 0.3}}}]  # fmt: skip
    sched.run_pass()
    launcher.remove_node("n2")
    sched.run_pass()  # node lost: the attempt ends, the job recovers at 1

    after = scrape(client)
    assert value(after, "elastrain_jobs", state="PENDING", tenant="default") == 1
    assert (
        value(after, "elastrain_queue_wait_seconds_count", tenant="default")
        - value(before, "elastrain_queue_wait_seconds_count", tenant="default")
        == 1
    )
    for name, labels in [
        ("elastrain_start_seconds_count", {"cause": "submitted"}),
        ("elastrain_checkpoints_total", {"tenant": "default"}),
        ("elastrain_node_losses_total", {"tenant": "default"}),
        ("elastrain_checkpoint_stall_seconds_count", {}),
        ("elastrain_checkpoint_save_seconds_count", {}),
    ]:
        assert value(after, name, **labels) - value(before, name, **labels) == 1, name
    assert (
        value(after, "elastrain_checkpoint_bytes_total", tenant="default")
        - value(before, "elastrain_checkpoint_bytes_total", tenant="default")
        == 4096
    )
    assert value(after, "elastrain_scheduler_pass_seconds_count") >= 3
    job = {"job_id": str(first), "tenant": "default"}
    assert value(after, "elastrain_job_steps_per_second", **job) == 500.0
    assert value(after, "elastrain_job_tokens_per_second", **job) == 1000.0
    assert 0 < value(after, "elastrain_job_goodput_ratio", **job) <= 1

    split = client.get(f"/v1/jobs/{first}").json()["goodput"]
    assert split["training_s"] == 0.004 and split["checkpoint_stall_s"] == 0.001
    assert split["wall_s"] > 0 and split["goodput"] is not None


def test_metrics_need_an_admin_token_when_auth_is_on(settings: Settings) -> None:
    admin = "metrics-admin-token-0123456789"
    secured = settings.model_copy(update={"api_token": SecretStr(admin)})
    with TestClient(create_app(secured)) as c:
        assert c.get("/metrics").status_code == 401
        tenant = c.post(
            "/v1/tokens", json={"tenant": "a"}, headers={"Authorization": f"Bearer {admin}"}
        ).json()["token"]
        assert c.get("/metrics", headers={"Authorization": f"Bearer {tenant}"}).status_code == 403
        assert scrape(c, headers={"Authorization": f"Bearer {admin}"}) is not None
