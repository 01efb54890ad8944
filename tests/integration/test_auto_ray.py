"""`strategy.kind: auto` on real Ray: the memory plan's choice is what the workers run."""

from __future__ import annotations

from pathlib import Path

import pytest

from elastrain.contracts.plan import HEADROOM, plan, shape_of
from elastrain.contracts.spec import JobSpec
from tests.integration.ray_service import ray_service, submit, tiny_gpt_spec, wait_terminal

# On a local Ray of its own, no timing asserted: `make test` runs it beside the other Ray tests.
pytestmark = [pytest.mark.ray, pytest.mark.beside]


def test_auto_runs_fsdp_where_ddp_does_not_fit(tmp_path: Path) -> None:
    spec = tiny_gpt_spec("auto", strategy={"kind": "auto"})
    parsed = JobSpec.model_validate(spec)
    shape = shape_of(parsed)
    assert shape is not None
    # A worker's memory between what FSDP and DDP need at world size 2 (per the plan).
    need = {r.label: r.total for r in plan(shape, parsed, 2, 2**40).rows}
    assert need["fsdp"] < need["ddp"]
    memory = int((need["fsdp"] + need["ddp"]) / 2 / HEADROOM)
    with ray_service(tmp_path, num_cpus=2, worker_memory_bytes=memory) as client:
        job_id = submit(client, spec)
        job = wait_terminal(client, job_id, timeout=300)
        assert job["state"] == "SUCCEEDED", job
        assert job["strategy"] == "fsdp"
        events = client.get(f"/v1/jobs/{job_id}/events").json()
        [chosen] = [e for e in events if e["kind"] == "plan"]
        assert chosen["details"]["strategy"] == "fsdp" and "ddp needs" in chosen["reason"]
        point = client.get(f"/v1/jobs/{job_id}/metrics").json()[-1]
    # Sharded: each of the 2 ranks holds about half of the parameters.
    assert point["memory"]["param_bytes"] < 0.6 * 4 * shape.params
