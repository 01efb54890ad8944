"""Warm GPU processes on a real multi-node Ray cluster whose nodes declare GPUs.

Two worker nodes of 2 CPUs and 2 GPUs each, as Ray resources: this machine has no GPU,
so `ELASTRAIN_TEST_GPU_ON_CPU=1` (`elastrain.workers.devices`) makes GPU ranks train on the CPU
with gloo. What is tested is scheduling and accounting: the pool keeps one process per
GPU from the start; GPU jobs run in them (no process started for an attempt), keep them
across a forced recovery and a resize; two jobs never share one; a CPU job never takes
one; `/v1/cluster` counts GPUs as the jobs hold them. The device path itself (CUDA, NCCL)
is `make gpu-check`'s (bench/gpu_check.py).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import ray
from fastapi.testclient import TestClient

from elastrain.contracts.group import WorkerInfo
from elastrain.contracts.runtime import RUNTIME_NAME, AttemptKey
from elastrain.service.identity import runtime_control_token
from elastrain.workers.devices import TEST_GPU_ON_CPU
from tests.integration.cluster_service import multi_node_service
from tests.integration.ray_service import submit, tiny_gpt_spec, wait_for, wait_terminal
from tests.waiting import wait_until

pytestmark = [pytest.mark.ray, pytest.mark.timeout(900)]

NODES, CPUS, GPUS = 2, 2, 2


def gpu_spec(name: str, *, min_workers: int, max_workers: int) -> dict[str, Any]:
    return tiny_gpt_spec(
        name,
        scaling={"min_workers": min_workers, "max_workers": max_workers, "use_gpu": True,
                 "gpus_per_worker": 1, "cpus_per_worker": 0.25},
        training={"global_batch_size": 16, "micro_batch_size": 4, "max_steps": 100_000},
        checkpoint={"every_steps": 1000},
        failure={"max_restarts": 5},
    )  # fmt: skip


@pytest.fixture
def service(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[TestClient]:
    # The raylets (and so the worker processes) inherit it from this process.
    monkeypatch.setenv(TEST_GPU_ON_CPU, "1")
    with multi_node_service(
        tmp_path,
        worker_nodes=NODES,
        cpus_per_node=CPUS,
        gpus_per_node=GPUS,
        warm_workers_per_node=1,
        grow_interval_s=1,
        restart_backoff_s=0,
        # The forced recovery releases an attempt: each rank lets go at its next step
        # boundary, and one a step ahead of its peer can block in a gloo collective until
        # this timeout (the DDP model kept in memory holds the group's sockets open; issue
        # 25, item 4). A next attempt waits up to 5 + 15 s for a GPU process to come back.
        collective_timeout_s=10,
    ) as (client, _):
        yield client


def pool(client: TestClient) -> list[WorkerInfo]:
    runtime = ray.get_actor(RUNTIME_NAME, namespace="elastrain-chaos")
    return list(ray.get(runtime.workers.remote(runtime_token(client))))


def runtime_token(client: TestClient) -> str:
    """The control plane's token: the runtime answers no one else."""
    return runtime_control_token(client.app.state.session_factory)


def gpu_processes(client: TestClient) -> dict[int, WorkerInfo]:
    """The pool's GPU processes that answered, by pid."""
    return {w.pid: w for w in pool(client) if w.gpu is not None}


def pids_of(client: TestClient, job_id: int, attempt: int) -> set[int]:
    placements = [
        e["details"]["pids"]
        for e in client.get(f"/v1/jobs/{job_id}/events").json()
        if e["kind"] == "placement" and e["attempt"] == attempt
    ]
    assert placements, f"job {job_id} attempt {attempt}: no placement yet"
    return {int(pid) for pid in placements[-1].values()}


def running(
    client: TestClient, job_id: int, attempt: int, world: int, step: int = 2, timeout: float = 300
) -> None:
    wait_for(
        client,
        job_id,
        lambda j: j["state"] == "RUNNING" and j["attempt"] == attempt
        and j["world_size"] == world and j["step"] >= step,
        what=f"attempt {attempt} training at world size {world}",
        timeout=timeout,
    )  # fmt: skip


def timelines(client: TestClient, job_id: int) -> list[dict[str, Any]]:
    """The job's start timelines (for a failure's message)."""
    events = client.get(f"/v1/jobs/{job_id}/events").json()
    return [e["details"] for e in events if e["kind"] == "timeline"]


def gpus_free(client: TestClient) -> float:
    nodes = client.get("/v1/cluster").json()["nodes"]
    return sum(n["gpus_free"] for n in nodes if n["alive"])


def test_gpu_jobs_take_warm_gpu_processes_and_keep_them(service: TestClient) -> None:
    client = service
    wait_until(lambda: len(gpu_processes(client)) == NODES * GPUS, 240, "one process per GPU")
    owners = gpu_processes(client)
    # One per GPU index on each node, and each says what it trains on.
    by_node: dict[str, list[int]] = {}
    for w in owners.values():
        by_node.setdefault(w.node_id, []).append(w.gpu)  # type: ignore[arg-type]
    assert sorted(map(sorted, by_node.values())) == [[0, 1]] * NODES, by_node
    assert all(TEST_GPU_ON_CPU in w.device for w in owners.values()), owners
    nodes = client.get("/v1/cluster").json()["nodes"]
    assert sum(n["gpus_total"] for n in nodes) == NODES * GPUS
    assert gpus_free(client) == NODES * GPUS  # idle processes hold no GPU in the accounting

    # A fixed-size job and an elastic one that gets what is left: warm processes, none shared.
    hog = submit(client, gpu_spec("hog", min_workers=2, max_workers=2))
    running(client, hog, 1, 2)
    elastic = submit(client, gpu_spec("elastic", min_workers=2, max_workers=4))
    running(client, elastic, 1, 2)
    hog_pids, elastic_pids = pids_of(client, hog, 1), pids_of(client, elastic, 1)
    assert hog_pids <= owners.keys() and elastic_pids <= owners.keys()
    assert not hog_pids & elastic_pids, "two jobs share a GPU process"
    wait_until(lambda: gpus_free(client) == 0, 30, "/v1/cluster: every GPU held")

    # A CPU job beside them never takes a GPU process (the CPUs are there: 4 x 0.25 used).
    cpu_job = submit(client, tiny_gpt_spec("cpu", scaling={"min_workers": 1, "max_workers": 1,
                                                           "cpus_per_worker": 0.5}))  # fmt: skip
    running(client, cpu_job, 1, 1)
    assert not pids_of(client, cpu_job, 1) & owners.keys()
    client.post(f"/v1/jobs/{cpu_job}/cancel")

    # A forced recovery (its attempt released under it): the same processes, the state
    # from their memory.
    runtime = ray.get_actor(RUNTIME_NAME, namespace="elastrain-chaos")
    ray.get(runtime.release.remote(runtime_token(client), AttemptKey(elastic, 1)))
    running(client, elastic, 2, 2, step=1)
    assert pids_of(client, elastic, 2) == elastic_pids, timelines(client, elastic)

    # The other job ends: the elastic one grows onto its GPUs, into its processes.
    client.post(f"/v1/jobs/{hog}/cancel")
    assert wait_terminal(client, hog)["state"] == "CANCELLED"
    running(client, elastic, 3, 4, step=1)
    assert pids_of(client, elastic, 3) == elastic_pids | hog_pids
    wait_until(lambda: gpus_free(client) == 0, 30, "/v1/cluster: the grown job holds all 4")

    resumed = [
        e["details"]["source"]
        for e in client.get(f"/v1/jobs/{elastic}/events").json()
        if e["kind"] == "resumed"
    ]
    assert resumed == ["peer", "peer"], resumed
    # Not one GPU process was started after the pool's first ones: every start, recovery
    # and resize ran in them.
    assert gpu_processes(client).keys() == owners.keys()
    client.post(f"/v1/jobs/{elastic}/cancel")
    assert wait_terminal(client, elastic)["state"] == "CANCELLED"
    wait_until(lambda: gpus_free(client) == NODES * GPUS, 30, "every GPU free again")


def test_a_gpu_job_with_its_own_packages_borrows_a_pooled_gpu(service: TestClient) -> None:
    """A job with pip `requirements` runs in a new process started in that environment; a
    GPU rank of it uses the GPU of a pooled process, which stays lent to the attempt (so no
    other job's rank lands on that GPU) and comes back when the attempt ends."""
    client = service
    wait_until(lambda: len(gpu_processes(client)) == NODES * GPUS, 240, "one process per GPU")
    owners = gpu_processes(client)
    spec = gpu_spec("pip", min_workers=1, max_workers=1)
    spec["workload"] = {**spec["workload"], "requirements": ["pyyaml>=5"]}  # installed already
    job = submit(client, spec)
    # Ray builds the pip environment first: 75 s alone here, ~250 s once under CI load.
    running(client, job, 1, 1, timeout=600)
    (pid,) = pids_of(client, job, 1)
    assert pid not in owners  # its own process, in the job's pip environment
    private = next(w for w in pool(client) if w.pid == pid)
    lent = [w for w in pool(client) if w.pid in owners and w.busy]
    assert [(w.node_id, w.gpu) for w in lent] == [(private.node_id, private.gpu)], (private, lent)
    wait_until(lambda: gpus_free(client) == NODES * GPUS - 1, 30, "/v1/cluster: one GPU held")
    client.post(f"/v1/jobs/{job}/cancel")
    assert wait_terminal(client, job)["state"] == "CANCELLED"
    wait_until(
        lambda: not any(w.busy for w in pool(client) if w.pid in owners), 60, "the GPU is back"
    )
