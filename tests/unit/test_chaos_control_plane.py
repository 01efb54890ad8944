"""The chaos campaign's control-plane faults (bench/chaos_bench.py): how the steps made
during an outage and the first step after it are read from the points the restarted
service stores (by each point's own wall clock, from the step the job was at when the
fault was injected)."""

from __future__ import annotations

import random
import time
from typing import Any, cast

import httpx
import pytest

from bench.chaos_bench import Campaign, Fault, Service, _trained_after_outage, outage_reading
from tests.integration.cluster_service import Nodes

FAULT_AT, BACK = 1000.0, 1005.0


def _point(step: int, wall_time: float, attempt: int = 1) -> dict[str, Any]:
    return {"step": step, "attempt": attempt, "wall_time": wall_time}


@pytest.mark.parametrize(
    ("points", "first_step", "during", "stored"),
    [
        # Nothing stored since the fault: the new process does not schedule yet.
        ([_point(9, 999.0), _point(10, 999.9)], None, 0, False),
        # Only steps of the outage so far: stored, none after the service answered.
        ([_point(10, 999.9), _point(11, 1001.0), _point(12, 1004.9)], None, 2, True),
        # Trained through: the first step after it answered, whatever order read in.
        ([_point(13, 1005.2), _point(11, 1001.0), _point(12, 1004.9), _point(14, 1005.3)],
         13, 2, True),
        # Relaunched: the next attempt's steps (from a checkpoint before the fault) count as
        # after, the faulted attempt's stalled outage as none.
        ([_point(10, 999.9), _point(5, 1007.0, attempt=2), _point(6, 1007.1, attempt=2)],
         5, 0, True),
        # An earlier attempt's late point is not this attempt's.
        ([_point(12, 1006.0, attempt=0)], None, 0, True),
    ],
)  # fmt: skip
def test_outage_reading(
    points: list[dict[str, Any]], first_step: int | None, during: int, stored: bool
) -> None:
    seen = outage_reading(points, 1, FAULT_AT, BACK)
    assert (seen.first_after or {}).get("step") == first_step
    assert (seen.during, seen.stored) == (during, stored)


class RestartedService:
    """The service as the campaign sees it after a control-plane kill: it answers at once
    and stores, in one pass, the points of a job whose ranks trained at 36 ms a step
    through a 5 s outage and for 6 s after it (the killed process's lease running out)."""

    STEP_S = 0.036

    def __init__(self, fault_at: float, fault_step: int) -> None:
        self.fault_at, self.fault_step = fault_at, fault_step
        self.points: list[dict[str, Any]] = []

    def handle(self, request: httpx.Request) -> httpx.Response:
        if request.url.path == "/healthz":
            return httpx.Response(200, json={"ok": True})
        if not self.points:  # the first read after it answered: every point at once
            back = time.time()
            t, step = self.fault_at - 0.5, self.fault_step - 10
            while t < back + 6.0:
                self.points.append(_point(step, t))
                t, step = t + self.STEP_S, step + 1
        if request.url.path == "/v1/jobs/1":
            last = self.points[-1]["step"]
            return httpx.Response(200, json={"id": 1, "state": "RUNNING", "step": last})
        if request.url.path == "/v1/jobs/1/metrics":
            since = int(request.url.params.get("since_step", 0))
            return httpx.Response(200, json=[p for p in self.points if p["step"] >= since])
        return httpx.Response(404)


def test_steps_through_an_outage_are_read_from_the_step_at_the_fault() -> None:
    """With far more than 100 steps stored at once after the service answered, the steps
    of the outage and the first one after it are still found (a read from 100 steps
    before the job's step at the time left them all out: "no step during the outage",
    and a first step seconds after the service answered)."""
    fault_at = time.time() - 5.0
    service = RestartedService(fault_at, fault_step=200)
    client = httpx.Client(transport=httpx.MockTransport(service.handle), base_url="http://x")
    campaign = Campaign(
        service=cast(Service, type("S", (), {"client": client})()),
        nodes=cast(Nodes, None),
        rng=random.Random(0),
    )
    fault = Fault(strategy="ddp", kind="control_plane_kill", rank=0, at=fault_at)

    _trained_after_outage(campaign, 1, 1, 200, fault)

    assert fault.trained_through is True
    assert fault.outage_s is not None and fault.recovered_s is not None
    # The first step after the service answered comes within a step of it.
    assert fault.outage_s <= fault.recovered_s <= fault.outage_s + 2 * service.STEP_S
    during = int(fault.note.split("trained through: ")[1].split(" steps")[0])
    assert during == pytest.approx(fault.outage_s / service.STEP_S, abs=2)
