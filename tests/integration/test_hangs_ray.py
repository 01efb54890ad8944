"""Hangs on a real Ray cluster (issue 44, item 1): a rank stuck in its own data loading,
and a rank whose process is frozen (SIGSTOP), are found by the runtime's hang watch within
the job's threshold; the attempt is ended naming the rank, the hung process stopped, and
the job goes on from its peers' memory to SUCCEEDED with every step once."""

from __future__ import annotations

import contextlib
import os
import signal
import time
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient

from tests.factories import a_zip
from tests.integration.ray_service import ray_service, wait_for, wait_terminal

pytestmark = pytest.mark.ray

#: A regression whose dataset, on rank 1 of the first attempt, stops for good after a few
#: batches: a stuck data loader.
STALL = """
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from elastrain.workers.api import Workload


class Samples:
    def __init__(self, marker, stall_after):
        g = torch.Generator().manual_seed(3)
        self.x = torch.randn(256, 8, generator=g)
        self.y = self.x.sum(dim=1, keepdim=True)
        self.marker, self.stall_after, self.calls = Path(marker), stall_after, 0

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        self.calls += 1
        if (
            self.stall_after
            and dist.is_initialized() and dist.get_rank() == 1
            and self.calls > self.stall_after and not self.marker.exists()
        ):
            self.marker.write_text("stalled")
            time.sleep(3600)
        return self.x[i], self.y[i]


def build(marker: str, stall_after: int = 0, slow_s: float = 0.02) -> Workload:
    def loss(out, target):
        time.sleep(slow_s)
        return nn.functional.mse_loss(out, target)

    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))
    return Workload(model=model, dataset=Samples(marker, stall_after), loss_fn=loss)
"""
STEPS = 60


def spec(digest: str, marker: Path, *, stall_after: int) -> dict[str, Any]:
    return {
        "name": "hang",
        "workload": {
            "entrypoint": "stall:build",
            "package": digest,
            "params": {"marker": str(marker), "stall_after": stall_after},
        },
        "strategy": {"kind": "ddp"},
        "scaling": {"min_workers": 1, "max_workers": 2, "cpus_per_worker": 0.5},
        "training": {"global_batch_size": 8, "micro_batch_size": 4, "max_steps": STEPS},
        "checkpoint": {"every_steps": 1000, "async_save": False},
        "failure": {"max_restarts": 2, "hang_after_s": 3},
    }


def hang_errors(client: TestClient, job_id: int) -> list[dict[str, Any]]:
    events = client.get(f"/v1/jobs/{job_id}/events").json()
    return [e for e in events if e["kind"] == "worker_error" and e["details"]["kind"] == "hang"]


def test_a_stuck_rank_and_a_frozen_one_are_found_stopped_and_the_job_goes_on(
    tmp_path: Path,
) -> None:
    with ray_service(tmp_path, num_cpus=2, warm_workers_per_node=2) as client:
        upload = client.post(
            "/v1/packages", content=a_zip({"stall.py": STALL}),
            headers={"Content-Type": "application/zip"},
        )  # fmt: skip
        assert upload.status_code == 201, upload.text
        digest = upload.json()["digest"]

        # A data loader stuck on rank 1 (sleeping in __getitem__, its process answering).
        marker = tmp_path / "stalled"
        stuck = client.post("/v1/jobs", json=spec(digest, marker, stall_after=40))
        assert stuck.status_code == 201, stuck.text
        job = wait_terminal(client, stuck.json()["id"], timeout=300)
        assert job["state"] == "SUCCEEDED", job
        assert marker.exists()  # it did stall
        found = hang_errors(client, job["id"])
        assert len(found) == 1, found
        error = found[0]["details"]
        assert error["rank"] == 1 and "in data" in error["message"], error
        assert "stall.py" in error["message"]  # where it was stuck
        assert job["restarts"] == 1
        steps = [p["step"] for p in client.get(f"/v1/jobs/{job['id']}/metrics").json()]
        assert sorted(set(steps)) == list(range(1, STEPS + 1))

        # A frozen process: rank 1's, stopped from outside mid-run.
        frozen = client.post(
            "/v1/jobs", json=spec(digest, tmp_path / "unused", stall_after=0)
        ).json()["id"]
        wait_for(client, frozen, lambda j: j["state"] == "RUNNING" and j["step"] >= 5,
                 what="step 5", timeout=180)  # fmt: skip
        placement = next(
            e["details"] for e in client.get(f"/v1/jobs/{frozen}/events").json()
            if e["kind"] == "placement"
        )  # fmt: skip
        victim = int(placement["pids"]["1"])
        stopped_at = time.monotonic()
        os.kill(victim, signal.SIGSTOP)
        try:
            wait_for(client, frozen, lambda j: bool(hang_errors(client, j["id"])),
                     what="the hang found", timeout=60)  # fmt: skip
            found_after = time.monotonic() - stopped_at
        finally:
            with_suppressed_kill(victim)
        error = hang_errors(client, frozen)[0]["details"]
        assert error["rank"] == 1 and "has not answered" in error["message"], error
        assert "rank 0" not in error["message"], error
        assert found_after < 3 + 2 * 2 + 5, found_after  # threshold, two polls, a pass
        job = wait_terminal(client, frozen, timeout=300)
        assert job["state"] == "SUCCEEDED", job


def with_suppressed_kill(pid: int) -> None:
    """Let the frozen process go, if the runtime has not stopped it already."""
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGCONT)
