"""Hostile tenants and capacity (issue 26, item 7): two tenants' tokens through the API, the
scheduler stepped pass by pass against the fake runtime, on SQLite and PostgreSQL.

A tenant cannot take the front of the queue with a high priority: priority orders its own
jobs; between tenants the one holding less of the cluster goes first (service/admission.py).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import pytest
from fastapi.testclient import TestClient
from pydantic import SecretStr

from elastrain.api.main import create_app
from elastrain.contracts.messages import DriverStatus
from elastrain.service.scheduler import Scheduler
from elastrain.service.settings import Settings
from tests.factories import spec_dict
from tests.fake_launcher import FakeLauncher

ADMIN = "operator-admin-token-0123456789"


@dataclass
class Cluster:
    client: TestClient
    scheduler: Scheduler
    launcher: FakeLauncher
    headers: dict[str, dict[str, str]]

    def submit(self, who: str, *, workers: int = 1, priority: int = 0) -> int:
        spec = spec_dict(
            name=f"{who}-p{priority}",
            scaling={"min_workers": workers, "max_workers": workers},
            priority=priority,
        )
        made = self.client.post("/v1/jobs", json=spec, headers=self.headers[who])
        assert made.status_code == 201, made.text
        job_id: int = made.json()["id"]
        return job_id

    def state(self, job_id: int) -> tuple[str, str | None]:
        body = self.client.get(f"/v1/jobs/{job_id}", headers=self.headers["admin"]).json()
        return body["state"], body["state_reason"]


@contextmanager
def _four_workers(settings: Settings) -> Iterator[Cluster]:
    secured = settings.model_copy(update={"api_token": SecretStr(ADMIN)})
    with TestClient(create_app(secured)) as client:
        headers = {"admin": {"Authorization": f"Bearer {ADMIN}"}}
        for name in ("team-a", "team-b"):
            made = client.post("/v1/tokens", json={"tenant": name}, headers=headers["admin"])
            headers[name] = {"Authorization": f"Bearer {made.json()['token']}"}
        launcher = FakeLauncher({"n1": 1, "n2": 1, "n3": 1, "n4": 1})
        scheduler = Scheduler(
            session_factory=client.app.state.session_factory,  # type: ignore[attr-defined]
            launcher=launcher,
            settings=secured,
        )
        yield Cluster(client, scheduler, launcher, headers)


@pytest.fixture
def four_workers(settings: Settings) -> Iterator[Cluster]:
    with _four_workers(settings) as cluster:
        yield cluster


def test_a_high_priority_does_not_put_a_tenant_ahead_of_another(four_workers: Cluster) -> None:
    c = four_workers
    held = c.submit("team-a", workers=2)
    c.scheduler.run_pass()
    assert c.state(held)[0] == "STARTING"  # team-a holds half the cluster

    a_urgent = c.submit("team-a", priority=100)
    b_first = c.submit("team-b")
    a_also_urgent = c.submit("team-a", priority=100)
    b_second = c.submit("team-b")
    c.scheduler.run_pass()
    # Two workers free: team-b holds nothing, so both go to it, whatever a's priority says.
    assert c.state(b_first)[0] == c.state(b_second)[0] == "STARTING"
    assert c.state(a_urgent) == ("PENDING", "waiting for 1 free workers")
    assert c.state(a_also_urgent)[0] == "PENDING"

    # Within team-a, priority still orders its own jobs.
    a_later = c.submit("team-a", priority=0)
    c.launcher.driver(b_first).status = DriverStatus.SUCCEEDED
    c.scheduler.run_pass()  # b_first ends: shares a 2/4, b 1/4 -> b would go first, has none
    assert c.state(b_first)[0] == "SUCCEEDED"
    assert c.state(a_urgent)[0] == "STARTING"  # a's oldest priority-100 job
    assert c.state(a_also_urgent)[0] == "PENDING"
    assert c.state(a_later)[0] == "PENDING"


@pytest.mark.parametrize(("reserve_after_s", "starves"), [(0.0, False), (1e9, True)])
def test_a_large_job_is_not_starved_by_another_tenants_small_ones(
    settings: Settings, reserve_after_s: float, starves: bool
) -> None:
    """With the reservation (here at once), team-a's 4-worker job gets the cluster as
    team-b's small jobs end, although team-b keeps submitting more; without it (a
    reservation that never comes) backfill starves it: the check can fail."""
    fast = settings.model_copy(update={"queue_reserve_after_s": reserve_after_s})
    with _four_workers(fast) as c:
        small = [c.submit("team-b") for _ in range(4)]
        c.scheduler.run_pass()
        assert all(c.state(j)[0] == "STARTING" for j in small)
        big = c.submit("team-a", workers=4)
        for _ in range(8):  # one of b's jobs ends per pass, and b queues another each time
            c.submit("team-b")
            c.launcher.driver(small.pop(0)).status = DriverStatus.SUCCEEDED
            c.scheduler.run_pass()
            state, reason = c.state(big)
            if state == "STARTING":
                break
            assert reason == "waiting for 4 free workers"
            small += [j for j in range(big + 1, big + 20) if _started(c, j) and j not in small]
        assert (c.state(big)[0] == "PENDING") == starves


def _started(c: Cluster, job_id: int) -> bool:
    found = c.client.get(f"/v1/jobs/{job_id}", headers=c.headers["admin"])
    return found.status_code == 200 and found.json()["state"] == "STARTING"
