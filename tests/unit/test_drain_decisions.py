"""Drains in the lifecycle table (`elastrain.service.decisions._on_drain`), row by row, and the
pure pieces around them: draining capacity, merging the operators' drains with Ray's.

A job with ranks on a draining node leaves it at a step boundary when min_workers fit
elsewhere (no checkpoint, no failure, no restart); otherwise it checkpoints, trains on
there and stops with a checkpoint at the deadline. Pure: no DB, no Ray, no clock.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest

from elastrain.contracts.messages import Control, DriverStatus, EventKind
from elastrain.service import drains
from elastrain.service.admission import plan_admissions
from elastrain.service.capacity import ClusterCapacity, DrainSource, NodeCapacity, NodeDrain
from elastrain.service.decisions import (
    Action,
    AttemptOutcome,
    EndAttempt,
    MarkSpare,
    RecordEvent,
    SendControl,
    SetReason,
    StartAttempt,
    StartWaiting,
    Transition,
    decide,
    draining_ranks,
)
from elastrain.service.states import ALLOWED, JobState
from tests.unit.test_decisions import (
    MIN2,
    NOW,
    between_attempts,
    facts,
    job,
    report,
    running_attempt,
)

S = JobState


def cluster(*alive: str, draining: tuple[str, ...] = ()) -> ClusterCapacity:
    """One CPU per node; the `draining` ones are alive but hold no new worker."""
    return ClusterCapacity(
        nodes=tuple(NodeCapacity(node_id=n, cpus=1) for n in alive)
        + tuple(NodeCapacity(node_id=n, cpus=1, draining=True) for n in draining)
    )


def drain(node: str, deadline: float | None = None) -> dict[str, NodeDrain]:
    return {node: NodeDrain(node_id=node, reason="maintenance", deadline=deadline)}


def b_draining_event(step: int = 30, deadline: float | None = None) -> RecordEvent:
    return RecordEvent(
        kind=EventKind.NODE_DRAINING,
        reason=f"node b draining (ranks [1]): leaving it after step {step}",
        details={
            "node_id": "b",
            "ranks": [1],
            "step": step,
            "source": "admin",
            "reason": "maintenance",
            "deadline": deadline,
        },
    )


WAITING_B = "waiting: node b draining, needs 2 workers, 1 fit"

ROWS: list[Any] = [
    pytest.param(
        job(S.RUNNING),
        facts(
            cluster("a", "c", draining=("b",)),
            alive=("a", "b", "c"),
            report=report(),
            draining=drain("b"),
        ),
        [
            b_draining_event(),
            SendControl(control=Control.LEAVE),
            Transition(
                to=S.RESIZING, reason="node b draining: leaving it, 2 -> 2 workers", world_size=2
            ),
            MarkSpare(since=None),
        ],
        id="running+node-draining+room-elsewhere: leaves at the same size",
    ),
    pytest.param(
        job(S.RUNNING),
        facts(
            cluster("a", draining=("b",)),
            alive=("a", "b"),
            report=report(),
            draining=drain("b", NOW + 60),
        ),
        [
            b_draining_event(deadline=NOW + 60),
            SendControl(control=Control.LEAVE),
            Transition(
                to=S.RESIZING, reason="node b draining: leaving it, 2 -> 1 workers", world_size=1
            ),
            MarkSpare(since=None),
        ],
        id="running+node-draining: shrinks off it, no checkpoint",
    ),
    pytest.param(
        job(S.RUNNING, spec=MIN2),
        facts(
            cluster("a", draining=("b",)),
            alive=("a", "b"),
            report=report(),
            draining=drain("b", NOW + 60),
        ),
        [
            SendControl(control=Control.CHECKPOINT, why="checkpoint now (node b draining)"),
            SetReason(
                reason=f"{WAITING_B} (stops with a checkpoint at the drain deadline)",
            ),
        ],
        id="running-at-min+node-draining: checkpoints first, trains on",
    ),
    pytest.param(
        job(
            S.RUNNING,
            spec=MIN2,
            state_reason=f"{WAITING_B} (stops with a checkpoint at the drain deadline)",
        ),
        facts(
            cluster("a", "c", draining=("b",)),
            alive=("a", "b"),
            report=report(),
            draining=drain("b", NOW + 60),
        ),
        [
            b_draining_event(deadline=NOW + 60),
            SendControl(control=Control.LEAVE),
            Transition(
                to=S.RESIZING, reason="node b draining: leaving it, 2 -> 2 workers", world_size=2
            ),
            MarkSpare(since=None),
        ],
        id="running-at-min+node-draining+a-node-joins: leaves",
    ),
    pytest.param(
        job(
            S.RUNNING,
            spec=MIN2,
            state_reason=f"{WAITING_B} (stops with a checkpoint at the drain deadline)",
        ),
        facts(
            cluster("a", draining=("b",)),
            alive=("a", "b"),
            report=report(),
            draining=drain("b", NOW + 60),
        ),
        [],
        id="running-at-min+node-draining+checkpointed: waits, no growth",
    ),
    pytest.param(
        job(S.RUNNING, spec=MIN2, state_reason=f"{WAITING_B} (runs on there)"),
        facts(
            cluster("a", draining=("b",)), alive=("a", "b"), report=report(), draining=drain("b")
        ),
        [],
        id="running-at-min+node-draining-without-deadline: runs on until undrain",
    ),
    pytest.param(
        job(S.RUNNING, spec=MIN2),
        facts(
            cluster("a", draining=("b",)),
            alive=("a", "b"),
            report=report(),
            draining=drain("b", NOW - 1),
        ),
        [
            SendControl(control=Control.STOP),
            Transition(
                to=S.RESIZING,
                reason="node b drain deadline passed: checkpointing and stopping "
                "(needs 2 workers, 1 fit elsewhere)",
            ),
        ],
        id="running-at-min+drain-deadline-passed: stops with a checkpoint",
    ),
    pytest.param(
        job(S.RESIZING, attempt=running_attempt(stop_requested=True)),
        facts(
            cluster("a", draining=("b",)), alive=("a", "b"), report=report(), draining=drain("b")
        ),
        [SendControl(control=Control.LEAVE)],
        id="resizing+leave-never-arrived: asked again to leave",
    ),
    pytest.param(
        job(S.RESIZING, attempt=running_attempt(stop_requested=True)),
        facts(
            cluster("a", draining=("b",)),
            alive=("a", "b"),
            report=report(stopping=True),
            draining=drain("b"),
        ),
        [],
        id="resizing+leaving: trains on to the step boundary",
    ),
    pytest.param(
        job(S.RESIZING, attempt=running_attempt(stop_requested=True)),
        facts(
            cluster("a", draining=("b",)),
            alive=("a", "b"),
            report=report(DriverStatus.STOPPED, stopping=True),
            draining=drain("b"),
        ),
        [
            EndAttempt(outcome=AttemptOutcome.STOPPED, step=30),
            StartAttempt(world_size=1, avoid_nodes=("b",)),
            MarkSpare(since=None),
        ],
        id="resizing+left: relaunched off the draining node, no restart counted",
    ),
    pytest.param(
        between_attempts(S.RESIZING, spec=MIN2),
        facts(cluster("a", draining=("b",)), alive=("a", "b"), draining=drain("b")),
        [
            StartWaiting(
                reason="waiting below min: 1 workers fit, the job needs 2 (draining: node b)",
                at=NOW,
            )
        ],
        id="resizing-at-min+stopped: waits below min, saying why",
    ),
    pytest.param(
        job(S.RESIZING, attempt=running_attempt(2, on=("a", "b", "c"))),
        facts(
            cluster("a", "b", draining=("c",)),
            alive=("a", "b", "c"),
            report=report(),
            draining=drain("c"),
        ),
        [Transition(to=S.RUNNING, reason="training started at world size 3", world_size=3)],
        id="grown-attempt-on-a-node-drained-meanwhile: runs first, leaves next pass",
    ),
    pytest.param(
        job(S.RUNNING, spec=MIN2, state_reason=f"{WAITING_B} (runs on there)"),
        facts(cluster("a", "b"), alive=("a", "b"), report=report()),
        [SetReason(reason="drain over: training on at world size 2")],
        id="running-at-min+undrained: says so",
    ),
    pytest.param(
        job(S.RUNNING, attempt=running_attempt(stop_requested=True)),
        facts(
            cluster("a", draining=("b",)), alive=("a", "b"), report=report(), draining=drain("b")
        ),
        [],
        id="running+stop-requested-already: not asked twice",
    ),
]


@pytest.mark.parametrize(("view", "observed", "expected"), ROWS)
def test_drain_table(view: Any, observed: Any, expected: list[Action]) -> None:
    assert decide(view, observed) == expected


def test_drain_rows_take_only_allowed_transitions() -> None:
    for row in ROWS:
        view, observed, _ = row.values
        for action in decide(view, observed):
            if isinstance(action, Transition):
                assert action.to in ALLOWED[view.state], (view.state, action)


def test_a_drain_counts_no_restart_and_no_failure() -> None:
    """Leave, stop, relaunch: no action of the whole drain counts a restart or a failure."""
    view = job(S.RUNNING)
    seen = facts(cluster("a", draining=("b",)), alive=("a", "b"), report=report(),
                 draining=drain("b"))  # fmt: skip
    left = replace(view, state=S.RESIZING, attempt=running_attempt(stop_requested=True))
    stopped = replace(seen, report=report(DriverStatus.STOPPED, stopping=True))
    for actions in (decide(view, seen), decide(left, stopped)):
        for action in actions:
            assert not (isinstance(action, EndAttempt) and action.count_restart), action
            assert not (isinstance(action, EndAttempt) and action.error is not None), action


def test_draining_nodes_hold_no_new_worker_but_their_ranks_are_alive() -> None:
    capacity = cluster("a", "b", draining=("c",))
    assert capacity.workers_that_fit(1, 0) == 2
    assert capacity.alive_ids() == {"a", "b", "c"}
    admitted, _ = plan_admissions([job(S.PENDING, spec=MIN2)], capacity, capacity)
    assert [a.world_size for a in admitted] == [2]
    assert draining_ranks(("a", "c", "c"), drain("c")) == {"c": [1, 2]}


def test_operators_drains_merge_with_rays() -> None:
    ray_reported = NodeDrain(node_id="b", reason="ray", deadline=NOW + 30, source=DrainSource.RAY)
    capacity = replace(
        cluster("a", "b", "c"), drains=(ray_reported,)
    )  # as the runtime client reads it
    admin = [
        NodeDrain(node_id="b", reason="maintenance", deadline=NOW + 90),
        NodeDrain(node_id="c", reason="disk"),
        NodeDrain(node_id="gone", reason="left the cluster"),
    ]
    marked, merged = drains.effective(capacity, admin)
    assert set(merged) == {"b", "c"}  # a node no longer alive drains nothing
    # The operator's reason, the earlier deadline.
    assert merged["b"] == NodeDrain(node_id="b", reason="maintenance", deadline=NOW + 30)
    assert marked.workers_that_fit(1, 0) == 1
    assert [n.node_id for n in marked.nodes if n.draining] == ["b", "c"]
    ray_only, merged = drains.effective(capacity, [])
    assert merged == {"b": ray_reported}
    assert [n.node_id for n in ray_only.nodes if n.draining] == ["b"]
    assert drains.effective(cluster("a"), []) == (cluster("a"), {})


@pytest.mark.parametrize(
    ("given", "expected"),
    [
        ("b1" * 28, "b1" * 28),
        ("b1b1b1", "b1" * 28),  # a unique prefix, as `elastrain cluster` shows
        ("b1b1", []),  # too short to name a node
        ("ffffff", []),
        ("aaaaaa", ["aaaaaa01", "aaaaaa02"]),
    ],
)
def test_resolve_a_node_name(given: str, expected: str | list[str]) -> None:
    known = ["b1" * 28, "aaaaaa01", "aaaaaa02"]
    assert drains.resolve(given, known) == expected
