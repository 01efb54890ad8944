"""Machines fail in more ways than processes: a node cut off the network (its processes
live on, a true zombie), a node frozen (SIGSTOP: a hung kernel, a long GC pause), a raylet
killed. On real network namespaces (tests/chaos/netns_cluster.py), for each: the job resumes
at the smaller size, nothing the old attempt does afterwards reaches the database or a
committed checkpoint, the node comes back and the job grows back, and the loss curve up
to some steps after the grow is the one an uninterrupted run gives.

Topology: the head (GCS, the service's runtime actor; 0 CPUs) on a bridge in the root
namespace; `big` (2 CPUs) and `small` (1 CPU) each in their own namespace. The job (DDP,
1..2 workers) starts while only `big` exists, so its whole first worker group is there:
cut off, that group could go on training and checkpointing on its own. Then `small`
joins, `big` fails, the job resumes at 1 on `small`, `big` comes back (a new raylet, as a
supervisor would start it) and the job grows back to 2.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import ray
from fastapi.testclient import TestClient

from elastrain.api.main import create_app
from elastrain.checkpoints.fence import read_fence
from elastrain.checkpoints.layout import DCP_METADATA_NAME, iter_step_dirs
from elastrain.checkpoints.manifest import ManifestError, read_manifest
from elastrain.contracts.storage import JobStorage
from elastrain.service.settings import Settings
from tests.chaos.netns_cluster import HEALTH_CHECK_ENV, NetnsCluster, Node
from tests.integration.ray_service import (
    cancel_at_step,
    submit,
    tiny_gpt_spec,
    wait_for,
    wait_terminal,
)
from tests.waiting import exited, wait_until

pytestmark = [pytest.mark.ray, pytest.mark.chaos]

# Long enough (16 micro-batches a step) that the job is still training after the node's loss
# is detected, the resume at 1, the node's return and the grow back to 2 (about step 260
# of 600 on a quiet machine).
MAX_STEPS = 600
SPEC = tiny_gpt_spec(
    "netns",
    scaling={"min_workers": 1, "max_workers": 2, "cpus_per_worker": 1},
    training={"global_batch_size": 32, "micro_batch_size": 2, "max_steps": MAX_STEPS},
    checkpoint={"every_steps": 10, "keep_last": 3},
    failure={"max_restarts": 3},
)
NAMESPACE = "elastrain-netns"
#: The faulted job is compared with the uninterrupted one up to this many steps after it
#: grew back to 2, then cancelled.
AFTER_GROW_STEPS = 20


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[NetnsCluster]:
    if os.geteuid() != 0:
        pytest.fail("network-namespace chaos tests need root (CAP_NET_ADMIN), as CI has")
    for key, value in HEALTH_CHECK_ENV.items():  # this process is a Ray driver too
        os.environ[key] = value
    cluster = NetnsCluster(tmp_path_factory.mktemp("netns"))
    try:
        cluster.start(node_cpus=[])
        ray.init(address=cluster.address, namespace=NAMESPACE, logging_level="ERROR")
        yield cluster
    finally:
        ray.shutdown()
        cluster.shutdown()


@contextmanager
def service(cluster: NetnsCluster, tmp: Path) -> Iterator[TestClient]:
    # Each service its own Ray namespace, so its runtime actor and worker pool start empty
    # (job ids start at 1 again in every new database).
    namespace = f"{NAMESPACE}-{secrets.token_hex(3)}"
    settings = Settings(
        database_url=f"sqlite:///{tmp / 'elastrain.db'}",
        storage_path=tmp / "storage",
        ray_address=cluster.address,
        ray_namespace=namespace,
        scheduler_interval_s=0.3,
        grow_interval_s=2,
        # Grow as soon as the node is back, as before warm-only growth: at world size 1 this
        # short job could otherwise finish before the new node's process is up (under load).
        grow_warm_wait_s=0,
        restart_backoff_s=0.5,
        # A partitioned peer is noticed by Ray's health checks (seconds); a collective
        # stuck on it gives up after this.
        collective_timeout_s=20,
    )
    try:
        with TestClient(create_app(settings, start_scheduler=True)) as client:
            yield client
    finally:
        # The runtime and its pooled processes are detached (they outlive a control
        # plane); this service is done for good.
        for entry in ray.util.list_named_actors(all_namespaces=True):
            if entry["namespace"] == namespace:
                with contextlib.suppress(Exception):
                    ray.kill(ray.get_actor(entry["name"], namespace=namespace))


def per_step(client: TestClient, job_id: int, key: str) -> dict[int, Any]:
    return {m["step"]: m[key] for m in client.get(f"/v1/jobs/{job_id}/metrics").json()}


@pytest.fixture(scope="module")
def baseline(cluster: NetnsCluster, tmp_path_factory: pytest.TempPathFactory) -> dict[int, float]:
    """The loss curve of the same job, uninterrupted, on this cluster."""
    big = cluster.add_node(2)
    try:
        with service(cluster, tmp_path_factory.mktemp("baseline")) as client:
            job_id = submit(client, {**SPEC, "name": "steady"})
            assert wait_terminal(client, job_id, timeout=600)["state"] == "SUCCEEDED"
            return per_step(client, job_id, "loss")
    finally:
        cluster.remove_node(big)


def _partition(cluster: NetnsCluster, node: Node) -> Callable[[], None]:
    cluster.partition(node)
    return lambda: cluster.heal(node)


def _freeze(cluster: NetnsCluster, node: Node) -> Callable[[], None]:
    cluster.freeze(node)
    return lambda: cluster.thaw(node)


def _kill_raylet(cluster: NetnsCluster, node: Node) -> Callable[[], None]:
    cluster.kill_raylet(node)
    return lambda: None


FAULTS = {"partition": _partition, "freeze": _freeze, "raylet-kill-9": _kill_raylet}


@pytest.mark.parametrize("fault", list(FAULTS))
def test_the_job_survives_the_node_and_the_zombie_writes_nothing(
    cluster: NetnsCluster, baseline: dict[int, float], tmp_path: Path, fault: str
) -> None:
    big = cluster.add_node(2)
    small: Node | None = None
    try:
        with service(cluster, tmp_path) as client:
            job_id = submit(client, SPEC)
            first = wait_for(
                client, job_id, lambda j: j["state"] == "RUNNING" and j["step"] >= 15,
                what="step 15 at world size 2", timeout=300,
            )  # fmt: skip
            assert first["world_size"] == 2
            small = cluster.add_node(1)

            undo = FAULTS[fault](cluster, big)
            cluster.wait_dead(big)
            zombie = Zombie(
                JobStorage.of(tmp_path / "storage", job_id),
                pids=[p for p in big.pids() if "ray::Worker" in _comm(p)],
            )
            resumed = wait_for(
                client, job_id, lambda j: j["state"] == "RUNNING" and j["attempt"] == 2,
                what="resume at world size 1", timeout=120,
            )  # fmt: skip
            assert resumed["world_size"] == 1
            if fault == "partition":
                # A true zombie: cut off, its worker processes are still alive, and it meets
                # the fence while still cut off.
                assert zombie.pids and not any(map(exited, zombie.pids)), zombie.pids
                wait_until(zombie.settled, 120, "the cut-off attempt stops at the fence and "
                           "settles its saves", detail=zombie.describe)  # fmt: skip
            undo()  # the node heals or thaws (nothing to undo after a raylet kill)
            # Whatever the old attempt's processes would still do once they run again, they
            # have done before its node starts anew (which kills every leftover on it).
            wait_until(zombie.done, 120, "the old attempt's processes stop at the fence or "
                       "exit", detail=zombie.describe)  # fmt: skip
            cluster.start_raylet(big)  # the node comes back (a new raylet)

            grown = wait_for(
                client, job_id, lambda j: j["state"] == "RUNNING" and j["world_size"] == 2,
                what="grow back to 2", timeout=300,
            )  # fmt: skip
            assert grown["attempt"] >= 3
            # Some steps at 2 after the grow, then stop: the rest of the run (most of the
            # test's time, ~40 s alone) is an uninterrupted job, which other tests finish.
            final = cancel_at_step(client, job_id, grown["step"] + AFTER_GROW_STEPS)
            story = [
                (e["kind"], e["to_state"], e["attempt"], e["reason"])
                for e in client.get(f"/v1/jobs/{job_id}/events").json()
            ]
            assert final["state"] == "CANCELLED", story  # it never failed on its own
            assert final["restarts"] == 0, story  # losing a node is not the job's fault

            _assert_no_zombie_writes(client, job_id, tmp_path / "storage")
            losses = per_step(client, job_id, "loss")
            last = max(losses)
            assert last >= grown["step"] + AFTER_GROW_STEPS
            assert losses.keys() == set(range(1, last + 1)) <= baseline.keys()
            worst = max(abs(v - baseline[s]) / abs(baseline[s]) for s, v in losses.items())
            assert worst < 1e-3, f"largest relative loss difference {worst:.2e}"
    finally:
        for node in (big, small):
            if node is not None:
                cluster.remove_node(node)


def _assert_no_zombie_writes(client: TestClient, job_id: int, storage: Path) -> None:
    events = client.get(f"/v1/jobs/{job_id}/events").json()
    resumed = [e for e in events if e["kind"] == "resumed"]
    from_step = resumed[0]["details"]["step"]
    # The database: attempt 1's metric rows stop where attempt 2 resumed (the later ones
    # were recomputed and replaced by attempt 2); nothing it sent afterwards was stored.
    rows = client.get(f"/v1/jobs/{job_id}/metrics").json()
    assert max(r["step"] for r in rows if r["attempt"] == 1) <= from_step
    catalogue = client.get(f"/v1/jobs/{job_id}/checkpoints").json()
    assert all(c["attempt"] != 1 or c["step"] <= from_step for c in catalogue), catalogue
    # Storage: no checkpoint of attempt 1 committed after attempt 2 started.
    job_root = JobStorage.of(storage, job_id).root
    replaced = read_fence(job_root).replaced_at(1)
    assert replaced is not None
    for step_dir in iter_step_dirs(job_root / "checkpoints"):
        if step_dir.attempt != 1:
            continue
        try:
            manifest = read_manifest(step_dir.path)
        except ManifestError:
            continue  # uncommitted: never resumed from, deleted by retention
        assert manifest.created_at <= replaced, (step_dir.path, manifest.created_at, replaced)
    assert json.loads((job_root / "fence.json").read_text())["starts"][0][0] == 1


def _comm(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[0].decode()
    except OSError:
        return ""


@dataclass
class Zombie:
    """Attempt 1's processes on the failed node, cut off from the control plane."""

    storage: JobStorage
    pids: list[int]

    @property
    def rank0_log(self) -> Path:
        return self.storage.log_file(attempt=1, rank=0)

    def stopped_at_the_fence(self) -> bool:
        """Its rank 0 (the one that commits checkpoints and reports) saw the newer attempt
        and stopped, saying so (workers/loop.py `stops_when_superseded`)."""
        log = self.rank0_log
        return log.exists() and "was superseded by attempt 2" in log.read_text(errors="replace")

    def unsettled_saves(self) -> list[Path]:
        """Its checkpoint folders whose write is not over (no DCP `.metadata` yet, so no
        commit decided): an async save can outlive the loop that started it."""
        return [
            d.path
            for d in iter_step_dirs(self.storage.checkpoints)
            if d.attempt == 1 and not (d.path / DCP_METADATA_NAME).exists()
        ]

    def settled(self) -> bool:
        """Rank 0 stopped at the fence and every save it had started is over (refused at
        the fence, or committed before the fence moved)."""
        return self.stopped_at_the_fence() and not self.unsettled_saves()

    def done(self) -> bool:
        """Nothing more can come from it: settled, or every process exited."""
        return self.settled() or all(map(exited, self.pids))

    def describe(self) -> str:
        alive = [p for p in self.pids if not exited(p)]
        log = self.rank0_log
        tail = log.read_text(errors="replace")[-2000:] if log.exists() else "(no log)"
        return f"alive: {alive}; unsettled saves: {self.unsettled_saves()}\n{tail}"


def test_a_survivor_blocked_on_a_cut_off_peer_is_freed_and_hands_on_its_state(
    cluster: NetnsCluster, tmp_path: Path
) -> None:
    """A two-node group; one node is cut off mid-run. Its peer is then blocked in a
    collective that can never complete (nothing closed its connections). Once the control
    plane decides the node is gone, the survivor is freed within two seconds (not at the
    collective's timeout) and the next attempt takes the job's state from its memory: no
    step is recomputed."""
    left, right = cluster.add_node(1), cluster.add_node(1)  # one worker each: the group spans
    spec = {**SPEC, "name": "spanning",
            "checkpoint": {"every_steps": MAX_STEPS, "keep_last": 2}}  # fmt: skip
    try:
        with service(cluster, tmp_path) as client:
            job_id = submit(client, spec)
            running = wait_for(
                client, job_id, lambda j: j["state"] == "RUNNING" and j["step"] >= 10,
                what="step 10 at world size 2", timeout=300,
            )  # fmt: skip
            assert running["world_size"] == 2
            cluster.identify_nodes()
            (placed,) = [e for e in client.get(f"/v1/jobs/{job_id}/events").json()
                         if e["kind"] == "placement"]  # fmt: skip
            cut = cluster.node_by_id(placed["details"]["ranks"]["1"])
            before = client.get(f"/v1/jobs/{job_id}").json()["step"]
            cluster.partition(cut)
            cluster.wait_dead(cut)
            wait_for(
                client, job_id, lambda j: j["state"] == "RUNNING" and j["attempt"] == 2,
                what="the job at world size 1", timeout=120,
            )  # fmt: skip
            events = client.get(f"/v1/jobs/{job_id}/events").json()
            resumed = [e["details"] for e in events if e["kind"] == "resumed"]
            # Without the survivor (still blocked) the job starts over: no resume at all.
            assert [r["source"] for r in resumed] == ["peer"], [e["reason"] for e in events]
            assert resumed[0]["step"] >= before  # nothing recomputed
            (timeline,) = [e for e in events if e["kind"] == "timeline"
                           and e["details"]["attempt"] == 2]  # fmt: skip
            phases = {p["phase"]: p for p in timeline["details"]["phases"]}
            # Detected -> the old group's processes let go: the survivor was blocked.
            assert phases["old_group_stopped"]["since_start_s"] < 2.0, timeline
            client.post(f"/v1/jobs/{job_id}/cancel")
            wait_terminal(client, job_id, timeout=120)
            cluster.heal(cut)
    finally:
        for node in (left, right):
            cluster.remove_node(node)
