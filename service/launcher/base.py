"""The interface between the scheduler and whatever runs worker groups (Ray, or a fake).

Everything crossing it is plain data, so the scheduler is tested without Ray.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import Any, Protocol


@dataclass(frozen=True, kw_only=True)
class NodeCapacity:
    node_id: str
    address: str = ""
    alive: bool = True
    cpus: float = 0.0
    gpus: float = 0.0


@dataclass(frozen=True, kw_only=True)
class ClusterCapacity:
    nodes: tuple[NodeCapacity, ...] = ()
    dashboard_url: str | None = None

    @property
    def alive_nodes(self) -> tuple[NodeCapacity, ...]:
        return tuple(n for n in self.nodes if n.alive)

    def alive_ids(self) -> set[str]:
        return {n.node_id for n in self.alive_nodes}

    def workers_that_fit(self, cpus_per_worker: float, gpus_per_worker: float) -> int:
        """How many workers of this shape the alive nodes hold in total (per-node packing:
        a worker never spans nodes)."""
        total = 0
        for node in self.alive_nodes:
            by_cpu = int(node.cpus // cpus_per_worker + 1e-9) if cpus_per_worker > 0 else 1 << 30
            by_gpu = int(node.gpus // gpus_per_worker + 1e-9) if gpus_per_worker > 0 else 1 << 30
            total += min(by_cpu, by_gpu)
        return total


@dataclass(frozen=True, kw_only=True)
class LaunchRequest:
    job_id: int
    attempt: int
    world_size: int
    spec: dict[str, Any]
    storage_path: str
    driver_name: str


class DriverStatus(str, Enum):
    STARTING = "starting"  # worker group not yet training
    RUNNING = "running"  # at least one step taken (or restored) in this attempt
    SUCCEEDED = "succeeded"  # reached max_steps
    STOPPED = "stopped"  # stopped on request after a checkpoint (resize)
    FAILED = "failed"  # the worker group raised
    LOST = "lost"  # the driver actor is gone (its node died, or it was killed)


@dataclass(kw_only=True)
class DriverReport:
    """What a driver has to say since the previous poll (buffers are drained)."""

    status: DriverStatus
    metrics: list[dict[str, Any]] = field(default_factory=list)
    commits: list[dict[str, Any]] = field(default_factory=list)
    events: list[dict[str, Any]] = field(default_factory=list)
    error: str | None = None
    resumed_from_step: int | None = None
    placement: dict[int, str] = field(default_factory=dict)  # rank -> node id
    pids: dict[int, int] = field(default_factory=dict)  # rank -> worker process id
    final_step: int | None = None


class Launcher(Protocol):
    def capacity(self) -> ClusterCapacity: ...

    def launch(self, request: LaunchRequest) -> None: ...

    def poll(self, job_id: int, attempt: int) -> DriverReport: ...

    def request_checkpoint(self, job_id: int, attempt: int) -> None: ...

    def request_stop(self, job_id: int, attempt: int) -> None:
        """Checkpoint at the next step, then end the attempt with STOPPED (for a resize)."""

    def kill(self, job_id: int, attempt: int) -> None:
        """Stop the worker group now and free its resources (cancel, node loss)."""

    def release(self, job_id: int, attempt: int) -> None:
        """Forget a finished driver (free its name and actor)."""


def driver_name(job_id: int, attempt: int) -> str:
    return f"elastrain-job{job_id}-a{attempt}"
