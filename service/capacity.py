"""Cluster capacity arithmetic: what the nodes hold, what jobs take, what is left. Pure.

The scheduler reads the cluster from the launcher (`ClusterCapacity`), charges every live
attempt's workers to it (`free_capacity`) and asks how many workers of a job's shape still
fit. A `CapacityLedger` keeps that sum up to date while one pass decides job after job, so
capacity promised to one job is not offered to the next.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, replace

from contracts.spec import JobSpec


@dataclass(frozen=True, kw_only=True, slots=True)
class NodeCapacity:
    node_id: str
    address: str = ""
    alive: bool = True
    cpus: float = 0.0
    gpus: float = 0.0
    memory_bytes: int = 0
    """Host memory Ray may give to tasks on the node (its `memory` resource)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class ClusterCapacity:
    nodes: tuple[NodeCapacity, ...] = ()
    dashboard_url: str | None = None

    @property
    def alive_nodes(self) -> tuple[NodeCapacity, ...]:
        return tuple(n for n in self.nodes if n.alive)

    def alive_ids(self) -> frozenset[str]:
        return frozenset(n.node_id for n in self.alive_nodes)

    def worker_memory_bytes(self, cpus_per_worker: float) -> int | None:
        """Host memory a CPU worker of this shape can count on (see `memory_share`)."""
        return memory_share(((n.memory_bytes, n.cpus) for n in self.alive_nodes), cpus_per_worker)

    def workers_that_fit(self, cpus_per_worker: float, gpus_per_worker: float) -> int:
        """How many workers of this shape the alive nodes hold in total (per-node packing:
        a worker never spans nodes)."""
        total = 0
        for node in self.alive_nodes:
            by_cpu = int(node.cpus // cpus_per_worker + 1e-9) if cpus_per_worker > 0 else 1 << 30
            by_gpu = int(node.gpus // gpus_per_worker + 1e-9) if gpus_per_worker > 0 else 1 << 30
            total += max(min(by_cpu, by_gpu), 0)
        return total


def memory_share(nodes: Iterable[tuple[int, float]], cpus_per_worker: float) -> int | None:
    """A worker's CPU share of a node's memory, on the poorest node that holds one worker
    (`nodes`: (memory bytes, CPUs) of each alive node); None when no node says."""
    shares = [
        int(memory * min(1.0, cpus_per_worker / cpus))
        for memory, cpus in nodes
        if memory > 0 and cpus >= cpus_per_worker
    ]
    return min(shares) if shares else None


@dataclass(frozen=True, kw_only=True, slots=True)
class WorkerShape:
    cpus: float
    gpus: float

    @classmethod
    def of(cls, spec: JobSpec) -> WorkerShape:
        return cls(cpus=spec.scaling.cpus_per_worker, gpus=spec.scaling.gpus_per_worker)


@dataclass(frozen=True, kw_only=True, slots=True)
class Allocation:
    """Workers a live attempt holds (or has been promised). `nodes` lists the node of each
    placed worker; the rest of `count` is not placed yet and is charged first-fit, as Ray's
    PACK placement would."""

    shape: WorkerShape
    count: int
    nodes: tuple[str, ...] = ()


def free_capacity(cluster: ClusterCapacity, allocations: Iterable[Allocation]) -> ClusterCapacity:
    """What is left of the alive nodes after the allocations."""
    free = {n.node_id: n for n in cluster.alive_nodes}

    def charge(node_id: str, shape: WorkerShape) -> None:
        node = free[node_id]
        free[node_id] = replace(node, cpus=node.cpus - shape.cpus, gpus=node.gpus - shape.gpus)

    unplaced: list[WorkerShape] = []
    for alloc in allocations:
        # Workers on dead nodes hold nothing (and are not charged elsewhere).
        for node_id in alloc.nodes:
            if node_id in free:
                charge(node_id, alloc.shape)
        unplaced.extend([alloc.shape] * max(alloc.count - len(alloc.nodes), 0))
    for shape in unplaced:
        for node_id, node in free.items():
            if node.cpus + 1e-9 >= shape.cpus and node.gpus + 1e-9 >= shape.gpus:
                charge(node_id, shape)
                break
    return replace(cluster, nodes=tuple(free.values()))


def target_world_size(spec: JobSpec, free: ClusterCapacity, *, limit: int | None = None) -> int:
    """The largest world size the job can run at on `free` capacity and within `limit`
    workers (its tenant's quota), or 0 when that is below its min."""
    shape = WorkerShape.of(spec)
    fit = free.workers_that_fit(shape.cpus, shape.gpus)
    return spec.usable_world_size(fit if limit is None else min(fit, limit))


class CapacityLedger:
    """The cluster and what every live job holds, during one scheduler pass."""

    def __init__(self, cluster: ClusterCapacity, held: Mapping[int, Allocation]) -> None:
        self.cluster = cluster
        self._held = dict(held)

    def free(self) -> ClusterCapacity:
        """Free for a newcomer: the cluster less every job's workers."""
        return free_capacity(self.cluster, self._held.values())

    def free_for(self, job_id: int) -> ClusterCapacity:
        """Free for `job_id` if it gave back what it holds (its relaunch or growth)."""
        return free_capacity(self.cluster, (a for jid, a in self._held.items() if jid != job_id))

    def workers_held(self, job_ids: Iterable[int]) -> int:
        """Workers the given jobs hold (a tenant's, for its quota)."""
        return sum(a.count for jid in job_ids if (a := self._held.get(jid)) is not None)

    def hold(self, job_id: int, allocation: Allocation | None) -> None:
        if allocation is None:
            self._held.pop(job_id, None)
        else:
            self._held[job_id] = allocation
