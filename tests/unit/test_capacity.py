"""The capacity ledger's shortcuts give the answers of computing from scratch; nodes still
warming up."""

from __future__ import annotations

import random

import pytest

from elastrain.contracts.messages import DriverReport, DriverStatus, ErrorKind, WorkerError
from elastrain.service.capacity import (
    FOUND_DEAD_HOLD_S,
    NODE_JOINED_AT,
    PROCESS_WARM_AT,
    Allocation,
    CapacityLedger,
    ClusterCapacity,
    NodeCapacity,
    WorkerShape,
    found_dead,
    free_capacity,
    grow_joins,
    warming_nodes,
)

CPU = WorkerShape(cpus=1, gpus=0)
GPU = WorkerShape(cpus=2, gpus=1)


def cluster(n: int, *, dead: int = -1) -> ClusterCapacity:
    return ClusterCapacity(
        nodes=tuple(
            NodeCapacity(node_id=f"n{i}", cpus=4, gpus=2, alive=i != dead) for i in range(n)
        )
    )


def test_free_for_a_placed_job_credits_its_workers_back() -> None:
    rng = random.Random(7)
    nodes = cluster(12, dead=5)
    held = {}
    for job in range(20):
        shape = rng.choice([CPU, GPU])
        placed = tuple(f"n{rng.randrange(12)}" for _ in range(rng.randint(1, 3)))
        held[job] = Allocation(shape=shape, count=len(placed), nodes=placed)
    ledger = CapacityLedger(nodes, held)
    for job in held:
        others = [a for j, a in held.items() if j != job]
        afresh = free_capacity(nodes, others)
        assert ledger.free_for(job) == afresh, job
        for shape in (CPU, GPU):  # counts carried over from the ledger's, and counted anew
            fit = ledger.free_for(job).workers_that_fit(shape.cpus, shape.gpus)
            assert fit == afresh.workers_that_fit(shape.cpus, shape.gpus), (job, shape)
    assert ledger.free_for(999) == ledger.free() == free_capacity(nodes, held.values())


def test_unplaced_workers_are_computed_afresh_and_answers_follow_holds() -> None:
    nodes = cluster(3)
    ledger = CapacityLedger(
        nodes, {1: Allocation(shape=CPU, count=3, nodes=("n0",)), 2: Allocation(shape=CPU, count=2)}
    )
    assert ledger.free_for(1) == free_capacity(nodes, [Allocation(shape=CPU, count=2)])
    before = ledger.free()
    assert before.workers_that_fit(1, 0) == 12 - 5
    ledger.hold(3, Allocation(shape=CPU, count=4, nodes=("n2",) * 4))
    assert ledger.free().workers_that_fit(1, 0) == 12 - 9  # not the cached answer
    ledger.hold(4, None)  # a queued job still holding nothing: nothing changes
    assert ledger.free() is ledger.free()


def test_counts_carried_over_to_a_copy_with_some_nodes_changed() -> None:
    rng = random.Random(11)
    for _ in range(50):
        before = cluster(8, dead=rng.randrange(-1, 8))
        for shape in (CPU, GPU):
            before.workers_that_fit(shape.cpus, shape.gpus)
        changed = [
            NodeCapacity(node_id=f"n{rng.randrange(10)}", cpus=rng.choice([0, 1.5, 3, 8]),
                         gpus=rng.choice([0, 1, 2]), alive=rng.random() < 0.8)
            for _ in range(rng.randint(0, 3))
        ]  # fmt: skip
        after = before.with_resources_of(changed)
        by_id = {n.node_id: n for n in changed}
        afresh = ClusterCapacity(nodes=tuple(by_id.get(n.node_id, n) for n in before.nodes))
        assert after == afresh
        assert after.alive_ids() == afresh.alive_ids()
        for shape in (CPU, GPU):
            assert after.workers_that_fit(shape.cpus, shape.gpus) == afresh.workers_that_fit(
                shape.cpus, shape.gpus
            )


@pytest.mark.parametrize(
    ("ready", "first_seen", "expected"),
    [
        pytest.param(None, {}, set(), id="runtime-has-not-said"),
        pytest.param(frozenset({"a", "b"}), {}, set(), id="all-ready"),
        pytest.param(frozenset({"a"}), {"b": 95.0}, {"b"}, id="new-node-warming"),
        pytest.param(frozenset({"a"}), {}, {"b"}, id="seen-this-pass"),
        pytest.param(frozenset({"a"}), {"b": 30.0}, set(), id="waited-long-enough"),
    ],
)
def test_warming_nodes(
    ready: frozenset[str] | None, first_seen: dict[str, float], expected: set[str]
) -> None:
    got = warming_nodes(["a", "b"], ready, first_seen, now=100.0, wait_s=60.0)
    assert got == expected


def _node(name: str, joined: float | None, warm: float | None, **kw: bool) -> NodeCapacity:
    return NodeCapacity(node_id=name, cpus=1, joined_at=joined, warm_at=warm, **kw)


@pytest.mark.parametrize(
    ("nodes", "expected"),
    [
        pytest.param(
            [_node("a", 10, 12), _node("c", 60, 70)],
            {NODE_JOINED_AT: 60, PROCESS_WARM_AT: 70},
            id="one-node-joined-during-the-attempt",
        ),
        pytest.param(
            [_node("a", 10, 12), _node("c", 20, 25)], {}, id="joined-before-it: capacity given back"
        ),
        pytest.param([_node("a", 60, 70)], {}, id="a-node-it-runs-on-already"),
        pytest.param(
            [_node("c", 60, 70), _node("d", 65, 80)],
            {NODE_JOINED_AT: 60, PROCESS_WARM_AT: 80},
            id="two-joined: the first join, the last warm",
        ),
        pytest.param(
            [_node("c", 60, 70), _node("d", 55, None, warming=True)],
            {NODE_JOINED_AT: 60, PROCESS_WARM_AT: 70},
            id="a-node-still-warming-is-not-grown-onto",
        ),
        pytest.param(
            [
                _node("c", 60, 70),
                _node("d", 55, 58, draining=True),
                _node("e", 50, 52, alive=False),
            ],
            {NODE_JOINED_AT: 60, PROCESS_WARM_AT: 70},
            id="draining-and-dead-nodes-left-out",
        ),
        pytest.param(
            [_node("c", 60, None)], {NODE_JOINED_AT: 60}, id="grown-onto-before-its-process-warmed"
        ),
        pytest.param(
            [_node("c", 60, 55)],
            {NODE_JOINED_AT: 60, PROCESS_WARM_AT: 60},
            id="warm-before-the-join-by-another-clock: clamped",
        ),
        pytest.param(
            [_node("c", 60, 120)],
            {NODE_JOINED_AT: 60, PROCESS_WARM_AT: 100},
            id="warm-after-the-decision-by-another-clock: clamped",
        ),
        pytest.param([_node("c", None, None)], {}, id="join-not-known"),
    ],
)
def test_grow_joins(nodes: list[NodeCapacity], expected: dict[str, float]) -> None:
    # The attempt runs on a and b since t=30; decided at t=100.
    assert grow_joins(nodes, used=["a", "b"], attempt_started=30.0, now=100.0) == expected


def test_warming_nodes_count_for_starts_but_not_for_the_warm_size() -> None:
    capacity = ClusterCapacity(
        nodes=(NodeCapacity(node_id="a", cpus=2), NodeCapacity(node_id="b", cpus=2, warming=True))
    )
    assert capacity.workers_that_fit(1, 0) == 4
    assert capacity.without_warming().workers_that_fit(1, 0) == 2
    assert capacity.without_warming() is capacity.without_warming()  # memoized


def test_the_cluster_view_shows_warming_nodes_while_they_are_alive() -> None:
    from elastrain.service.cluster import snapshot

    capacity = ClusterCapacity(
        nodes=(
            NodeCapacity(node_id="up", cpus=2),
            NodeCapacity(node_id="new", cpus=2, warming=True),
            NodeCapacity(node_id="gone", cpus=2, warming=True, alive=False),
        )
    )
    view = snapshot(capacity, capacity, {})
    assert {n.node_id: n.warming for n in view.nodes} == {"up": False, "new": True, "gone": False}


def _failed(kind: ErrorKind, node: str | None = "n1") -> DriverReport:
    error = WorkerError(type="ConnectionRefusedError", message="died", kind=kind, node_id=node)
    return DriverReport(status=DriverStatus.FAILED, error=error)


T = 100.0
ALIVE = frozenset({"n0", "n1", "n2"})


@pytest.mark.parametrize(
    ("held", "reports", "alive", "expected"),
    [
        ({}, [], ALIVE, {}),
        # a driver found n1's raylet gone: n1 counts as dead from now on, for the hold
        ({}, [_failed(ErrorKind.NODE_DIED)], ALIVE, {"n1": T + FOUND_DEAD_HOLD_S}),
        # a process that died alone, or another failure, says nothing of its node
        ({}, [_failed(ErrorKind.PROCESS_DIED)], ALIVE, {}),
        ({}, [_failed(ErrorKind.NODE_DIED, node=None)], ALIVE, {}),
        ({}, [DriverReport(status=DriverStatus.RUNNING)], ALIVE, {}),
        # Ray already says so: nothing to hold
        ({}, [_failed(ErrorKind.NODE_DIED)], frozenset({"n0"}), {}),
        ({"n1": T + 5}, [], frozenset({"n0"}), {}),
        # held until the hold ends; a second report does not extend it
        ({"n1": T + 5}, [], ALIVE, {"n1": T + 5}),
        ({"n1": T + 5}, [_failed(ErrorKind.NODE_DIED)], ALIVE, {"n1": T + 5}),
        ({"n1": T}, [], ALIVE, {}),
    ],
)  # fmt: skip
def test_a_node_a_driver_found_dead_counts_as_dead_until_ray_says_so(
    held: dict[str, float],
    reports: list[DriverReport],
    alive: frozenset[str],
    expected: dict[str, float],
) -> None:
    assert found_dead(held, reports, alive, T) == expected


def test_a_node_counted_dead_holds_no_capacity_and_its_ranks_are_lost() -> None:
    marked = cluster(3).with_dead({"n1"})
    assert marked.alive_ids() == {"n0", "n2"}
    assert free_capacity(marked, []).workers_that_fit(CPU.cpus, CPU.gpus) == 8
    assert cluster(3).with_dead(set()) == cluster(3)
