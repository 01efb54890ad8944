"""`elastrain.service.admission.plan_admissions`: fair between tenants, priority within one, backfill,
and a reservation so that no job waits forever. Pure: no database, no Ray."""

from __future__ import annotations

import math
from typing import Any

import pytest

from elastrain.service.admission import Usage, dominant_share, plan_admissions
from elastrain.service.capacity import (
    Allocation,
    ClusterCapacity,
    NodeCapacity,
    WorkerShape,
    free_capacity,
)
from elastrain.service.decisions import JobView
from elastrain.service.states import JobState
from tests.unit.test_decisions import nodes, spec


def queued(
    job_id: int,
    owner: str = "a",
    *,
    priority: int = 0,
    min_workers: int = 1,
    max_workers: int = 1,
    at: float = 0.0,
    **scaling: Any,
) -> JobView:
    return JobView(
        id=job_id,
        state=JobState.PENDING,
        owner=owner,
        submitted_at=at if at else float(job_id),
        spec=spec(
            priority=priority,
            scaling={"min_workers": min_workers, "max_workers": max_workers, **scaling},
        ),
    )


def taken(cluster: ClusterCapacity, workers: int) -> ClusterCapacity:
    """`cluster` with `workers` one-CPU workers running."""
    shape = WorkerShape(cpus=1, gpus=0)
    return free_capacity(cluster, [Allocation(shape=shape, count=workers)])


def started(admitted: list[Any]) -> list[tuple[int, int]]:
    return [(a.job_id, a.world_size) for a in admitted]


THREE = nodes("a", "b", "c")


def test_gang_admission_and_jobs_that_never_fit() -> None:
    queue = [
        queued(1, min_workers=2, max_workers=2),
        queued(2, priority=5, min_workers=2, max_workers=3),  # first: higher priority
        queued(3, min_workers=9, max_workers=9),  # never fits: does not block
        queued(4),
    ]
    admitted, waiting = plan_admissions(queue, THREE, THREE)
    assert started(admitted) == [(2, 3)]
    reasons = {w.job_id: w.reason for w in waiting}
    assert reasons[1] == "waiting for 2 free workers"
    assert reasons[3].endswith("the whole cluster holds 3")
    assert reasons[4] == "waiting for 1 free workers"


def test_small_jobs_backfill_while_a_large_one_waits() -> None:
    one_free = taken(THREE, 2)
    queue = [queued(1, min_workers=2, max_workers=2), queued(2), queued(3, "b")]
    admitted, waiting = plan_admissions(queue, one_free, THREE)
    assert started(admitted) == [(2, 1)]  # tenant a's small job: b's waits for the next
    assert {w.job_id: w.reason for w in waiting}[1] == "waiting for 2 free workers"


def test_priority_orders_a_tenants_own_jobs_only() -> None:
    one_free = taken(THREE, 2)
    queue = [
        queued(1, "a", priority=5, min_workers=2, max_workers=2),  # waits for room
        queued(2, "a"),  # lower priority, same tenant: stays behind job 1
        queued(3, "b"),  # another tenant's priority 0 is not below a's priority 5
    ]
    admitted, waiting = plan_admissions(queue, one_free, THREE)
    assert started(admitted) == [(3, 1)]
    assert {w.job_id: w.reason for w in waiting}[2] == (
        "queued behind job 1 (priority 5) of tenant a"
    )


@pytest.mark.parametrize(
    ("usage", "first"),
    [
        # tenant -> what it holds; whose job gets the one free worker
        ({}, 1),  # equal shares: the older head job
        ({"a": Usage(cpus=2)}, 2),  # a holds more: b first, though a is older and priority 9
        ({"b": Usage(cpus=1)}, 1),
        ({"a": Usage(cpus=1), "b": Usage(cpus=1)}, 1),
        # dominant share: a holds 1 of 2 GPUs (50 %), b 2 of 8 CPUs (25 %): b first
        ({"a": Usage(gpus=1), "b": Usage(cpus=2)}, 2),
    ],
)
def test_between_tenants_the_smaller_dominant_share_goes_first(
    usage: dict[str, Usage], first: int
) -> None:
    cluster = ClusterCapacity(
        nodes=(NodeCapacity(node_id="g", cpus=4, gpus=2), NodeCapacity(node_id="c", cpus=4))
    )
    one_free = ClusterCapacity(nodes=(NodeCapacity(node_id="g", cpus=1),))
    queue = [queued(1, "a", priority=9), queued(2, "b")]
    admitted, waiting = plan_admissions(queue, one_free, cluster, usage=usage)
    assert started(admitted) == [(first, 1)]
    assert [w.reason for w in waiting] == ["waiting for 1 free workers"]


def test_dominant_share() -> None:
    cluster = ClusterCapacity(nodes=(NodeCapacity(node_id="g", cpus=8, gpus=2),))
    assert dominant_share(Usage(cpus=2, gpus=1), cluster) == 0.5
    assert dominant_share(Usage(cpus=4), cluster) == 0.5
    assert dominant_share(Usage(), ClusterCapacity()) == 0.0


@pytest.mark.parametrize(
    ("quota_left", "expected", "why"),
    [
        # (tenant -> workers its quota has left) -> (job, size) admitted, reason of job 1
        ({}, [(1, 3)], None),
        ({"a": 2}, [(1, 2), (2, 1)], None),  # capped by the quota, not by the cluster
        ({"a": 1}, [(2, 3)], "tenant a's quota: 1 more workers allowed, the job needs 2"),
        ({"a": 0, "b": 1}, [(2, 1)], "tenant a's quota: 0 more workers allowed, the job needs 2"),
    ],
)
def test_within_tenant_quotas(
    quota_left: dict[str, int], expected: list[tuple[int, int]], why: str | None
) -> None:
    queue = [
        queued(1, "a", min_workers=2, max_workers=3),
        queued(2, "b", min_workers=1, max_workers=3),
    ]
    admitted, waiting = plan_admissions(queue, THREE, THREE, quota_left)
    assert started(admitted) == expected
    assert {w.job_id: w.reason for w in waiting}.get(1) == why


@pytest.mark.parametrize(
    ("now", "expected", "why_2"),
    [
        (100.0, [(2, 1)], None),  # not waited long: the small job backfills
        (400.0, [], "queued behind job 1, which has waited longest and holds the reservation"),
    ],
)
def test_a_job_waiting_long_holds_a_reservation(
    now: float, expected: list[tuple[int, int]], why_2: str | None
) -> None:
    one_free = taken(THREE, 2)
    queue = [queued(1, "a", min_workers=3, max_workers=3, at=1.0), queued(2, "b", at=50.0)]
    admitted, waiting = plan_admissions(queue, one_free, THREE, now=now, reserve_after_s=300)
    assert started(admitted) == expected
    reasons = {w.job_id: w.reason for w in waiting}
    assert reasons[1] == "waiting for 3 free workers"
    assert reasons.get(2) == why_2


def test_a_reservation_leaves_capacity_it_cannot_use_to_others() -> None:
    """A job waiting for GPUs does not stop CPU-only work on what it could not use."""
    cluster = ClusterCapacity(
        nodes=(NodeCapacity(node_id="c", cpus=2), NodeCapacity(node_id="g", cpus=3, gpus=2))
    )
    gpu_held = free_capacity(cluster, [Allocation(shape=WorkerShape(cpus=1, gpus=1), count=1)])
    gpu_job = queued(1, "a", min_workers=2, max_workers=2, use_gpu=True, gpus_per_worker=1)
    cpu_jobs = [queued(i, "b", at=500.0 + i) for i in range(2, 7)]
    admitted, waiting = plan_admissions(
        [gpu_job, *cpu_jobs], gpu_held, cluster, now=1000.0, reserve_after_s=300
    )
    # Node c's 2 CPUs and one of g's backfill; g keeps 1 CPU beside its free GPU for job 1.
    assert started(admitted) == [(2, 1), (3, 1), (4, 1)]
    reasons = {w.job_id: w.reason for w in waiting}
    assert reasons[1] == "waiting for 2 free workers"
    assert "holds the reservation" in reasons[5]


@pytest.mark.parametrize(("reserve_after_s", "starts"), [(30.0, True), (math.inf, False)])
def test_no_job_waits_forever_behind_another_tenants_stream(
    reserve_after_s: float, starts: bool
) -> None:
    """Tenant b holds the cluster and keeps a stream of one-worker jobs queued, each running
    3 passes (one worker frees every pass); tenant a's job needs the whole cluster. With the reservation it starts soon after waiting
    `reserve_after_s`; without one (infinity), backfill starves it (the check can fail)."""
    big = queued(1, "a", min_workers=3, max_workers=3, at=0.0)
    running = {-1: 1, -2: 2, -3: 3}  # job id -> the pass it ends: b holds the cluster, staggered
    queue = [big]
    next_id = 2
    started_at = None
    for tick in range(200):  # one pass a second
        running = {j: end for j, end in running.items() if end > tick}
        while sum(1 for job in queue if job.owner == "b") < 3:
            queue.append(queued(next_id, "b", at=float(tick) + 0.5))
            next_id += 1
        free = taken(THREE, len(running))
        usage = {"b": Usage(cpus=float(len(running)))}
        admitted, _ = plan_admissions(
            queue, free, THREE, usage=usage, now=float(tick), reserve_after_s=reserve_after_s
        )
        ids = {a.job_id for a in admitted}
        if big.id in ids:
            started_at = tick
            break
        running.update({j: tick + 3 for j in ids})
        queue = [job for job in queue if job.id not in ids]
    if starts:
        assert started_at is not None and started_at <= 30 + 3
    else:
        assert started_at is None
