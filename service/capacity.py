"""Cluster capacity arithmetic: what the nodes hold, what jobs take, what is left. Pure.

The scheduler reads the cluster from the launcher (`ClusterCapacity`), charges every live
attempt's workers to it (`free_capacity`) and asks how many workers of a job's shape still
fit. A `CapacityLedger` keeps that sum up to date while one pass decides job after job, so
capacity promised to one job is not offered to the next.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Collection, Iterable, Mapping
from dataclasses import dataclass, field, replace
from enum import Enum
from typing import Any, cast

from elastrain.contracts.messages import DriverReport, DriverStatus, ErrorKind
from elastrain.contracts.spec import JobSpec

#: How long a node an attempt's driver found dead (its raylet refused a connection) counts
#: as dead while Ray still lists it alive: Ray declares it dead after its health checks
#: (15 s by default); past this, Ray's word alone counts again.
FOUND_DEAD_HOLD_S = 60.0


@dataclass(frozen=True, kw_only=True, slots=True)
class NodeCapacity:
    node_id: str
    address: str = ""
    alive: bool = True
    cpus: float = 0.0
    gpus: float = 0.0
    memory_bytes: int = 0
    """Host memory Ray may give to tasks on the node (its `memory` resource)."""
    draining: bool = False
    """Going away (`NodeDrain`): alive, its ranks not lost, but no worker is placed there."""
    warming: bool = False
    """Joined, but no warm worker process on it has answered yet (`warming_nodes`): a rank
    placed there now waits for a process to start and import torch. Its capacity counts
    (a start or recovery would wait for it anyway), but a running job does not stop to
    grow onto it yet (`elastrain.service.decisions`)."""
    joined_at: float | None = None
    """When the control plane first saw it alive (epoch seconds; None: not known)."""
    warm_at: float | None = None
    """When its first pool process had its imports done (epoch seconds; None: not yet, or
    not known): with `joined_at`, where the timeline of a grow onto it starts."""


class DrainSource(str, Enum):
    ADMIN = "admin"  # `elastrain drain` / POST /v1/cluster/nodes/{id}/drain
    RAY = "ray"  # Ray's drain API: the autoscaler, KubeRay scale-down, `ray drain-node`
    PREEMPTION = "preemption"  # a cloud's preemption notice reached the node
    STRAGGLER = "straggler"  # one job keeps off it for a while: its rank there was slow


@dataclass(frozen=True, kw_only=True, slots=True)
class NodeDrain:
    """A node that is going away: jobs leave it at a step boundary, nothing new lands on it."""

    node_id: str
    reason: str = ""
    deadline: float | None = None
    """When the node goes (epoch seconds); None: no deadline."""
    source: DrainSource = DrainSource.ADMIN


@dataclass(frozen=True, kw_only=True, slots=True)
class ClusterCapacity:
    nodes: tuple[NodeCapacity, ...] = ()
    dashboard_url: str | None = None
    drains: tuple[NodeDrain, ...] = ()
    """Nodes Ray reports draining (its drain API), as the launcher read them."""
    # Answers already computed on this (immutable) capacity: a scheduler pass asks the
    # same questions of one free capacity for every queued job.
    # (Not an __init__ argument: `dataclasses.replace` gives every copy a fresh one.)
    _memo: dict[tuple[object, ...], object] = field(
        default_factory=dict, init=False, compare=False, hash=False, repr=False
    )

    def _memoized(self, key: tuple[object, ...], compute: Callable[[], Any]) -> Any:
        if key not in self._memo:
            self._memo[key] = compute()
        return self._memo[key]

    @property
    def alive_nodes(self) -> tuple[NodeCapacity, ...]:
        return self._memoized(("alive",), lambda: tuple(n for n in self.nodes if n.alive))

    def alive_ids(self) -> frozenset[str]:
        return self._memoized(
            ("alive_ids",), lambda: frozenset(n.node_id for n in self.alive_nodes)
        )

    def with_dead(self, dead: Collection[str]) -> ClusterCapacity:
        """This capacity with the nodes `dead` marked not alive (`found_dead`)."""
        if not dead:
            return self
        nodes = tuple(replace(n, alive=False) if n.node_id in dead else n for n in self.nodes)
        return replace(self, nodes=nodes)

    def without_warming(self) -> ClusterCapacity:
        """This capacity less the nodes still warming up."""
        if not any(n.warming for n in self.nodes):
            return self
        return self._memoized(
            ("ready",), lambda: replace(self, nodes=tuple(n for n in self.nodes if not n.warming))
        )

    def worker_memory_bytes(self, cpus_per_worker: float) -> int | None:
        """Host memory a CPU worker of this shape can count on (see `memory_share`)."""
        return self._memoized(
            ("memory", cpus_per_worker),
            lambda: memory_share(
                ((n.memory_bytes, n.cpus) for n in self.alive_nodes), cpus_per_worker
            ),
        )

    def workers_that_fit(self, cpus_per_worker: float, gpus_per_worker: float) -> int:
        """How many workers of this shape the alive nodes hold in total (per-node packing:
        a worker never spans nodes)."""
        return self._memoized(
            ("fit", cpus_per_worker, gpus_per_worker),
            lambda: sum(_fit(n, cpus_per_worker, gpus_per_worker) for n in self.alive_nodes),
        )

    def nodes_of(self, ids: Iterable[str]) -> list[NodeCapacity]:
        """The nodes of these ids that this capacity has."""
        position = self._position()
        return [self.nodes[i] for node_id in ids if (i := position.get(node_id)) is not None]

    def _position(self) -> dict[str, int]:
        return self._memoized(
            ("position",), lambda: {n.node_id: i for i, n in enumerate(self.nodes)}
        )

    def with_resources_of(self, changed: Iterable[NodeCapacity]) -> ClusterCapacity:
        """This capacity with the nodes of the same ids as `changed` (those it has) as
        `changed` has them. What was already counted here is carried over, adjusted for
        those nodes alone: a pass credits every running job's workers back to the free
        capacity, and counting every node again for each job was O(jobs x nodes)."""
        position = self._position()
        nodes = list(self.nodes)
        swapped = []
        for node in changed:
            if (i := position.get(node.node_id)) is not None:
                swapped.append((nodes[i], node))
                nodes[i] = node
        out = replace(self, nodes=tuple(nodes))
        same_alive = all(old.alive == new.alive for old, new in swapped)
        for key, known in self._memo.items():
            if key[0] == "fit":
                cpus, gpus = cast(tuple[float, float], key[1:])
                out._memo[key] = cast(int, known) + sum(
                    [_fit(new, cpus, gpus) - _fit(old, cpus, gpus) for old, new in swapped]
                )
            elif key[0] == "position" or (key[0] == "alive_ids" and same_alive):
                out._memo[key] = known
        return out


#: More workers than any node holds: the answer for a resource the shape does not use.
_UNBOUNDED = 1 << 30


def _fit(node: NodeCapacity, cpus_per_worker: float, gpus_per_worker: float) -> int:
    """Workers of this shape the node holds (none when it is dead or draining)."""
    if not node.alive or node.draining:
        return 0
    return max(min(_count(node.cpus, cpus_per_worker), _count(node.gpus, gpus_per_worker)), 0)


def _count(have: float, each: float) -> int:
    """How many `each` fit in `have`, capped: a share too small to count (a stored spec
    from before the bounds, 1e-320 CPUs) must not overflow `int` and stop the pass."""
    if not each > 0:  # 0 (a resource the worker does not use), or NaN
        return _UNBOUNDED
    ratio = have // each + 1e-9
    return int(ratio) if ratio < _UNBOUNDED else _UNBOUNDED


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
    alive = cluster.alive_nodes
    cpus = {n.node_id: n.cpus for n in alive}
    gpus = {n.node_id: n.gpus for n in alive}

    unplaced: list[WorkerShape] = []
    for alloc in allocations:
        # Workers on dead nodes hold nothing (and are not charged elsewhere).
        for node_id in alloc.nodes:
            if node_id in cpus:
                cpus[node_id] -= alloc.shape.cpus
                gpus[node_id] -= alloc.shape.gpus
        unplaced.extend([alloc.shape] * max(alloc.count - len(alloc.nodes), 0))
    for shape in unplaced:
        for node_id in cpus:
            if cpus[node_id] + 1e-9 >= shape.cpus and gpus[node_id] + 1e-9 >= shape.gpus:
                cpus[node_id] -= shape.cpus
                gpus[node_id] -= shape.gpus
                break
    nodes = tuple(replace(n, cpus=cpus[n.node_id], gpus=gpus[n.node_id]) for n in alive)
    return replace(cluster, nodes=nodes)


def credit(free: ClusterCapacity, allocation: Allocation) -> ClusterCapacity:
    """`free` with the allocation's placed workers given back to their (alive) nodes."""
    back = Counter(allocation.nodes)
    shape = allocation.shape
    # Counted once on `free`, then carried over to each job's credited copy (the job is
    # asked how many of its own workers would fit).
    free.workers_that_fit(shape.cpus, shape.gpus)
    return free.with_resources_of(
        replace(n, cpus=n.cpus + shape.cpus * k, gpus=n.gpus + shape.gpus * k)
        for n in free.nodes_of(back)
        if (k := back[n.node_id])
    )


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
        self._free: ClusterCapacity | None = None  # until the next `hold`
        self._all_placed: bool | None = None  # likewise

    def free(self) -> ClusterCapacity:
        """Free for a newcomer: the cluster less every job's workers."""
        if self._free is None:
            self._free = free_capacity(self.cluster, self._held.values())
        return self._free

    def free_for(self, job_id: int) -> ClusterCapacity:
        """Free for `job_id` if it gave back what it holds (its relaunch or growth). A pass
        asks this of every job, queued ones included: those hold nothing, and the answer
        is the one `free()` computed once. When every worker held is placed on a node, a
        job's own are simply credited back to `free()`; workers not placed yet are charged
        first-fit, which depends on everything else, so then it is computed afresh."""
        own = self._held.get(job_id)
        if own is None:
            return self.free()
        if self._all_placed is None:  # asked of every running job: once per change
            self._all_placed = all(a.count <= len(a.nodes) for a in self._held.values())
        if self._all_placed:
            return credit(self.free(), own)
        return free_capacity(self.cluster, (a for jid, a in self._held.items() if jid != job_id))

    def workers_held(self, job_ids: Iterable[int]) -> int:
        """Workers the given jobs hold (a tenant's, for its quota)."""
        return sum(a.count for jid in job_ids if (a := self._held.get(jid)) is not None)

    def resources_held(self, job_ids: Iterable[int]) -> tuple[float, float]:
        """CPUs and GPUs the given jobs hold (a tenant's, for its fair share)."""
        held = [a for jid in job_ids if (a := self._held.get(jid)) is not None]
        return (
            sum(a.shape.cpus * a.count for a in held),
            sum(a.shape.gpus * a.count for a in held),
        )

    def hold(self, job_id: int, allocation: Allocation | None) -> None:
        if self._held.get(job_id) == allocation:
            return  # a queued job still holding nothing: the sum stands
        self._free = self._all_placed = None
        if allocation is None:
            self._held.pop(job_id, None)
        else:
            self._held[job_id] = allocation


def warming_nodes(
    alive: Iterable[str],
    ready: frozenset[str] | None,
    first_seen: Mapping[str, float],
    *,
    now: float,
    wait_s: float,
) -> frozenset[str]:
    """The alive nodes a running job should not stop to grow onto yet: those the runtime
    has no answering worker process on (`ready`; None: it has not said yet, and nothing
    is held back), for at most `wait_s` from when the node was first seen (a node whose
    processes never start is grown onto anyway: the attempt then starts one there)."""
    if ready is None:
        return frozenset()
    return frozenset(n for n in alive if n not in ready and now - first_seen.get(n, now) < wait_s)


#: `grow_joins` keys: a grow's RESIZING event carries them, its attempt's timeline marks them.
NODE_JOINED_AT = "node_joined_at"
PROCESS_WARM_AT = "process_warm_at"


def grow_joins(
    nodes: Iterable[NodeCapacity], *, used: Iterable[str], attempt_started: float, now: float
) -> dict[str, float]:
    """Where the timeline of a grow decided `now` starts: when the nodes that joined while
    the job's attempt ran (started at `attempt_started`, on the nodes `used`) joined (the
    first of them) and had a warm process (the last: the grow waited for it), clamped into
    joined <= warm <= now (the process's clock is another machine's). Nodes still warming
    are not grown onto. Empty when none joined then: capacity another job gave back is no
    join."""
    held = set(used)
    joined = [
        n
        for n in nodes
        if n.alive
        and not n.draining
        and not n.warming
        and n.node_id not in held
        and n.joined_at is not None
        and n.joined_at > attempt_started
    ]
    if not joined:
        return {}
    first = min(min(n.joined_at for n in joined if n.joined_at is not None), now)
    found = {NODE_JOINED_AT: first}
    warm = [n.warm_at for n in joined if n.warm_at is not None]
    if warm:  # else grown onto before any process there was warm (`grow_warm_wait_s`)
        found[PROCESS_WARM_AT] = min(max(max(warm), first), now)
    return found


def found_dead(
    held: Mapping[str, float], reports: Iterable[DriverReport], alive: Collection[str], now: float
) -> dict[str, float]:
    """The nodes that count as dead before Ray says so, each until when: those of attempts
    that failed because a rank's process died with its node (`ErrorKind.NODE_DIED`: the
    driver found the node's raylet refusing connections), for FOUND_DEAD_HOLD_S, while Ray
    still lists them alive. Counted dead, a node's ranks are lost (no restart counted, for
    every job with a rank there) and nothing is placed on it, so the relaunch need not wait
    for Ray's health checks. Pure."""
    out = {node: until for node, until in held.items() if until > now and node in alive}
    for report in reports:
        error = report.error
        if report.status != DriverStatus.FAILED or error is None:
            continue
        if error.kind == ErrorKind.NODE_DIED and error.node_id and error.node_id in alive:
            out.setdefault(error.node_id, now + FOUND_DEAD_HOLD_S)
    return out
