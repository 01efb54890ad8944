"""A workload that cannot run is a configuration error, on a real local Ray: the job fails
after its one attempt with the workload's own message, no restart counted, however the
error shows (the factory raises, the module raises on import, the dataset or the model
raises on their first use, the model lacks what the strategy needs).

An error in the workload's code after the job has made progress is still retried: only the
first use is known to fail the same on a retry.
"""

from __future__ import annotations

import io
import zipfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient

from tests.integration.ray_service import ray_service, submit, wait_terminal

pytestmark = pytest.mark.ray

#: A tenant's package: each factory fails in its own way; `fine` trains.
BROKEN = '''\
import os

import torch
from torch import nn

from elastrain.workers.api import Workload


def raises(size: int = 4):
    raise ValueError(f"size {size} is not a size this model takes")


def raises_key_error():
    return {"layers": 2}["hidden"]


class _Unlabelled:
    """Sample 0 reads; any other raises (a label file missing a row)."""

    def __len__(self):
        return 64

    def __getitem__(self, i):
        if i == 0:
            return torch.zeros(4), torch.zeros(1)
        raise KeyError(f"sample {i} has no label")


def bad_data():
    return Workload(model=nn.Linear(4, 1), dataset=_Unlabelled(),
                    loss_fn=nn.functional.mse_loss)


def _data():
    x = torch.randn(64, 4, generator=torch.Generator().manual_seed(0))
    return list(zip(x, x.sum(dim=1, keepdim=True)))


def bad_model():
    # Takes 8 features; the samples have 4: the first forward fails.
    return Workload(model=nn.Linear(8, 1), dataset=_data(), loss_fn=nn.functional.mse_loss)


def empty():
    return Workload(model=nn.Linear(4, 1), dataset=[], loss_fn=nn.functional.mse_loss)


def fine():
    return Workload(model=nn.Linear(4, 1), dataset=_data(), loss_fn=nn.functional.mse_loss)


def fails_once_later(marker: str):
    """Its third loss (the second step's) raises, once: after progress, as a flaky read
    does; the next attempt trains on."""
    calls = []

    def loss(out, target):
        calls.append(1)
        if len(calls) == 3 and not os.path.exists(marker):
            open(marker, "w").close()
            raise ValueError("read timed out on s3://bucket/shard-7")
        return nn.functional.mse_loss(out, target)

    return Workload(model=nn.Linear(4, 1), dataset=_data(), loss_fn=loss)
'''
BROKEN_ON_IMPORT = 'raise RuntimeError("config.toml not found next to the model")\n'


@pytest.fixture(scope="module")
def service(tmp_path_factory: pytest.TempPathFactory) -> Iterator[TestClient]:
    with ray_service(tmp_path_factory.mktemp("workload-errors"), num_cpus=4) as client:
        yield client


@pytest.fixture(scope="module")
def package(service: TestClient) -> str:
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as zf:
        zf.writestr("broken_model.py", BROKEN)
        zf.writestr("broken_on_import.py", BROKEN_ON_IMPORT)
    made = service.post(
        "/v1/packages", content=buf.getvalue(), headers={"Content-Type": "application/zip"}
    )
    assert made.status_code == 201, made.text
    return str(made.json()["digest"])


def _spec(name: str, entrypoint: str, package: str, **overrides: Any) -> dict[str, Any]:
    return {
        "name": name,
        "workload": {"entrypoint": entrypoint, "package": package},
        "scaling": {"min_workers": 1, "max_workers": 1, "cpus_per_worker": 0.5},
        "training": {"global_batch_size": 8, "micro_batch_size": 4, "max_steps": 3},
        "checkpoint": {"async_save": False},
        # Room for retries: a configuration error must not use any of them.
        "failure": {"max_restarts": 3},
        **overrides,
    }


CASES = [
    ("broken_model:raises", {}, "raised ValueError while building: size 4 is not a size"),
    ("broken_model:raises_key_error", {}, "raised KeyError while building: 'hidden'"),
    ("broken_on_import:anything", {}, "RuntimeError: config.toml not found next to the model"),
    ("broken_model:bad_data", {}, "KeyError: 'sample"),
    ("broken_model:bad_model", {}, "first training step raised RuntimeError"),
    ("broken_model:empty", {}, "the dataset is empty"),
    # The model has no tensor_parallel_plan(): the strategy cannot split it.
    (
        "broken_model:fine",
        {
            "strategy": {"kind": "tp", "tensor_parallel": 2},
            "scaling": {"min_workers": 2, "max_workers": 2, "cpus_per_worker": 0.5},
        },
        "tensor_parallel_plan",
    ),
]


def test_a_workload_that_cannot_run_fails_at_once_with_its_message(
    service: TestClient, package: str
) -> None:
    # All at once: the cluster runs them side by side (each needs one or two half CPUs).
    jobs = {
        submit(service, _spec(f"broken-{i}", entrypoint, package, **overrides)): message
        for i, (entrypoint, overrides, message) in enumerate(CASES)
    }
    for job_id, message in jobs.items():
        job = wait_terminal(service, job_id, timeout=300)
        assert job["state"] == "FAILED", job
        assert job["restarts"] == 0 and job["attempt"] == 1, job
        assert message in (job["last_error"] or ""), job
        assert message in job["state_reason"] and "not retried" in job["state_reason"], job


def test_the_same_package_trains_when_its_factory_is_sound(
    service: TestClient, package: str
) -> None:
    # The failures above are the workload's, not the package's or the service's.
    job = wait_terminal(service, submit(service, _spec("sound", "broken_model:fine", package)))
    assert job["state"] == "SUCCEEDED", job
    assert job["restarts"] == 0


def test_an_error_after_the_first_step_is_still_retried(
    service: TestClient, package: str, tmp_path: Path
) -> None:
    """Only the first use is known to fail the same again: later, the workload's error is
    an ordinary failure, retried with a restart counted."""
    spec = _spec("later", "broken_model:fails_once_later", package)
    spec["workload"]["params"] = {"marker": str(tmp_path / "failed-once")}
    spec["training"]["max_steps"] = 4
    job = wait_terminal(service, submit(service, spec))
    assert job["state"] == "SUCCEEDED", job
    assert job["restarts"] == 1 and job["attempt"] == 2, job
    events = service.get(f"/v1/jobs/{job['id']}/events").json()
    assert any("read timed out on s3://bucket/shard-7" in (e["reason"] or "") for e in events)
