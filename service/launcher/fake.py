"""An in-memory launcher for fast tests of the scheduler's control logic (no Ray).

A test drives each fake driver by hand (`fake.drivers[(job, attempt)]`): make it run,
report metrics, commit checkpoints, fail or succeed, and steps the scheduler one pass at
a time.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any

from service.launcher.base import (
    ClusterCapacity,
    DriverReport,
    DriverStatus,
    LaunchRequest,
    NodeCapacity,
)


@dataclass
class FakeDriver:
    request: LaunchRequest
    status: DriverStatus = DriverStatus.STARTING
    metrics: list[dict[str, Any]] = field(default_factory=list)
    commits: list[dict[str, Any]] = field(default_factory=list)
    events: list[dict[str, Any]] = field(default_factory=list)
    error: str | None = None
    resumed_from_step: int | None = None
    placement: dict[int, str] = field(default_factory=dict)
    checkpoint_requests: int = 0
    stop_requested: bool = False
    killed: bool = False


class FakeLauncher:
    def __init__(self, nodes: dict[str, float] | None = None) -> None:
        """`nodes`: node id -> CPUs."""
        self.nodes: dict[str, NodeCapacity] = {
            nid: NodeCapacity(node_id=nid, cpus=cpus) for nid, cpus in (nodes or {"n0": 2}).items()
        }
        self.drivers: dict[tuple[int, int], FakeDriver] = {}
        self.launches: list[LaunchRequest] = []
        self.launch_calls: list[LaunchRequest] = []  # including refused duplicates
        self._lock = threading.Lock()

    # -- test controls ------------------------------------------------------------------
    def remove_node(self, node_id: str) -> None:
        node = self.nodes[node_id]
        self.nodes[node_id] = NodeCapacity(node_id=node_id, cpus=node.cpus, alive=False)

    def add_node(self, node_id: str, cpus: float) -> None:
        self.nodes[node_id] = NodeCapacity(node_id=node_id, cpus=cpus)

    def driver(self, job_id: int, attempt: int | None = None) -> FakeDriver:
        if attempt is None:
            attempt = max(a for (j, a) in self.drivers if j == job_id)
        return self.drivers[(job_id, attempt)]

    # -- Launcher -----------------------------------------------------------------------
    def capacity(self) -> ClusterCapacity:
        return ClusterCapacity(nodes=tuple(self.nodes.values()))

    def launch(self, request: LaunchRequest) -> None:
        with self._lock:
            key = (request.job_id, request.attempt)
            self.launch_calls.append(request)
            if key in self.drivers:
                raise RuntimeError(f"driver {request.driver_name} launched twice")
            self.drivers[key] = FakeDriver(request=request)
            self.launches.append(request)

    def poll(self, job_id: int, attempt: int) -> DriverReport:
        d = self.drivers.get((job_id, attempt))
        if d is None or d.killed:
            return DriverReport(status=DriverStatus.LOST)
        report = DriverReport(
            status=d.status,
            metrics=d.metrics,
            commits=d.commits,
            events=d.events,
            error=d.error,
            resumed_from_step=d.resumed_from_step,
            placement=dict(d.placement),
        )
        d.metrics, d.commits, d.events = [], [], []
        return report

    def request_checkpoint(self, job_id: int, attempt: int) -> None:
        self.drivers[(job_id, attempt)].checkpoint_requests += 1

    def request_stop(self, job_id: int, attempt: int) -> None:
        self.drivers[(job_id, attempt)].stop_requested = True

    def kill(self, job_id: int, attempt: int) -> None:
        d = self.drivers.get((job_id, attempt))
        if d is not None:
            d.killed = True

    def release(self, job_id: int, attempt: int) -> None:
        d = self.drivers.get((job_id, attempt))
        if d is not None:
            d.killed = True
