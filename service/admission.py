"""Which queued jobs start this pass: fair between tenants, by priority within one. Pure.

The rule, in the order it applies:

1. **A tenant's quota is a hard cap** (`max_workers`): a job its quota cannot hold waits
   and blocks nobody.
2. **Between tenants, dominant-resource fair share** (DRF, Ghodsi et al., NSDI '11): the
   next job considered is always the head of the tenant whose *dominant share* is
   smallest, the larger of the fractions of the cluster's CPUs and GPUs its running (and
   just admitted) jobs hold. A tenant that holds little goes first; one that holds most of
   the cluster gets what is left. Ties go to the tenant whose head job is older.
3. **Within a tenant, priority then age**: `priority` orders a tenant's own jobs only (it
   never puts one tenant ahead of another), and a job never starts while a job of its own
   tenant with a higher priority waits for capacity.
4. **Backfill**: a job that does not fit does not stop the others; smaller jobs (of any
   tenant, and of its own tenant at the same priority) start on what is free meanwhile.
5. **No job waits forever**: a job queued for `reserve_after_s` or more (the oldest such,
   one at a time) holds a *reservation*: it is considered first, and while it does not fit,
   nothing else starts on capacity it could use (a job starts only if the reserved job's
   count of fitting workers stays the same, e.g. CPU-only work on nodes whose GPUs it
   waits for). Capacity that running jobs give back then goes to it, whoever's it is.

Gang admission is kept: a job starts only when `min_workers` fit, at the largest world
size that fits (up to max and within its quota). A job that could not fit even on the
whole (empty) cluster waits with that reason and blocks nobody.
"""

from __future__ import annotations

import heapq
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from elastrain.service.capacity import (
    Allocation,
    ClusterCapacity,
    WorkerShape,
    free_capacity,
    target_world_size,
)
from elastrain.service.decisions import JobView

#: Default: a job queued this long gets a reservation (capacity is held for it).
RESERVE_AFTER_S = 300.0


@dataclass(frozen=True, kw_only=True, slots=True)
class Admission:
    job_id: int
    world_size: int


@dataclass(frozen=True, kw_only=True, slots=True)
class Waiting:
    job_id: int
    reason: str


@dataclass(frozen=True, kw_only=True, slots=True)
class Usage:
    """What a tenant's live jobs hold."""

    cpus: float = 0.0
    gpus: float = 0.0

    def plus(self, shape: WorkerShape, workers: int) -> Usage:
        return Usage(cpus=self.cpus + shape.cpus * workers, gpus=self.gpus + shape.gpus * workers)


def dominant_share(usage: Usage, total: ClusterCapacity) -> float:
    """The larger of the tenant's fractions of the cluster's CPUs and GPUs."""
    cpus = sum(n.cpus for n in total.alive_nodes)
    gpus = sum(n.gpus for n in total.alive_nodes)
    return max(usage.cpus / cpus if cpus > 0 else 0.0, usage.gpus / gpus if gpus > 0 else 0.0)


def plan_admissions(
    pending: Sequence[JobView],
    free: ClusterCapacity,
    total: ClusterCapacity,
    quota_left: Mapping[str, int | None] | None = None,
    *,
    usage: Mapping[str, Usage] | None = None,
    now: float = 0.0,
    reserve_after_s: float = RESERVE_AFTER_S,
) -> tuple[list[Admission], list[Waiting]]:
    """The admissions of one pass, and why each other queued job waits.

    `pending` is oldest first; `quota_left`: tenant -> workers its quota still allows (a
    tenant not in it has no quota); `usage`: tenant -> what its live jobs hold."""
    plan = _Plan(free, total, dict(quota_left or {}), dict(usage or {}))
    reserved = _reservation(pending, total, plan.left, now=now, after_s=reserve_after_s)
    if reserved is not None:
        plan.consider(reserved)
        if not plan.admitted(reserved.id):
            plan.reserved = reserved
    queues: dict[str, deque[JobView]] = {}
    for job in sorted(pending, key=lambda j: -j.spec.priority):  # stable: oldest first
        if job is not reserved:
            queues.setdefault(job.owner, deque()).append(job)
    order = [(plan.share(t), q[0].submitted_at, q[0].id, t) for t, q in queues.items()]
    heapq.heapify(order)
    while order:
        _, _, _, tenant = heapq.heappop(order)
        queue = queues[tenant]
        plan.consider(queue.popleft())
        if queue:
            heapq.heappush(order, (plan.share(tenant), queue[0].submitted_at, queue[0].id, tenant))
    return plan.admissions, plan.waiting


def _reservation(
    pending: Sequence[JobView],
    total: ClusterCapacity,
    quota_left: Mapping[str, int | None],
    *,
    now: float,
    after_s: float,
) -> JobView | None:
    """The job that has waited longest, once that is `after_s` or more, among those the
    whole cluster and their quota could hold."""
    for job in sorted(pending, key=lambda j: (j.submitted_at, j.id)):
        if now - job.submitted_at < after_s:
            return None
        limit = quota_left.get(job.owner)
        if (limit is None or limit >= job.spec.min_world_size) and target_world_size(
            job.spec, total
        ):
            return job
    return None


class _Plan:
    """The pass's admissions so far, and what they leave."""

    def __init__(
        self,
        free: ClusterCapacity,
        total: ClusterCapacity,
        left: dict[str, int | None],
        usage: dict[str, Usage],
    ) -> None:
        self.free = free
        self.total = total
        self.left = left
        self.usage = usage
        self.reserved: JobView | None = None
        #: tenant -> the highest priority of its jobs waiting for capacity (and one of them).
        self.blocked: dict[str, tuple[int, int]] = {}
        self.admissions: list[Admission] = []
        self.waiting: list[Waiting] = []
        self._admitted: set[int] = set()

    def share(self, tenant: str) -> float:
        return dominant_share(self.usage.get(tenant, Usage()), self.total)

    def admitted(self, job_id: int) -> bool:
        return job_id in self._admitted

    def consider(self, job: JobView) -> None:
        reason = self._why_not(job)
        if reason is None:
            return
        self.waiting.append(Waiting(job_id=job.id, reason=reason))

    def _why_not(self, job: JobView) -> str | None:
        """Admit the job if it may start now; otherwise why it waits."""
        shape = WorkerShape.of(job.spec)
        need = job.spec.min_world_size
        limit = self.left.get(job.owner)
        if limit is not None and limit < need:
            return f"tenant {job.owner}'s quota: {limit} more workers allowed, the job needs {need}"
        if target_world_size(job.spec, self.total) == 0:
            whole = self.total.workers_that_fit(shape.cpus, shape.gpus)
            return (
                f"needs {need} workers of {shape.cpus:g} CPU/{shape.gpus:g} GPU; "
                f"the whole cluster holds {whole}"
            )
        ahead = self.blocked.get(job.owner)
        if ahead is not None and ahead[0] > job.spec.priority:
            return f"queued behind job {ahead[1]} (priority {ahead[0]}) of tenant {job.owner}"
        size = target_world_size(job.spec, self.free, limit=limit)
        if size == 0:
            if ahead is None or ahead[0] < job.spec.priority:
                self.blocked[job.owner] = (job.spec.priority, job.id)
            return f"waiting for {need} free workers"
        after = free_capacity(self.free, [Allocation(shape=shape, count=size)])
        if (held := self.reserved) is not None and _takes_from(held, self.free, after):
            return (
                f"queued behind job {held.id}, which has waited longest and holds the reservation"
            )
        self.admissions.append(Admission(job_id=job.id, world_size=size))
        self._admitted.add(job.id)
        self.free = after
        if limit is not None:
            self.left[job.owner] = limit - size
        self.usage[job.owner] = self.usage.get(job.owner, Usage()).plus(shape, size)
        return None


def _takes_from(reserved: JobView, before: ClusterCapacity, after: ClusterCapacity) -> bool:
    """Would going from `before` to `after` leave fewer workers of the reserved job's shape?"""
    shape = WorkerShape.of(reserved.spec)
    return after.workers_that_fit(shape.cpus, shape.gpus) < before.workers_that_fit(
        shape.cpus, shape.gpus
    )
