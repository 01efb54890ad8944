"""Drains on a real 3-node Ray cluster (`ray.cluster_utils.Cluster`): a DDP job leaves a
drained node at a step boundary and trains on at the smaller size with its state from the
survivors' memory (no step recomputed, no restart, no failure), grows back after undrain,
and a drain during that grow keeps it off the node; a job at min_workers checkpoints,
stops at the deadline and resumes after undrain; Ray's own drain (here from a preemption
notice the node's watcher sees) works the same way.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient

from tests.integration.cluster_service import Nodes, multi_node_service
from tests.integration.ray_service import submit, tiny_gpt_spec, wait_for, wait_terminal

pytestmark = pytest.mark.ray

NOTICES = "notice-{node_id}"


@pytest.fixture(scope="module")
def service(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[TestClient, Nodes, Path]]:
    tmp = tmp_path_factory.mktemp("drain")
    with multi_node_service(
        tmp,
        grow_interval_s=2.0,
        allowed_hosts=["testserver"],
        preemption_notice=str(tmp / NOTICES),
    ) as (client, nodes):
        yield client, nodes, tmp


def events(client: TestClient, job_id: int) -> list[dict[str, Any]]:
    found: list[dict[str, Any]] = client.get(f"/v1/jobs/{job_id}/events").json()
    return found


def placement(client: TestClient, job_id: int, attempt: int) -> list[str]:
    """The node of each rank of the attempt."""
    ranks = next(
        e["details"]["ranks"]
        for e in events(client, job_id)
        if e["kind"] == "placement" and e["attempt"] == attempt
    )
    return [ranks[str(r)] for r in range(len(ranks))]


def placed(client: TestClient, job_id: int, attempt: int) -> list[str]:
    wait_for(client, job_id, lambda j: j["attempt"] == attempt and j["state"] == "RUNNING",
             what=f"attempt {attempt} running", timeout=120)  # fmt: skip
    for _ in range(100):
        if any(
            e["kind"] == "placement" and e["attempt"] == attempt for e in events(client, job_id)
        ):
            return placement(client, job_id, attempt)
        time.sleep(0.2)
    raise AssertionError(f"attempt {attempt} of job {job_id} has no placement")


def assert_no_step_recomputed(client: TestClient, job_id: int) -> None:
    """Every attempt's first step follows the previous attempt's last one."""
    points = client.get(f"/v1/jobs/{job_id}/metrics").json()
    steps = [p["step"] for p in points]
    assert steps == list(range(1, len(steps) + 1)), steps
    for resumed in (e for e in events(client, job_id) if e["kind"] == "resumed"):
        last_before = max(p["step"] for p in points if p["attempt"] < resumed["attempt"])
        assert resumed["details"]["step"] == last_before, resumed


def drain(client: TestClient, node: str, **body: Any) -> None:
    answer = client.post(f"/v1/cluster/nodes/{node}/drain", json=body)
    assert answer.status_code == 200, answer.text


def undrain(client: TestClient, node: str) -> None:
    answer = client.post(f"/v1/cluster/nodes/{node}/undrain")
    assert answer.status_code == 200, answer.text


def test_a_drained_node_is_left_in_seconds_then_regained_and_a_drain_during_the_grow(
    service: tuple[TestClient, Nodes, Path],
) -> None:
    client, _, _ = service
    # Checkpoints every 10000 steps, the drain's deadline 3 s: shorter than a checkpoint
    # (none is ever written), so only the hand-over in memory can keep the steps.
    spec = tiny_gpt_spec(
        "drain-ddp",
        scaling={"min_workers": 1, "max_workers": 3},
        training={"max_steps": 100000, "global_batch_size": 24},
        checkpoint={"every_steps": 10000},
        failure={"max_restarts": 0},
    )
    job_id = submit(client, spec)
    wait_for(client, job_id, lambda j: j["state"] == "RUNNING" and j["step"] >= 10, what="step 10")
    nodes = placed(client, job_id, 1)
    assert len(set(nodes)) == 3
    gone = nodes[2]

    drained_at = time.time()
    drain(client, gone, deadline_s=3, reason="maintenance")
    job = wait_for(client, job_id, lambda j: j["attempt"] == 2 and j["state"] == "RUNNING",
                   what="off the drained node", timeout=60)  # fmt: skip
    first = min(
        (p for p in client.get(f"/v1/jobs/{job_id}/metrics").json() if p["attempt"] == 2),
        key=lambda p: p["step"],
        default=None,
    )
    assert first is not None and first["world_size"] == 2
    off_in = first["wall_time"] - drained_at
    assert off_in < 15, f"{off_in:.1f}s from drain to the first step off the node"
    assert gone not in placement(client, job_id, 2)
    assert (job["restarts"], job["world_size"]) == (0, 2)
    assert not [e for e in events(client, job_id) if e["kind"] in ("worker_error", "node_lost")]
    resumed = [e for e in events(client, job_id) if e["kind"] == "resumed"]
    assert [r["details"]["source"] for r in resumed] == ["peer"]
    assert client.get(f"/v1/jobs/{job_id}/checkpoints").json() == []
    noted = [e for e in events(client, job_id) if e["kind"] == "node_draining"]
    assert [e["details"]["node_id"] for e in noted] == [gone]
    node = next(n for n in client.get("/v1/cluster").json()["nodes"] if n["node_id"] == gone)
    assert node["drain"]["reason"] == "maintenance"

    # Undrain: the capacity is back and the job grows onto it. Drain it again while the
    # job is resizing to grow: it must end up off the node again, still counting nothing.
    undrain(client, gone)
    wait_for(client, job_id, lambda j: j["state"] == "RESIZING", what="growing", poll_s=0.05)
    drain(client, gone, reason="changed my mind")
    job = wait_for(
        client,
        job_id,
        lambda j: (
            j["state"] == "RUNNING"
            and j["world_size"] == 2
            and gone not in placement(client, job_id, j["attempt"])
        ),
        what="back at 2 off the node",
        timeout=120,
    )
    assert job["restarts"] == 0
    assert not [e for e in events(client, job_id) if e["kind"] in ("worker_error", "node_lost")]
    undrain(client, gone)
    wait_for(client, job_id, lambda j: j["state"] == "RUNNING" and j["world_size"] == 3,
             what="grown back to 3", timeout=120)  # fmt: skip
    client.post(f"/v1/jobs/{job_id}/cancel")
    job = wait_terminal(client, job_id, timeout=120)
    assert job["restarts"] == 0
    assert_no_step_recomputed(client, job_id)


def test_a_job_at_min_checkpoints_stops_at_the_deadline_and_resumes_after_undrain(
    service: tuple[TestClient, Nodes, Path],
) -> None:
    client, _, _ = service
    spec = tiny_gpt_spec(
        "drain-at-min",
        scaling={"min_workers": 3, "max_workers": 3},
        training={"max_steps": 100000, "global_batch_size": 24},
        checkpoint={"every_steps": 10000},
    )
    job_id = submit(client, spec)
    wait_for(client, job_id, lambda j: j["state"] == "RUNNING" and j["step"] >= 5, what="step 5")
    gone = placed(client, job_id, 1)[1]
    drain(client, gone, deadline_s=6)
    job = wait_for(client, job_id, lambda j: (j["state_reason"] or "").startswith("waiting: "),
                   what="waiting to leave")  # fmt: skip
    assert "needs 3 workers, 2 fit" in job["state_reason"], job
    # It checkpoints first and trains on there until the deadline.
    wait_for(client, job_id, lambda j: bool(client.get(f"/v1/jobs/{job_id}/checkpoints").json()),
             what="a checkpoint")  # fmt: skip
    job = wait_for(client, job_id, lambda j: "below min" in (j["state_reason"] or ""),
                   what="stopped at the deadline, waiting", timeout=60)  # fmt: skip
    assert "draining" in job["state_reason"] and job["restarts"] == 0
    stopped_at = client.get(f"/v1/jobs/{job_id}/checkpoints").json()[0]["step"]
    undrain(client, gone)
    wait_for(client, job_id, lambda j: j["state"] == "RUNNING" and j["attempt"] == 2,
             what="resumed after undrain", timeout=120)  # fmt: skip
    resumed = [e for e in events(client, job_id) if e["kind"] == "resumed"]
    assert [r["details"]["step"] for r in resumed] == [stopped_at]
    client.post(f"/v1/jobs/{job_id}/cancel")
    job = wait_terminal(client, job_id, timeout=120)
    assert job["restarts"] == 0
    assert_no_step_recomputed(client, job_id)


def test_a_preemption_notice_drains_the_node_through_ray(
    service: tuple[TestClient, Nodes, Path],
) -> None:
    client, _, tmp = service
    spec = tiny_gpt_spec(
        "preempted",
        scaling={"min_workers": 1, "max_workers": 3},
        training={"max_steps": 100000, "global_batch_size": 24},
        checkpoint={"every_steps": 10000},
    )
    job_id = submit(client, spec)
    wait_for(client, job_id, lambda j: j["state"] == "RUNNING" and j["step"] >= 5, what="step 5")
    gone = placed(client, job_id, 1)[1]
    # What a cloud agent writes on the node: the notice, 60 s ahead.
    (tmp / NOTICES.format(node_id=gone)).write_text("60")
    job = wait_for(client, job_id, lambda j: j["attempt"] == 2 and j["state"] == "RUNNING",
                   what="off the preempted node", timeout=60)  # fmt: skip
    assert gone not in placement(client, job_id, 2) and job["restarts"] == 0
    noted = next(e for e in events(client, job_id) if e["kind"] == "node_draining")
    assert noted["details"]["source"] == "preemption", noted
    assert noted["details"]["deadline"] > time.time() + 20
    client.post(f"/v1/jobs/{job_id}/cancel")
    wait_terminal(client, job_id, timeout=120)
    assert_no_step_recomputed(client, job_id)
