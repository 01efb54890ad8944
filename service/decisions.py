"""The scheduler's decisions as pure functions: admission, failure handling, growth.

No I/O here: the scheduler gathers facts (DB rows, cluster capacity, driver reports),
calls these, and carries out what they return. Tests call them directly.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from enum import Enum

from service.launcher.base import ClusterCapacity, NodeCapacity
from service.spec import JobSpec


@dataclass(frozen=True, kw_only=True)
class WorkerShape:
    cpus: float
    gpus: float

    @classmethod
    def of(cls, spec: JobSpec) -> WorkerShape:
        return cls(cpus=spec.scaling.cpus_per_worker, gpus=spec.scaling.gpus_per_worker)


@dataclass(frozen=True, kw_only=True)
class Allocation:
    """Workers a live attempt holds. `nodes` lists the node of each placed worker; workers
    not yet placed by Ray are charged first-fit, as Ray's PACK placement would."""

    shape: WorkerShape
    count: int
    nodes: tuple[str, ...] = ()


def free_capacity(cluster: ClusterCapacity, allocations: Sequence[Allocation]) -> ClusterCapacity:
    """What is left of the alive nodes after the allocations of live attempts."""
    free = {n.node_id: n for n in cluster.alive_nodes}

    def charge(node_id: str, shape: WorkerShape) -> None:
        node = free[node_id]
        free[node_id] = replace(node, cpus=node.cpus - shape.cpus, gpus=node.gpus - shape.gpus)

    unplaced: list[WorkerShape] = []
    for alloc in allocations:
        placed = [n for n in alloc.nodes if n in free]
        for node_id in placed:
            charge(node_id, alloc.shape)
        # Workers on dead nodes hold nothing; unknown placements are charged first-fit.
        if not alloc.nodes:
            unplaced.extend([alloc.shape] * alloc.count)
    for shape in unplaced:
        for node_id, node in free.items():
            if node.cpus + 1e-9 >= shape.cpus and node.gpus + 1e-9 >= shape.gpus:
                charge(node_id, shape)
                break
    return replace(cluster, nodes=tuple(free.values()))


def take_workers(cluster: ClusterCapacity, shape: WorkerShape, count: int) -> ClusterCapacity:
    return free_capacity(cluster, [Allocation(shape=shape, count=count)])


# -- admission ----------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class PendingJob:
    job_id: int
    priority: int
    spec: JobSpec


@dataclass(frozen=True, kw_only=True)
class Admission:
    job_id: int
    world_size: int


@dataclass(frozen=True, kw_only=True)
class Waiting:
    job_id: int
    reason: str


def plan_admissions(
    pending: Sequence[PendingJob], free: ClusterCapacity, total: ClusterCapacity
) -> tuple[list[Admission], list[Waiting]]:
    """Gang admission by priority, then age (`pending` is oldest first).

    A job starts only when `min_workers` fit, at the largest world size that fits (up to
    max). No backfill: when the first job in line does not fit, the ones behind it wait
    too, so a large high-priority job is never starved by a stream of small ones. A job
    that could not fit even on the whole (empty) cluster does not block the line.
    """
    order = sorted(pending, key=lambda p: -p.priority)  # stable: oldest first within a priority
    admissions: list[Admission] = []
    waiting: list[Waiting] = []
    blocked_by: int | None = None
    for job in order:
        shape = WorkerShape.of(job.spec)
        need = job.spec.min_world_size
        if job.spec.usable_world_size(total.workers_that_fit(shape.cpus, shape.gpus)) == 0:
            waiting.append(
                Waiting(
                    job_id=job.job_id,
                    reason=f"needs {need} workers of {shape.cpus:g} CPU/{shape.gpus:g} GPU; "
                    f"the whole cluster holds {total.workers_that_fit(shape.cpus, shape.gpus)}",
                )
            )
            continue
        if blocked_by is not None:
            waiting.append(Waiting(job_id=job.job_id, reason=f"queued behind job {blocked_by}"))
            continue
        size = job.spec.usable_world_size(free.workers_that_fit(shape.cpus, shape.gpus))
        if size == 0:
            blocked_by = job.job_id
            waiting.append(Waiting(job_id=job.job_id, reason=f"waiting for {need} free workers"))
            continue
        admissions.append(Admission(job_id=job.job_id, world_size=size))
        free = take_workers(free, shape, size)
    return admissions, waiting


# -- failures -----------------------------------------------------------------------------


class FailureCause(str, Enum):
    NODE_LOST = "node_lost"  # infrastructure: does not count against max_restarts
    WORKER_ERROR = "worker_error"  # the training code raised, or a worker process died
    DRIVER_LOST = "driver_lost"  # the driver actor vanished (its node died)


class FailureAction(str, Enum):
    RETRY = "retry"
    GIVE_UP = "give_up"


@dataclass(frozen=True, kw_only=True)
class FailureDecision:
    action: FailureAction
    reason: str
    delay_s: float = 0.0
    counts_as_restart: bool = False


#: The same error at the same step this many times in a row fails the job: a restart
#: would only repeat it.
REPEATED_FAILURE_LIMIT = 3


def decide_failure(
    *,
    cause: FailureCause,
    error: str | None,
    step: int,
    restarts: int,
    max_restarts: int,
    recent_failures: Sequence[tuple[str | None, int]],
    backoff_s: float,
) -> FailureDecision:
    """After an attempt ended badly: retry (after a backoff) or give up.

    `recent_failures` are (error, step) of the previous failed attempts, newest last.
    """
    if cause == FailureCause.NODE_LOST:
        return FailureDecision(action=FailureAction.RETRY, reason="node lost")
    streak = 1
    for prev_error, prev_step in reversed(recent_failures):
        if prev_error == error and prev_step == step:
            streak += 1
        else:
            break
    if streak >= REPEATED_FAILURE_LIMIT:
        return FailureDecision(
            action=FailureAction.GIVE_UP,
            reason=f"the same error at step {step} {streak} times in a row: {error}",
        )
    if restarts >= max_restarts:
        return FailureDecision(
            action=FailureAction.GIVE_UP,
            reason=f"gave up after {restarts} restarts (failure.max_restarts): {error}",
        )
    # Exponential backoff, capped: a crash loop must not hammer the cluster.
    delay = min(backoff_s * (2 ** max(streak - 1, 0)), 60.0)
    return FailureDecision(
        action=FailureAction.RETRY,
        reason=error or cause.value,
        delay_s=delay,
        counts_as_restart=True,
    )


# -- growth -------------------------------------------------------------------------------


def target_world_size(spec: JobSpec, free: ClusterCapacity, held: int) -> int:
    """The world size the job could run at if it gave back its `held` workers and took
    what is free as well."""
    shape = WorkerShape.of(spec)
    return spec.usable_world_size(free.workers_that_fit(shape.cpus, shape.gpus) + held)


def should_grow(
    *,
    current: int,
    possible: int,
    spare_since: float | None,
    now: float,
    grow_interval_s: float,
    others_waiting: bool,
) -> bool:
    """Grow when a bigger world size has been possible for `grow_interval_s` (capacity that
    flickers back for a moment is not worth a checkpoint and relaunch) and no queued job is
    waiting for that capacity."""
    if possible <= current or others_waiting or spare_since is None:
        return False
    return now - spare_since >= grow_interval_s


def placement_nodes(placement: dict[int, str]) -> tuple[str, ...]:
    return tuple(placement[r] for r in sorted(placement))


def lost_ranks(placement: dict[int, str], alive: set[str]) -> dict[str, list[int]]:
    """node id -> ranks of this attempt that were on it, for nodes no longer alive."""
    lost: dict[str, list[int]] = {}
    for rank, node in sorted(placement.items()):
        if node not in alive:
            lost.setdefault(node, []).append(rank)
    return lost


def capacity_without(cluster: ClusterCapacity, dead: set[str]) -> ClusterCapacity:
    return replace(
        cluster,
        nodes=tuple(
            NodeCapacity(
                node_id=n.node_id, address=n.address, alive=False, cpus=n.cpus, gpus=n.gpus
            )
            if n.node_id in dead
            else n
            for n in cluster.nodes
        ),
    )
