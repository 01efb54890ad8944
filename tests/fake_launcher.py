"""An in-memory launcher for fast tests of the scheduler's control logic (no Ray): the
runtime's side of `elastrain.service.launcher.Launcher`, reconciling as `elastrain.workers.runtime.actor` does.

A test drives each fake driver by hand (`fake.driver(job, attempt)`): make it run, report
metrics, commit checkpoints, fail or succeed, and steps the scheduler one pass at a time.
What a test puts in `metrics`/`commits`/`events` becomes typed messages, numbered and kept
until the scheduler acknowledges them, as the real driver does.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any

from elastrain.contracts.messages import (
    CheckpointCommitted,
    Control,
    DriverReport,
    DriverStatus,
    EventKind,
    Placement,
    Resumed,
    StepMetrics,
    WorkerError,
    WorkerEvent,
    WorkerMessage,
)
from elastrain.contracts.runtime import (
    AttemptKey,
    ExportOutcome,
    ExportRequest,
    LaunchRequest,
    Reconcile,
)
from elastrain.service.capacity import ClusterCapacity, NodeCapacity
from elastrain.workers.export_task import run_export
from elastrain.workers.runtime.reconcile import HeldAttempt, attempts_to_release


@dataclass
class FakeDriver:
    request: LaunchRequest
    status: DriverStatus = DriverStatus.STARTING
    metrics: list[dict[str, Any]] = field(default_factory=list)
    commits: list[dict[str, Any]] = field(default_factory=list)
    events: list[dict[str, Any]] = field(default_factory=list)
    error: str | WorkerError | None = None
    resumed_from_step: int | None = None
    placement: dict[int, str] = field(default_factory=dict)
    checkpoint_requests: int = 0
    stop_requested: bool = False
    slow_nodes: tuple[str, ...] = ()  # the straggler watch's nodes (the real driver's)
    killed: bool = False
    outbox: list[tuple[int, WorkerMessage]] = field(default_factory=list)
    seq: int = 0
    acked: int = 0
    _resume_sent: bool = False

    def _send(self, message: WorkerMessage) -> None:
        self.seq += 1
        self.outbox.append((self.seq, message))

    def resume(
        self,
        step: int,
        *,
        path: str = "",
        saved_world_size: int | None = None,
        saved_attempt: int = 0,
        metrics: tuple[StepMetrics, ...] = (),
    ) -> None:
        """The worker group restored the checkpoint of `step` (at `path`, saved at
        `saved_world_size` workers, the current size when not given, by `saved_attempt`,
        with the metric points saved with it)."""
        ws = self.request.world_size
        self._send(
            Resumed(
                step=step,
                path=path,
                saved_world_size=saved_world_size or ws,
                world_size=ws,
                saved_attempt=saved_attempt,
                metrics=metrics,
            )
        )
        self.resumed_from_step = step
        self._resume_sent = True

    def report(self, ack: int) -> DriverReport:
        """Turn what the test queued into messages; report those after `ack`."""
        if self.resumed_from_step is not None and not self._resume_sent:
            self.resume(self.resumed_from_step)
        for point in self.metrics:
            self._send(StepMetrics.from_point(point))
        for commit in self.commits:
            self._send(
                CheckpointCommitted(
                    step=int(commit["step"]),
                    attempt=self.request.attempt,
                    world_size=int(commit.get("world_size") or self.request.world_size),
                    path=str(commit["path"]),
                    bytes=int(commit.get("bytes") or 0),
                    manifest=commit.get("manifest"),
                )
            )
        for ev in self.events:
            self._send(WorkerEvent(event=EventKind(ev.get("kind", "worker_error")),
                                   reason=ev.get("reason", ""), details=ev.get("details")))  # fmt: skip
        self.metrics, self.commits, self.events = [], [], []
        self.acked = max(self.acked, ack)
        self.outbox = [(s, m) for s, m in self.outbox if s > self.acked]
        error = self.error
        if isinstance(error, str):
            error = WorkerError(type="WorkerError", message=error)
        return DriverReport(
            status=self.status,
            messages=tuple(m for _, m in self.outbox),
            seq=self.outbox[-1][0] if self.outbox else self.acked,
            error=error,
            placement=Placement(nodes=dict(self.placement)) if self.placement else None,
            resumed_from_step=self.resumed_from_step,
            stopping=self.stop_requested,
            slow_nodes=self.slow_nodes,
        )


class FakeLauncher:
    def __init__(self, nodes: dict[str, float] | None = None) -> None:
        """`nodes`: node id -> CPUs (default: one node of 2 CPUs; `{}`: no nodes)."""
        self.nodes: dict[str, NodeCapacity] = {
            nid: NodeCapacity(node_id=nid, cpus=cpus)
            for nid, cpus in ({"n0": 2} if nodes is None else nodes).items()
        }
        self.drivers: dict[tuple[int, int], FakeDriver] = {}
        self.launches: list[LaunchRequest] = []
        self.releases: list[tuple[AttemptKey, bool]] = []
        self.reconciled: list[AttemptKey] = []  # released for not being live
        self.fail_releases = False  # make `release` raise, as a lost call would
        self.launch_calls: list[LaunchRequest] = []  # including refused duplicates
        self.exports: list[ExportRequest] = []
        self._lock = threading.Lock()

    # -- test controls ------------------------------------------------------------------
    def remove_node(self, node_id: str) -> None:
        node = self.nodes[node_id]
        self.nodes[node_id] = NodeCapacity(node_id=node_id, cpus=node.cpus, alive=False)

    def add_node(self, node_id: str, cpus: float, *, gpus: float = 0, address: str = "") -> None:
        self.nodes[node_id] = NodeCapacity(node_id=node_id, cpus=cpus, gpus=gpus, address=address)

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
            held = self.drivers.get(key)
            if held is not None and held.request.name == request.name:
                raise RuntimeError(f"driver {request.name} launched twice")
            if held is not None:  # another database's attempt under the same key
                held.killed = True
            self.drivers[key] = FakeDriver(request=request)
            self.launches.append(request)

    def reconcile(self, want: Reconcile) -> dict[AttemptKey, DriverReport]:
        held = [
            HeldAttempt(key=AttemptKey(*k), name=d.request.name, sent_at=d.request.sent_at)
            for k, d in self.drivers.items()
            if not d.killed
        ]
        for key in attempts_to_release(held, want):
            self.drivers[key].killed = True
            self.reconciled.append(key)
        reports = {}
        for key, live in want.attempts.items():
            d = self.drivers.get(key)
            if d is None or d.killed:
                reports[key] = DriverReport(status=DriverStatus.LOST)
            else:
                reports[key] = d.report(live.ack)
        return reports

    def live_drivers(self) -> list[AttemptKey]:
        """What the runtime would still hold."""
        return [AttemptKey(*k) for k, d in self.drivers.items() if not d.killed]

    def send_control(self, key: AttemptKey, control: Control) -> None:
        d = self.drivers[(key.job_id, key.attempt)]
        if control == Control.CHECKPOINT:
            d.checkpoint_requests += 1
        elif control == Control.STOP:
            d.stop_requested = True

    def export(self, request: ExportRequest) -> ExportOutcome:
        # The task's own function, run here instead of on a Ray worker.
        self.exports.append(request)
        return run_export(request)

    def release(self, key: AttemptKey, *, final: bool = False) -> None:
        if self.fail_releases:
            raise TimeoutError("the runtime did not answer")
        self.releases.append((key, final))
        d = self.drivers.get((key.job_id, key.attempt))
        if d is not None:
            d.killed = True
