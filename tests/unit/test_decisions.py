"""The lifecycle table of `elastrain.service.decisions`: state x facts -> actions, row by row.

Pure: no DB, no Ray, no clock. Each row is a job as the DB has it, what the scheduler
observed, and exactly what `decide` must do. The last test checks that the rows exercise
every edge of `elastrain.service.states.ALLOWED` and no other, so the state table and the decision
table cannot drift apart.
"""

from __future__ import annotations

import copy
import time
from dataclasses import replace
from typing import Any

import pytest

from elastrain.contracts.messages import (
    CheckpointCommitted,
    Control,
    DriverReport,
    DriverStatus,
    ErrorKind,
    EventKind,
    Placement,
    StepMetrics,
    WorkerError,
)
from elastrain.contracts.spec import JobSpec
from elastrain.service.capacity import (
    NODE_JOINED_AT,
    PROCESS_WARM_AT,
    Allocation,
    CapacityLedger,
    ClusterCapacity,
    NodeCapacity,
    WorkerShape,
    free_capacity,
)
from elastrain.service.decisions import (
    GROW_WAIT,
    Action,
    ApplyRetention,
    AttemptOutcome,
    AttemptView,
    DelayRelaunch,
    EndAttempt,
    Facts,
    FailureAction,
    JobView,
    MarkSpare,
    PastFailure,
    PersistReport,
    Policy,
    RecordEvent,
    SendControl,
    SetReason,
    StartAttempt,
    StartWaiting,
    StopWaiting,
    Transition,
    allocation_after,
    decide,
    decide_failure,
    give_up,
    lost_ranks,
    progress,
    should_grow,
)
from elastrain.service.states import ALLOWED, JobState

S = JobState
NOW = 10_000.0
POLICY = Policy(grow_interval_s=10, below_min_timeout_s=60, restart_backoff_s=1)


def spec(**overrides: Any) -> JobSpec:
    body: dict[str, Any] = {
        "name": "t",
        "workload": {"name": "synthetic"},
        "scaling": {"min_workers": 1, "max_workers": 3},
        "failure": {"max_restarts": 2},
    }
    body.update(overrides)
    return JobSpec.model_validate(body)


SPEC = spec()
MIN2 = spec(scaling={"min_workers": 2, "max_workers": 3})


def nodes(
    *alive: str, dead: tuple[str, ...] = (), warming: tuple[str, ...] = ()
) -> ClusterCapacity:
    """One CPU per node: one worker each."""
    return ClusterCapacity(
        nodes=tuple(NodeCapacity(node_id=n, cpus=1, warming=n in warming) for n in alive)
        + tuple(NodeCapacity(node_id=n, cpus=1, alive=False) for n in dead)
    )


def running_attempt(n: int = 1, *, on: tuple[str, ...] = ("a", "b"), **kw: Any) -> AttemptView:
    return AttemptView(number=n, world_size=len(on), nodes=on, **kw)


def job(state: JobState, **kw: Any) -> JobView:
    base: dict[str, Any] = {"id": 1, "state": state, "spec": SPEC, "step": 30}
    if state not in (S.PENDING,):
        base.update(attempt=running_attempt(), world_size=2)
    base.update(kw)
    return JobView(**base)


def between_attempts(state: JobState, **kw: Any) -> JobView:
    """RECOVERING or RESIZING after the attempt ended, before the next one starts."""
    return job(state, attempt=running_attempt(ended=True), **kw)


def facts(
    free: ClusterCapacity | None = None,
    *,
    alive: tuple[str, ...] = ("a", "b"),
    report: DriverReport | None = None,
    **kw: Any,
) -> Facts:
    return Facts(
        now=NOW,
        policy=POLICY,
        alive_nodes=frozenset(alive),
        free=free if free is not None else nodes("a", "b"),
        report=report,
        **kw,
    )


def report(status: DriverStatus = DriverStatus.RUNNING, **kw: Any) -> DriverReport:
    return DriverReport(status=status, **kw)


BOOM = WorkerError(type="ValueError", message="boom", rank=1, node_id="b", step=30)
DIED_ALONE = WorkerError(
    type="ActorDiedError", message="died", rank=1, node_id="b", kind=ErrorKind.PROCESS_DIED
)
DIED_WITH_B = replace(DIED_ALONE, kind=ErrorKind.NODE_DIED)
METRICS = (StepMetrics(step=31, loss=1.0, world_size=2),)
COMMIT = CheckpointCommitted(step=30, attempt=1, world_size=2, path="/c/30", bytes=10)

ended_ok = EndAttempt(outcome=AttemptOutcome.SUCCEEDED, step=30)
cancelled = Transition(to=S.CANCELLED, reason="cancelled by user")
cancel_live = [EndAttempt(outcome=AttemptOutcome.CANCELLED), cancelled]
node_b_lost = RecordEvent(
    kind=EventKind.NODE_LOST,
    reason="node b lost (ranks [1]) after step 30",
    details={"node_id": "b", "ranks": [1], "step": 30},
)
below_min = "waiting below min: 1 workers fit, the job needs 2"
# Node b died under rank 1: the attempt ends, the job relaunches at 2 on a and c.
relaunched_after_b_lost: list[Action] = [
    node_b_lost,
    EndAttempt(outcome=AttemptOutcome.NODE_LOST, step=30),
    Transition(to=S.RECOVERING, reason="node lost (b)", world_size=2),
    StartAttempt(world_size=2),
    MarkSpare(since=None),
]

# Attempt 2 at 3 workers, launched at NOW - 20 and still waiting for Ray to reserve its
# bundles (no placement reported); node c leaves at NOW - 5 (gone: `Facts.nodes_gone`).
UNPLACED = AttemptView(number=2, world_size=3, started_at=NOW - 20)
C_GONE = {"c": NOW - 5}
c_left_unplaced = RecordEvent(
    kind=EventKind.NODE_LOST,
    reason="node c left before attempt 2 was placed: 2 of its 3 workers fit now",
    details={"nodes": ["c"], "world_size": 3, "fit": 2},
)
released_unplaced = EndAttempt(outcome=AttemptOutcome.NODE_LOST, step=30)
# The relaunch keeps off c: Ray may still list it alive (ray#64693, `decisions.start`).
relaunched_off_c = StartAttempt(world_size=2, avoid_nodes=("c",))
released_and_relaunched_at_2 = [
    c_left_unplaced,
    released_unplaced,
    Transition(to=S.RECOVERING, reason="node lost before placement (c)", world_size=2),
    relaunched_off_c,
    MarkSpare(since=None),
]
# Ray gave up reserving the bundles (the runtime's placement timeout).
NOT_RESERVED = WorkerError(
    type="RuntimeError", message="Ray could not reserve the attempt's bundles in 120s"
)
shrank_under_it = RecordEvent(
    kind=EventKind.CAPACITY,
    reason="attempt 2 failed before it was placed and 2 of its 3 workers fit now: "
    "the cluster shrank, no restart counted",
)


def waiting_for_placement(state: JobState, **kw: Any) -> JobView:
    return job(state, attempt=UNPLACED, world_size=3, **kw)


ROWS: list[Any] = [
    # -- queued ---------------------------------------------------------------------------
    pytest.param(job(S.PENDING, cancel_requested=True), facts(), [cancelled], id="pending+cancel"),
    pytest.param(
        job(S.PENDING),
        facts(admission=2),
        [
            Transition(to=S.STARTING, reason="admitted at world size 2", world_size=2),
            StartAttempt(world_size=2),
        ],
        id="pending+admitted",
    ),
    pytest.param(
        job(S.PENDING, state_reason="x"),
        facts(waiting_reason="queued behind job 7"),
        [SetReason(reason="queued behind job 7")],
        id="pending+waits",
    ),
    pytest.param(
        job(S.PENDING, state_reason="queued behind job 7"),
        facts(waiting_reason="queued behind job 7"),
        [],
        id="pending+still-waits-same-reason",
    ),
    # -- starting up ----------------------------------------------------------------------
    pytest.param(job(S.STARTING), facts(report=report(DriverStatus.STARTING)), [], id="starting"),
    pytest.param(
        job(S.STARTING),
        facts(report=report(messages=METRICS, seq=1)),
        [
            PersistReport(report=report(messages=METRICS, seq=1)),
            Transition(to=S.RUNNING, reason="training started at world size 2", world_size=2),
        ],
        id="starting+first-step",
    ),
    pytest.param(
        job(S.STARTING),
        facts(report=report(DriverStatus.SUCCEEDED)),
        [ended_ok, Transition(to=S.SUCCEEDED, reason="reached step 30")],
        id="starting+succeeded-at-once",
    ),
    pytest.param(
        job(S.STARTING, spec=spec(failure={"max_restarts": 0})),
        facts(report=report(DriverStatus.FAILED, error=BOOM)),
        [
            EndAttempt(outcome=AttemptOutcome.FAILED, error=BOOM, step=30),
            Transition(
                to=S.FAILED,
                reason="gave up after 0 restarts (failure.max_restarts): ValueError: boom",
            ),
        ],
        id="starting+failed-no-restarts",
    ),
    pytest.param(
        job(S.STARTING, cancel_requested=True), facts(), cancel_live, id="starting+cancel"
    ),
    pytest.param(
        job(S.STARTING),
        facts(nodes("a", "c"), alive=("a", "c"), report=report(DriverStatus.STARTING)),
        relaunched_after_b_lost,
        id="starting+node-lost",
    ),
    # -- waiting for its placement ---------------------------------------------------------
    pytest.param(
        waiting_for_placement(S.STARTING),
        facts(nodes("a", "b", "c"), alive=("a", "b", "c"), report=report(DriverStatus.STARTING)),
        [],
        id="starting+not-placed-yet+capacity-there: waits (a slow start on a busy cluster)",
    ),
    pytest.param(
        waiting_for_placement(S.STARTING),
        facts(nodes("a", "b"), report=report(DriverStatus.STARTING), nodes_gone=C_GONE),
        released_and_relaunched_at_2,
        id="starting+not-placed+node-left-since-launch: released, relaunched at 2, no restart",
    ),
    pytest.param(
        waiting_for_placement(S.STARTING),
        facts(
            nodes("a", "b", "d"),
            alive=("a", "b", "d"),
            report=report(DriverStatus.STARTING),
            nodes_gone=C_GONE,
        ),
        [],
        id="starting+not-placed+node-left+the-others-still-hold-3: waits (placed on them)",
    ),
    pytest.param(
        waiting_for_placement(S.STARTING),
        facts(nodes("a", "b"), report=report(DriverStatus.STARTING), nodes_gone={"c": NOW - 30}),
        [],
        id="starting+not-placed+node-left-before-launch: waits (sized without it)",
    ),
    # The chaos campaign's case: a grow 1 -> 3 launched as node c's raylet was killed; Ray
    # declared c dead 15 s later, with 2 nodes left and the attempt still reserving.
    pytest.param(
        waiting_for_placement(S.RESIZING),
        facts(nodes("a", "b"), report=report(DriverStatus.STARTING), nodes_gone=C_GONE),
        released_and_relaunched_at_2,
        id="resizing+grow-not-placed+node-left: relaunched at 2",
    ),
    pytest.param(
        waiting_for_placement(S.RECOVERING, restarts=1),
        facts(nodes("a", "b"), report=report(DriverStatus.STARTING), nodes_gone=C_GONE),
        [
            c_left_unplaced,
            released_unplaced,
            SetReason(reason="node lost before placement (c)"),
            relaunched_off_c,
            MarkSpare(since=None),
        ],
        id="recovering+not-placed+node-left: relaunched at 2 (the event says why)",
    ),
    pytest.param(
        waiting_for_placement(S.STARTING, spec=spec(scaling={"min_workers": 3, "max_workers": 3})),
        facts(nodes("a", "b"), report=report(DriverStatus.STARTING), nodes_gone=C_GONE),
        [
            c_left_unplaced,
            released_unplaced,
            Transition(to=S.RECOVERING, reason="node lost before placement (c)"),
            StartWaiting(reason="waiting below min: 2 workers fit, the job needs 3", at=NOW),
        ],
        id="starting+not-placed+node-left+below-min: released, waits for capacity",
    ),
    pytest.param(
        waiting_for_placement(S.STARTING),
        facts(nodes("a", "b"), report=report(DriverStatus.FAILED, error=NOT_RESERVED)),
        [
            EndAttempt(outcome=AttemptOutcome.FAILED, error=NOT_RESERVED, step=30),
            shrank_under_it,
            Transition(
                to=S.RECOVERING,
                reason=f"relaunching where it fits after: {NOT_RESERVED.summary()}",
                world_size=2,
            ),
            StartAttempt(world_size=2),
            MarkSpare(since=None),
        ],
        id="starting+placement-timed-out+cluster-shrank: no restart counted, relaunched at 2",
    ),
    pytest.param(
        waiting_for_placement(S.STARTING),
        facts(
            nodes("a", "b", "c"),
            alive=("a", "b", "c"),
            report=report(DriverStatus.FAILED, error=NOT_RESERVED),
        ),
        [
            EndAttempt(
                outcome=AttemptOutcome.FAILED, error=NOT_RESERVED, step=30, count_restart=True
            ),
            DelayRelaunch(until=NOW + 1),
            Transition(
                to=S.RECOVERING,
                reason=f"restart 1/2 after: {NOT_RESERVED.summary()}",
                world_size=3,
            ),
        ],
        id="starting+placement-timed-out+capacity-there: a restart (Ray's, or the job's)",
    ),
    # -- running --------------------------------------------------------------------------
    pytest.param(job(S.RUNNING), facts(nodes("a", "b"), report=report()), [], id="running"),
    pytest.param(
        job(S.RUNNING),
        facts(nodes("a", "b"), report=report(messages=(COMMIT,), seq=4)),
        [PersistReport(report=report(messages=(COMMIT,), seq=4)), ApplyRetention(keep_last=3)],
        id="running+checkpoint-committed",
    ),
    pytest.param(
        job(S.RUNNING, checkpoint_requested=True),
        facts(nodes("a", "b"), report=report()),
        [SendControl(control=Control.CHECKPOINT)],
        id="running+checkpoint-now",
    ),
    pytest.param(job(S.RUNNING, cancel_requested=True), facts(), cancel_live, id="running+cancel"),
    pytest.param(
        job(S.RUNNING),
        facts(nodes("a", "b"), report=report(DriverStatus.SUCCEEDED)),
        [ended_ok, Transition(to=S.SUCCEEDED, reason="reached step 30")],
        id="running+succeeded",
    ),
    pytest.param(
        job(S.RUNNING),
        facts(nodes("a", "c"), alive=("a", "c"), report=report()),
        relaunched_after_b_lost,
        id="running+node-lost+relaunch-on-what-is-left",
    ),
    pytest.param(
        job(S.RUNNING),
        facts(nodes("a", "c", "d", warming=("d",)), alive=("a", "c", "d"), report=report()),
        relaunched_after_b_lost,
        id="running+node-lost+replacement-warming: resumes on the warm nodes, not waiting",
    ),
    pytest.param(
        job(S.RUNNING, spec=MIN2),
        facts(nodes("a", "c", warming=("c",)), alive=("a", "c"), report=report()),
        [
            node_b_lost,
            EndAttempt(outcome=AttemptOutcome.NODE_LOST, step=30),
            Transition(to=S.RECOVERING, reason="node lost (b)", world_size=2),
            StartAttempt(world_size=2),
            MarkSpare(since=None),
        ],
        id="running+node-lost+min-needs-the-warming-node: waits for its process",
    ),
    pytest.param(
        job(S.RUNNING, spec=MIN2),
        facts(nodes("a"), alive=("a",), report=report()),
        [
            node_b_lost,
            EndAttempt(outcome=AttemptOutcome.NODE_LOST, step=30),
            Transition(to=S.RECOVERING, reason="node lost (b)"),
            StartWaiting(reason=below_min, at=NOW),
        ],
        id="running+node-lost+below-min",
    ),
    pytest.param(
        job(S.RUNNING),
        facts(nodes("a"), alive=("a",), report=report(DriverStatus.SUCCEEDED)),
        [ended_ok, Transition(to=S.SUCCEEDED, reason="reached step 30")],
        id="running+node-lost-after-success",
    ),
    pytest.param(
        job(S.RUNNING),
        facts(nodes("a", "b"), report=report(DriverStatus.FAILED, error=BOOM)),
        [
            EndAttempt(outcome=AttemptOutcome.FAILED, error=BOOM, step=30, count_restart=True),
            DelayRelaunch(until=NOW + 1),
            Transition(
                to=S.RECOVERING, reason=f"restart 1/2 after: {BOOM.summary()}", world_size=2
            ),
        ],
        id="running+worker-error+backoff",
    ),
    # Rank 1's process died with node b (the driver found b's raylet gone) before Ray
    # declared b dead: a node loss, no restart counted; the relaunch waits out the backoff,
    # by when Ray has declared b dead, so the new size leaves it out.
    pytest.param(
        job(S.RUNNING),
        facts(nodes("a", "b"), report=report(DriverStatus.FAILED, error=DIED_WITH_B)),
        [
            DelayRelaunch(until=NOW + 1),
            node_b_lost,
            EndAttempt(outcome=AttemptOutcome.NODE_LOST, error=DIED_WITH_B, step=30),
            Transition(to=S.RECOVERING, reason="node lost (b)", world_size=2),
        ],
        id="running+process-died-with-its-node+no-restart-counted",
    ),
    # The same death with b's raylet still answering: the process alone died, a failure.
    pytest.param(
        job(S.RUNNING),
        facts(nodes("a", "b"), report=report(DriverStatus.FAILED, error=DIED_ALONE)),
        [
            EndAttempt(
                outcome=AttemptOutcome.FAILED, error=DIED_ALONE, step=30, count_restart=True
            ),
            DelayRelaunch(until=NOW + 1),
            Transition(
                to=S.RECOVERING, reason=f"restart 1/2 after: {DIED_ALONE.summary()}", world_size=2
            ),
        ],
        id="running+process-died-alone+restart-counted",
    ),
    pytest.param(
        job(S.RUNNING),
        facts(nodes("a", "b"), report=report(DriverStatus.LOST)),
        [
            EndAttempt(
                outcome=AttemptOutcome.FAILED,
                error=WorkerError(
                    type="DriverLost", kind=ErrorKind.DRIVER_LOST, message="driver lost"
                ),
                step=30,
                count_restart=True,
            ),
            DelayRelaunch(until=NOW + 1),
            Transition(
                to=S.RECOVERING, reason="restart 1/2 after: DriverLost: driver lost", world_size=2
            ),
        ],
        id="running+driver-lost",
    ),
    pytest.param(
        job(S.RUNNING, restarts=2),
        facts(nodes("a", "b"), report=report(DriverStatus.FAILED, error=BOOM)),
        [
            EndAttempt(outcome=AttemptOutcome.FAILED, error=BOOM, step=30),
            Transition(
                to=S.FAILED,
                reason="gave up after 2 restarts (failure.max_restarts): ValueError: boom",
            ),
        ],
        id="running+worker-error+restarts-used-up",
    ),
    pytest.param(
        job(S.RUNNING, failures=(PastFailure(signature=BOOM.signature, step=30),) * 2),
        facts(nodes("a", "b"), report=report(DriverStatus.FAILED, error=BOOM)),
        [
            EndAttempt(outcome=AttemptOutcome.FAILED, error=BOOM, step=30),
            Transition(
                to=S.FAILED, reason="the same error at step 30 3 times in a row: ValueError: boom"
            ),
        ],
        id="running+same-error-third-time",
    ),
    pytest.param(
        job(S.RUNNING),
        facts(nodes("a", "b", "c"), report=report()),
        [MarkSpare(since=NOW)],
        id="running+capacity-appears",
    ),
    pytest.param(
        job(S.RUNNING),
        facts(nodes("a", "b", "c"), report=report(), spare_since=NOW - 5),
        [],
        id="running+capacity-not-long-enough",
    ),
    pytest.param(
        job(S.RUNNING),
        facts(nodes("a", "b", "c"), report=report(), spare_since=NOW - 10, others_waiting=True),
        [],
        id="running+capacity-but-queue-waits",
    ),
    pytest.param(
        job(S.RUNNING),
        facts(nodes("a", "b", "c"), report=report(), spare_since=NOW - 10),
        [
            SendControl(control=Control.STOP),
            Transition(
                to=S.RESIZING, reason="capacity for 3 workers: growing 2 -> 3", world_size=3
            ),
            MarkSpare(since=None),
        ],
        id="running+grow",
    ),
    pytest.param(
        job(S.RUNNING, attempt=running_attempt(started_at=NOW - 60)),
        facts(
            ClusterCapacity(
                nodes=(
                    NodeCapacity(node_id="a", cpus=1, joined_at=NOW - 600, warm_at=NOW - 590),
                    NodeCapacity(node_id="b", cpus=1, joined_at=NOW - 600, warm_at=NOW - 590),
                    NodeCapacity(node_id="c", cpus=1, joined_at=NOW - 12, warm_at=NOW - 4),
                )
            ),
            report=report(),
            spare_since=NOW - 10,
        ),
        [
            SendControl(control=Control.STOP),
            Transition(
                to=S.RESIZING,
                reason="capacity for 3 workers: growing 2 -> 3",
                world_size=3,
                details={NODE_JOINED_AT: NOW - 12, PROCESS_WARM_AT: NOW - 4},
            ),
            MarkSpare(since=None),
        ],
        id="running+grow-onto-a-node-that-joined-starts-its-timeline-at-the-join",
    ),
    pytest.param(
        job(S.RUNNING),
        facts(nodes("a", "b", "c", warming=("c",)), report=report(), spare_since=NOW - 10),
        [SetReason(reason=f"{GROW_WAIT} (2 -> 3 workers)")],
        id="running+capacity-but-its-processes-still-start",
    ),
    pytest.param(
        job(S.RUNNING, state_reason=f"{GROW_WAIT} (2 -> 3 workers)"),
        facts(nodes("a", "b", "c", warming=("c",)), report=report(), spare_since=NOW - 10),
        [],
        id="running+still-waiting-for-processes-said-already",
    ),
    pytest.param(
        job(S.RUNNING, state_reason=f"{GROW_WAIT} (2 -> 3 workers)"),
        facts(nodes("a", "b"), report=report(), spare_since=NOW - 10),
        [MarkSpare(since=None), SetReason(reason="training on at world size 2")],
        id="running+the-node-it-waited-for-went",
    ),
    pytest.param(
        job(S.RUNNING),
        facts(nodes("a", "b", "c", warming=("c",)), report=report()),
        [MarkSpare(since=NOW)],
        id="running+warming-capacity-starts-the-grow-clock",
    ),
    pytest.param(
        job(S.RUNNING),
        facts(nodes("a", "b"), report=report(), spare_since=NOW - 3),
        [MarkSpare(since=None)],
        id="running+capacity-gone-again",
    ),
    # -- resizing -------------------------------------------------------------------------
    pytest.param(
        job(S.RESIZING, attempt=running_attempt(stop_requested=True)),
        facts(nodes("a", "b", "c"), report=report(messages=METRICS, seq=2, stopping=True)),
        [PersistReport(report=report(messages=METRICS, seq=2, stopping=True))],
        id="resizing+old-attempt-trains-on",
    ),
    pytest.param(
        job(S.RESIZING, attempt=running_attempt(stop_requested=True)),
        facts(nodes("a", "b", "c"), report=report()),
        [SendControl(control=Control.STOP)],
        id="resizing+stop-never-arrived-is-sent-again",
    ),
    pytest.param(
        job(S.RESIZING, attempt=running_attempt(stop_requested=True)),
        facts(nodes("a", "b", "c"), report=report(DriverStatus.STOPPED)),
        [
            EndAttempt(outcome=AttemptOutcome.STOPPED, step=30),
            StartAttempt(world_size=3),
            MarkSpare(since=None),
        ],
        id="resizing+stopped+relaunch-bigger",
    ),
    pytest.param(
        job(S.RESIZING, attempt=running_attempt(2, on=("a", "b", "c"))),
        facts(nodes("a", "b", "c"), alive=("a", "b", "c"), report=report(resumed_from_step=30)),
        [Transition(to=S.RUNNING, reason="resumed from step 30 at world size 3", world_size=3)],
        id="resizing+new-attempt-runs",
    ),
    pytest.param(
        job(S.RESIZING, attempt=running_attempt(stop_requested=True)),
        facts(nodes("a", "b", "c"), report=report(DriverStatus.SUCCEEDED)),
        [ended_ok, Transition(to=S.SUCCEEDED, reason="reached step 30")],
        id="resizing+finished-at-last-step",
    ),
    pytest.param(
        job(S.RESIZING, attempt=running_attempt(stop_requested=True)),
        facts(nodes("a", "c"), alive=("a", "c"), report=report()),
        relaunched_after_b_lost,
        id="resizing+node-lost",
    ),
    pytest.param(
        between_attempts(S.RESIZING, spec=MIN2, below_min_since=NOW - 61),
        facts(nodes("a")),
        [Transition(to=S.FAILED, reason=f"below min_workers for 61s (timeout 60s): {below_min}")],
        id="resizing+below-min-timeout",
    ),
    pytest.param(
        job(S.RESIZING, cancel_requested=True), facts(), cancel_live, id="resizing+cancel"
    ),
    # -- recovering -----------------------------------------------------------------------
    pytest.param(
        job(S.RECOVERING, attempt=running_attempt(2)),
        facts(report=report(messages=METRICS, seq=1, resumed_from_step=20)),
        [
            PersistReport(report=report(messages=METRICS, seq=1, resumed_from_step=20)),
            Transition(to=S.RUNNING, reason="resumed from step 20 at world size 2", world_size=2),
        ],
        id="recovering+resumed",
    ),
    pytest.param(
        job(S.RECOVERING, attempt=running_attempt(2), restarts=1),
        facts(nodes("a", "b"), report=report(DriverStatus.FAILED, error=BOOM)),
        [
            EndAttempt(outcome=AttemptOutcome.FAILED, error=BOOM, step=30, count_restart=True),
            DelayRelaunch(until=NOW + 1),
            SetReason(reason=f"restart 2/2 after: {BOOM.summary()}"),
        ],
        id="recovering+relaunch-fails-too",
    ),
    pytest.param(
        job(S.RECOVERING, attempt=running_attempt(2)),
        facts(report=report(DriverStatus.SUCCEEDED)),
        [ended_ok, Transition(to=S.SUCCEEDED, reason="reached step 30")],
        id="recovering+nothing-left-to-do",
    ),
    pytest.param(
        between_attempts(S.RECOVERING),
        facts(relaunch_not_before=NOW + 1),
        [],
        id="recovering+backoff",
    ),
    pytest.param(
        between_attempts(S.RECOVERING),
        facts(nodes("a", "b")),
        [StartAttempt(world_size=2), MarkSpare(since=None)],
        id="recovering+relaunch",
    ),
    pytest.param(
        between_attempts(S.RECOVERING, spec=MIN2),
        facts(nodes("a")),
        [StartWaiting(reason=below_min, at=NOW)],
        id="recovering+below-min-starts-waiting",
    ),
    pytest.param(
        between_attempts(S.RECOVERING, spec=MIN2, below_min_since=NOW - 30),
        facts(nodes("a")),
        [],
        id="recovering+below-min-keeps-waiting",
    ),
    pytest.param(
        between_attempts(S.RECOVERING, spec=MIN2, below_min_since=NOW - 61),
        facts(nodes("a")),
        [Transition(to=S.FAILED, reason=f"below min_workers for 61s (timeout 60s): {below_min}")],
        id="recovering+below-min-timeout",
    ),
    pytest.param(
        between_attempts(S.RECOVERING, spec=MIN2, below_min_since=NOW - 30),
        facts(nodes("a", "b")),
        [
            StopWaiting(reason="capacity for 2 workers after waiting 30s"),
            StartAttempt(world_size=2),
            MarkSpare(since=None),
        ],
        id="recovering+capacity-back",
    ),
    pytest.param(
        between_attempts(S.RECOVERING, cancel_requested=True),
        facts(),
        [cancelled],
        id="recovering+cancel-without-driver",
    ),
    pytest.param(
        job(S.RECOVERING, attempt=running_attempt(2), cancel_requested=True),
        facts(),
        cancel_live,
        id="recovering+cancel",
    ),
    # -- finished -------------------------------------------------------------------------
    *[
        pytest.param(job(s, cancel_requested=True), facts(report=report()), [], id=f"{s.value}")
        for s in (S.SUCCEEDED, S.FAILED, S.CANCELLED)
    ],
]


#: A job the scheduler cannot decide about: (state, live attempt) -> what `give_up` does.
GIVE_UP_ROWS = [
    pytest.param(S.PENDING, False, [Transition(to=S.FAILED, reason="bad")], id="queued"),
    pytest.param(
        S.RUNNING,
        True,
        [EndAttempt(outcome=AttemptOutcome.FAILED), Transition(to=S.FAILED, reason="bad")],
        id="running",
    ),
    pytest.param(S.RECOVERING, False, [Transition(to=S.FAILED, reason="bad")], id="between"),
    pytest.param(S.CANCELLED, False, [], id="finished"),
]


@pytest.mark.parametrize(("view", "observed", "expected"), ROWS)
def test_decision_table(view: JobView, observed: Facts, expected: list[Action]) -> None:
    assert decide(view, observed) == expected


@pytest.mark.parametrize(("state", "live", "expected"), GIVE_UP_ROWS)
def test_give_up_table(state: JobState, live: bool, expected: list[Action]) -> None:
    assert give_up(state, live_attempt=live, reason="bad") == expected


def test_the_table_takes_exactly_the_allowed_transitions() -> None:
    taken = set()
    for row in ROWS:
        view, observed, _ = row.values
        for action in decide(view, observed):
            if isinstance(action, Transition):
                taken.add((view.state, action.to))
    for row in GIVE_UP_ROWS:
        state, live, _ = row.values
        for action in give_up(state, live_attempt=live, reason="bad"):
            if isinstance(action, Transition):
                taken.add((state, action.to))
    allowed = {(src, dst) for src, dsts in ALLOWED.items() for dst in dsts}
    assert taken == allowed


@pytest.mark.parametrize(("view", "observed", "expected"), ROWS)
def test_decide_reads_only_its_arguments_and_changes_none(
    view: JobView, observed: Facts, expected: list[Action], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The scheduler hands `decide` views it keeps from pass to pass (elastrain.service.observe's
    ViewCache) and reports whose metrics it stores afterwards: deciding must leave them as
    they were. And the answer comes from the arguments alone: the same for equal copies,
    and with no clock but `facts.now`."""

    def no_clock() -> float:
        raise AssertionError("decide read the clock: its time is facts.now")

    before = copy.deepcopy((view, observed))
    monkeypatch.setattr(time, "time", no_clock)
    monkeypatch.setattr(time, "monotonic", no_clock)
    assert decide(*copy.deepcopy((view, observed))) == expected
    assert decide(view, observed) == expected
    assert (view, observed) == before


# -- the pieces ---------------------------------------------------------------------------


def test_lost_ranks_groups_ranks_by_dead_node() -> None:
    assert lost_ranks(("a", "b", "b", "c"), frozenset({"a", "c"})) == {"b": [1, 2]}
    assert lost_ranks(("a",), frozenset({"a"})) == {}
    assert lost_ranks((), frozenset()) == {}


def test_progress_counts_steps_in_the_report() -> None:
    assert progress(job(S.RUNNING), None) == 30
    assert progress(job(S.RUNNING), report(messages=METRICS)) == 31


@pytest.mark.parametrize(
    ("current", "possible", "since", "waiting", "grow"),
    [
        (2, 3, NOW - 10, False, True),
        (2, 3, NOW - 9, False, False),  # not for long enough
        (2, 3, None, False, False),  # just appeared
        (2, 3, NOW - 99, True, False),  # a queued job gets it
        (3, 3, NOW - 99, False, False),  # nothing to grow into
    ],
)
def test_should_grow(
    current: int, possible: int, since: float | None, waiting: bool, grow: bool
) -> None:
    assert (
        should_grow(
            current=current,
            possible=possible,
            spare_since=since,
            now=NOW,
            grow_interval_s=10,
            others_waiting=waiting,
        )
        is grow
    )


def test_decide_failure_backoff_grows_then_gives_up_on_a_repeat() -> None:
    def retry(history: list[PastFailure], restarts: int = 0) -> Any:
        return decide_failure(
            signature="E: x",
            step=3,
            restarts=restarts,
            max_restarts=5,
            recent_failures=history,
            backoff_s=1.0,
        )

    first, second = retry([]), retry([PastFailure(signature="E: x", step=3)], restarts=1)
    assert first.action == second.action == FailureAction.RETRY
    assert (first.delay_s, second.delay_s) == (1.0, 2.0)
    other_step = retry([PastFailure(signature="E: x", step=2)] * 2)
    assert other_step.action == FailureAction.RETRY and other_step.delay_s == 1.0
    assert retry([PastFailure(signature="E: x", step=3)] * 2).action == FailureAction.GIVE_UP


SHAPE = WorkerShape(cpus=1, gpus=0)


def test_free_capacity_charges_placed_workers_and_packs_the_rest() -> None:
    cluster = ClusterCapacity(
        nodes=(
            NodeCapacity(node_id="a", cpus=2),
            NodeCapacity(node_id="b", cpus=2),
            NodeCapacity(node_id="dead", cpus=8, alive=False),
        )
    )
    placed = Allocation(shape=SHAPE, count=2, nodes=("b", "dead"))  # one worker died
    unplaced = Allocation(shape=SHAPE, count=2)
    free = free_capacity(cluster, [placed, unplaced])
    assert {n.node_id: n.cpus for n in free.nodes} == {"a": 0, "b": 1}
    assert free.workers_that_fit(1, 0) == 1
    # Promised growth: placed on b, one more not yet placed.
    grown = free_capacity(cluster, [Allocation(shape=SHAPE, count=2, nodes=("b",))])
    assert {n.node_id: n.cpus for n in grown.nodes} == {"a": 1, "b": 1}


def test_workers_that_fit_ignores_overcommitted_nodes() -> None:
    cluster = ClusterCapacity(
        nodes=(NodeCapacity(node_id="a", cpus=-1), NodeCapacity(node_id="b", cpus=2))
    )
    assert cluster.workers_that_fit(1, 0) == 2


def test_ledger_offers_a_job_its_own_workers_but_not_others() -> None:
    ledger = CapacityLedger(
        nodes("a", "b", "c"), {1: Allocation(shape=SHAPE, count=2, nodes=("a", "b"))}
    )
    assert ledger.free().workers_that_fit(1, 0) == 1
    assert ledger.free_for(1).workers_that_fit(1, 0) == 3
    ledger.hold(2, Allocation(shape=SHAPE, count=1))
    assert ledger.free_for(1).workers_that_fit(1, 0) == 2
    ledger.hold(1, None)
    assert ledger.free().workers_that_fit(1, 0) == 2


def test_allocation_after_follows_the_actions() -> None:
    view = job(S.RUNNING)
    assert allocation_after(view, []) == Allocation(shape=SHAPE, count=2, nodes=("a", "b"))
    grow = decide(view, facts(nodes("a", "b", "c"), report=report(), spare_since=NOW - 10))
    assert allocation_after(view, grow) == Allocation(shape=SHAPE, count=3, nodes=("a", "b"))
    lost = decide(view, facts(nodes("a", "c"), alive=("a", "c"), report=report()))
    assert allocation_after(view, lost) == Allocation(shape=SHAPE, count=2)
    assert allocation_after(view, cancel_live) is None


def test_relaunch_and_growth_respect_the_quota() -> None:
    view = job(S.RECOVERING, attempt=None)
    limited = facts(nodes("a", "b", "c"), alive=("a", "b", "c"))
    assert StartAttempt(world_size=1) in decide(view, replace(limited, worker_limit=1))
    waits = decide(replace(view, spec=MIN2), replace(limited, worker_limit=1))
    assert isinstance(waits[0], StartWaiting) and "quota leaves 1" in waits[0].reason


def test_placement_message_gives_rank_order() -> None:
    placement = Placement(nodes={1: "b", 0: "a"})
    assert placement.node_list() == ("a", "b")
    view = job(S.STARTING, attempt=replace(running_attempt(), nodes=()))
    lost = decide(view, facts(nodes("a"), alive=("a",), report=report(placement=placement)))
    assert isinstance(lost[0], PersistReport) and lost[1] == node_b_lost


def test_a_workload_that_cannot_be_built_fails_at_once_unretried() -> None:
    broken = WorkerError(
        type="KeyError",  # the kind decides, whatever the exception's class
        kind=ErrorKind.CONFIGURATION,
        message="workload.entrypoint: cannot import module 'x'",
        rank=0,
    )
    actions = decide(job(S.RUNNING), facts(report=report(DriverStatus.FAILED, error=broken)))
    assert actions[0] == EndAttempt(
        outcome=AttemptOutcome.FAILED, error=broken, step=30, count_restart=False
    )
    assert isinstance(actions[1], Transition) and actions[1].to == S.FAILED
    assert "cannot import module 'x'" in actions[1].reason and "not retried" in actions[1].reason
    assert len(actions) == 2  # no backoff, no relaunch


# -- strategy.kind: auto -------------------------------------------------------------------

# The synthetic workload's default model: 17,732 parameters; DDP needs 20 bytes a parameter
# plus activations, FSDP about 16/W plus one block's gathers.
AUTO = spec(strategy={"kind": "auto"})


@pytest.mark.parametrize(
    ("memory", "strategy", "words"),
    [
        pytest.param(2**30, "ddp", "ddp:", id="ddp-fits"),
        pytest.param(300_000, "fsdp", "ddp needs", id="only-fsdp-fits"),
        pytest.param(1_000, "fsdp", "fsdp, the least memory; nothing fits", id="nothing-fits"),
        pytest.param(None, "fsdp", "no memory figure", id="memory-unknown"),
    ],
)
def test_auto_plans_the_strategy_at_every_launch(
    memory: int | None, strategy: str, words: str
) -> None:
    for view, observed in [
        (job(S.PENDING, spec=AUTO), facts(admission=2, worker_memory_bytes=memory)),
        (between_attempts(S.RECOVERING, spec=AUTO), facts(worker_memory_bytes=memory)),
    ]:
        actions = decide(view, observed)
        [start] = [a for a in actions if isinstance(a, StartAttempt)]
        [event] = [a for a in actions if isinstance(a, RecordEvent)]
        assert start.strategy is not None and start.strategy.value == strategy
        assert event.kind == EventKind.PLAN and words in event.reason
        assert event.details is not None and event.details["strategy"] == strategy
        assert f"at world size {start.world_size}" in event.reason


def test_a_fixed_strategy_is_not_planned() -> None:
    actions = decide(job(S.PENDING), facts(admission=2, worker_memory_bytes=1))
    assert StartAttempt(world_size=2) in actions
    assert not [a for a in actions if isinstance(a, RecordEvent)]


# A gpt whose blocks' gathers (12 bytes x 805M parameters) crowd out FSDP at two workers.
WIDE_AUTO = spec(
    workload={"name": "gpt", "params": {"n_layer": 4, "n_embd": 8192, "n_head": 16, "seq_len": 8}},
    strategy={"kind": "auto"},
    training={"activation_checkpointing": "full", "micro_batch_size": 4},
)


@pytest.mark.parametrize(
    ("gib", "strategy", "tp", "label"),
    [(64, "fsdp", 1, "fsdp"), (34, "tp", 2, "tp2"), (30, "fsdp", 2, "fsdp+tp2")],
)
def test_auto_splits_layers_only_when_sharding_does_not_fit(
    gib: int, strategy: str, tp: int, label: str
) -> None:
    view = job(S.PENDING, spec=WIDE_AUTO)
    actions = decide(view, facts(admission=2, worker_memory_bytes=gib * 2**30))
    [start] = [a for a in actions if isinstance(a, StartAttempt)]
    [event] = [a for a in actions if isinstance(a, RecordEvent)]
    assert start.world_size == 2
    assert start.strategy is not None and start.strategy.value == strategy
    assert start.tensor_parallel == tp
    assert event.reason.startswith(f"at world size 2: {label}:")
    assert event.details is not None and event.details["tensor_parallel"] == tp
    assert set(event.details["rank_bytes"]) >= {"ddp", "fsdp", "tp2", "fsdp+tp2"}
