"""A job's lifecycle as one pure function: `decide(job, facts) -> [Action]`.

The scheduler observes (the job's row and current attempt, its driver's report, the alive
nodes, the capacity free for it, timers), calls `decide` for every job that is not
finished, and hands the actions to `elastrain.service.executor`, which writes the DB in one
transaction and then makes the Ray calls. Nothing here does I/O: the table below is tested
row by row in tests/unit/test_decisions.py.

| job is | and the facts say | it does |
| --- | --- | --- |
| PENDING | cancel requested | -> CANCELLED |
| PENDING | the admission plan gives it n workers | -> STARTING at n, start attempt 1 |
| PENDING | no room | note why it waits (queued behind, too big for the cluster) |
| any active | cancel requested | end the attempt (its driver is stopped) -> CANCELLED |
| any active | a node holding one of its ranks died | end the attempt (node lost, no restart counted) -> RECOVERING, relaunch at the size that fits now |
| STARTING, RECOVERING, RESIZING | its attempt is not placed yet, a node left since it was launched, and fewer workers than its world size fit now | release it (node lost, no restart counted) -> RECOVERING, relaunch at the size that fits now |
| STARTING, RECOVERING | driver reports steps | -> RUNNING ("resumed from step s" or "training started") |
| RESIZING | steps from the attempt asked to stop | nothing: it trains on to its checkpoint (the stop is sent again if its driver never got it) |
| RESIZING | steps from the relaunched attempt | -> RUNNING at the new size |
| any active | driver SUCCEEDED | end the attempt -> SUCCEEDED |
| RESIZING | driver STOPPED after its checkpoint | end the attempt, relaunch at the new size |
| any active | driver FAILED or LOST | end the attempt (a restart counted) -> RECOVERING and relaunch after a backoff; or -> FAILED when restarts are used up or the same error recurs at the same step |
| any active | driver FAILED before its attempt was placed (Ray could not reserve it, a process never started), and fewer workers than its world size fit now | end the attempt, no restart counted (the cluster shrank under it) -> RECOVERING, relaunch at the size that fits now |
| any active | driver FAILED: the workload cannot run (built, imported or first used: `elastrain.workers.errors.configuration_errors`) | end the attempt -> FAILED at once (a configuration error is not retried) |
| RECOVERING, RESIZING without an attempt | capacity for min workers | start the next attempt at the size that fits |
| RECOVERING, RESIZING without an attempt | below min | wait (event, reason); -> FAILED after `below_min_timeout_s` |
| RUNNING | a bigger size possible for `grow_interval_s`, nobody queued, the new nodes' warm processes up | ask the attempt to checkpoint and stop -> RESIZING |
| RUNNING | the same, a new node's processes still starting | train on (reason says so) |
| RUNNING | user asked for a checkpoint | tell the driver |
| RUNNING | a node of its ranks is draining, min workers fit elsewhere | ask the attempt to leave at the next step (no checkpoint: the state goes on in memory) -> RESIZING |
| RUNNING | a node of its ranks is draining, min workers do not fit elsewhere | checkpoint now and train on there (reason says why); at the drain deadline checkpoint and stop -> RESIZING, then wait below min |

Every state change is a `Transition`; `elastrain.service.states.ALLOWED` is exactly the set of edges
these rows produce.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from enum import Enum
from typing import Any

from elastrain.contracts.messages import (
    CheckpointCommitted,
    Control,
    DriverReport,
    DriverStatus,
    ErrorKind,
    EventKind,
    WorkerError,
)
from elastrain.contracts.plan import choose_for_auto
from elastrain.contracts.spec import JobSpec, StrategyKind
from elastrain.service.capacity import (
    Allocation,
    ClusterCapacity,
    DrainSource,
    NodeDrain,
    WorkerShape,
    grow_joins,
    target_world_size,
)
from elastrain.service.states import JobState

# ---------------------------------------------------------------------------------------
# Facts: what the scheduler observed
# ---------------------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True, slots=True)
class AttemptView:
    number: int
    world_size: int
    nodes: tuple[str, ...] = ()
    """The node of each rank, once the worker group reported its placement."""
    ended: bool = False
    stop_requested: bool = False
    """Asked to checkpoint and stop for a resize."""
    report_seq: int = 0
    """The last driver message persisted."""
    name: str = ""
    """`elastrain.contracts.runtime.attempt_name`: what the runtime knows the attempt by."""
    started_at: float = 0.0
    """When it was launched (epoch seconds)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class PastFailure:
    """A failed attempt of the job: what failed (`WorkerError.signature`) and at which step."""

    signature: str
    step: int


@dataclass(frozen=True, kw_only=True, slots=True)
class JobView:
    """The job as the DB has it at the start of the pass."""

    id: int
    state: JobState
    spec: JobSpec
    owner: str = "default"
    step: int = 0
    world_size: int | None = None
    restarts: int = 0
    state_reason: str | None = None
    attempt: AttemptView | None = None
    """The newest attempt (None before the first launch)."""
    cancel_requested: bool = False
    checkpoint_requested: bool = False
    below_min_since: float | None = None
    """When the job started waiting for `min_workers` (epoch seconds), None if it is not."""
    failures: tuple[PastFailure, ...] = ()
    """The job's failed attempts, oldest first (read only when needed)."""
    submitted_at: float = 0.0
    """Epoch seconds (how long a queued job has waited: `elastrain.service.admission`)."""

    @property
    def live_attempt(self) -> AttemptView | None:
        return self.attempt if self.attempt is not None and not self.attempt.ended else None


@dataclass(frozen=True, kw_only=True, slots=True)
class Policy:
    """The scheduler's tunables (from `elastrain.service.settings.Settings`)."""

    grow_interval_s: float = 10.0
    below_min_timeout_s: float = 600.0
    restart_backoff_s: float = 1.0


@dataclass(frozen=True, kw_only=True, slots=True)
class Facts:
    """Everything but the job's own row that a decision depends on."""

    now: float
    """Epoch seconds."""
    policy: Policy = field(default_factory=Policy)
    alive_nodes: frozenset[str] = frozenset()
    free: ClusterCapacity = field(default_factory=ClusterCapacity)
    """Capacity free for this job if it gave back what it holds."""
    report: DriverReport | None = None
    """The live attempt's driver report (None when there is no live attempt)."""
    relaunch_not_before: float = 0.0
    """Backoff after a failure: no relaunch before this time."""
    spare_since: float | None = None
    """Since when a bigger world size has been possible (growth hysteresis)."""
    others_waiting: bool = False
    """A queued job waits for capacity: spare capacity is theirs, not for growing."""
    admission: int | None = None
    """PENDING only: the world size the admission plan gives the job (None: it waits)."""
    waiting_reason: str | None = None
    """PENDING only: why it waits."""
    worker_limit: int | None = None
    """The most workers the job may hold under its tenant's quota (None: no quota)."""
    worker_memory_bytes: int | None = None
    """What one worker of the job's shape has to hold its state (None: unknown)."""
    draining: Mapping[str, NodeDrain] = field(default_factory=dict)
    """Nodes going away, by id (their capacity is not in `free` any more)."""
    nodes_gone: Mapping[str, float] = field(default_factory=dict)
    """Nodes that left the alive nodes while the scheduler watched (died, or counted dead
    by `capacity.found_dead`), each with when it first saw them gone: wall-clock epoch
    seconds, as an attempt's `started_at`. An attempt launched before a node left was sized
    on a cluster that had it."""

    def target(self, spec: JobSpec) -> int:
        """The world size the job could run at now (0: below its min)."""
        return target_world_size(spec, self.free, limit=self.worker_limit)

    def warm_target(self, spec: JobSpec) -> int:
        """The world size the job could run at on nodes with warm processes up."""
        return target_world_size(spec, self.free.without_warming(), limit=self.worker_limit)


# ---------------------------------------------------------------------------------------
# Actions: what the executor carries out, in order
# ---------------------------------------------------------------------------------------


class AttemptOutcome(str, Enum):
    SUCCEEDED = "succeeded"
    STOPPED = "stopped"  # checkpointed and stopped for a resize
    FAILED = "failed"  # worker error or lost driver
    NODE_LOST = "node_lost"
    CANCELLED = "cancelled"


@dataclass(frozen=True, kw_only=True, slots=True)
class Transition:
    """Move the job to another state, with the event that says why."""

    to: JobState
    reason: str
    world_size: int | None = None
    """The world size after the move (None: unchanged)."""
    details: Mapping[str, Any] | None = None
    """Kept with the event (a grow: when the nodes it grows onto joined, `grow_joins`)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class SetReason:
    """Say why the job is where it is, without a state change (no event)."""

    reason: str


@dataclass(frozen=True, kw_only=True, slots=True)
class RecordEvent:
    kind: EventKind
    reason: str
    details: dict[str, Any] | None = None


@dataclass(frozen=True, kw_only=True, slots=True)
class PersistReport:
    """Store what the live attempt's driver reported (metrics, checkpoints, events,
    placement), fenced by the attempt number; acknowledge it to the driver."""

    report: DriverReport


@dataclass(frozen=True, kw_only=True, slots=True)
class ApplyRetention:
    """Delete checkpoints beyond the job's `keep_last` (rows now, files once committed)."""

    keep_last: int


@dataclass(frozen=True, kw_only=True, slots=True)
class StartAttempt:
    """Open the next attempt at this world size; its driver is launched once committed."""

    world_size: int
    strategy: StrategyKind | None = None
    """What an `auto` job runs in this attempt (None: the spec's own kind)."""
    tensor_parallel: int = 1
    """With `strategy`: its tensor-parallel degree."""
    avoid_nodes: tuple[str, ...] = ()
    """Draining nodes and nodes gone lately: no rank of the attempt may be placed there."""


@dataclass(frozen=True, kw_only=True, slots=True)
class EndAttempt:
    """Close the live attempt; once committed its driver is stopped and its resources
    freed. A failure is recorded on the job (`last_error`) and may count as a restart."""

    outcome: AttemptOutcome
    error: WorkerError | None = None
    step: int = 0
    count_restart: bool = False


@dataclass(frozen=True, kw_only=True, slots=True)
class SendControl:
    """Ask the live attempt to checkpoint now, to checkpoint and stop (a resize), or to
    leave at the next step (a drain)."""

    control: Control
    why: str = "checkpoint now (user)"
    """For a checkpoint: what the event says asked for it."""


@dataclass(frozen=True, kw_only=True, slots=True)
class StartWaiting:
    """Fewer than min_workers fit: the job waits from `at` (event, reason)."""

    reason: str
    at: float


@dataclass(frozen=True, kw_only=True, slots=True)
class StopWaiting:
    reason: str


@dataclass(frozen=True, kw_only=True, slots=True)
class DelayRelaunch:
    """Backoff: no relaunch before `until` (soft state: a restarted scheduler forgets it)."""

    until: float


@dataclass(frozen=True, kw_only=True, slots=True)
class MarkSpare:
    """Growth hysteresis: a bigger size has been possible since `since` (None: it is not)."""

    since: float | None


Action = (
    Transition
    | SetReason
    | RecordEvent
    | PersistReport
    | ApplyRetention
    | StartAttempt
    | EndAttempt
    | SendControl
    | StartWaiting
    | StopWaiting
    | DelayRelaunch
    | MarkSpare
)

CANCELLED_BY_USER = "cancelled by user"
#: How the reason of a job that waits to leave a draining node begins.
DRAIN_WAIT = "waiting: "
#: How the reason of a running job that waits for new nodes' processes to grow begins.
GROW_WAIT = "growing once the new nodes' processes have started"


# ---------------------------------------------------------------------------------------
# The decision
# ---------------------------------------------------------------------------------------


def decide(job: JobView, facts: Facts) -> list[Action]:
    """What to do about `job` now. Pure: the same job and facts give the same actions."""
    if job.state.is_terminal:
        return []
    if job.state == JobState.PENDING:
        return _decide_pending(job, facts)
    attempt = job.live_attempt
    if attempt is None:  # between attempts: waiting for capacity or a backoff
        if job.cancel_requested:
            return [Transition(to=JobState.CANCELLED, reason=CANCELLED_BY_USER)]
        return _relaunch(job, facts)
    if job.cancel_requested:
        return [
            EndAttempt(outcome=AttemptOutcome.CANCELLED),
            Transition(to=JobState.CANCELLED, reason=CANCELLED_BY_USER),
        ]
    report = facts.report or DriverReport(status=DriverStatus.STARTING)
    actions: list[Action] = []
    if report.messages or (report.placement is not None and not attempt.nodes):
        actions.append(PersistReport(report=report))
        if any(isinstance(m, CheckpointCommitted) for m in report.messages):
            actions.append(ApplyRetention(keep_last=job.spec.checkpoint.keep_last))
    if job.checkpoint_requested:
        actions.append(SendControl(control=Control.CHECKPOINT))
    nodes = attempt.nodes or (report.placement.node_list() if report.placement else ())
    lost = lost_ranks(nodes, facts.alive_nodes)
    if lost and report.status != DriverStatus.SUCCEEDED:
        return actions + _on_node_loss(job, facts, report, lost)
    dead = _died_with_node(report)
    died_with = lost_ranks(nodes, facts.alive_nodes - {dead}) if dead is not None else {}
    if died_with:
        return actions + _on_node_death_first(job, facts, report, died_with)
    if not nodes and report.status == DriverStatus.STARTING:
        outgrown = _outgrown_before_placement(job, attempt, facts)
        if outgrown is not None:
            return actions + outgrown
    # Acted on once the attempt trains (an attempt placed before the drain leaves after
    # its first step) and was not asked to stop already (a grow, or this drain).
    draining = draining_ranks(nodes, facts.draining)
    trains = job.state == JobState.RUNNING and report.status == DriverStatus.RUNNING
    if draining and trains and not attempt.stop_requested:
        return actions + _on_drain(job, attempt, facts, report, draining)
    return actions + _on_driver_status(job, attempt, facts, report)


def _died_with_node(report: DriverReport) -> str | None:
    """The node of a failed attempt whose cause is a process that died with its node (the
    driver found the node's raylet gone), else None."""
    error = report.error
    if report.status != DriverStatus.FAILED or error is None or error.kind != ErrorKind.NODE_DIED:
        return None
    return error.node_id or None


def _on_node_death_first(
    job: JobView, facts: Facts, report: DriverReport, lost: dict[str, list[int]]
) -> list[Action]:
    """A node loss the driver saw (its raylet gone) before Ray declared the node dead: the
    same as any node loss (no restart counted). The scheduler counts such a node dead at
    once (`capacity.found_dead`), so this is reached only with facts that still hold it
    alive: the relaunch then waits out the restart backoff rather than place a rank on it."""
    until = facts.now + facts.policy.restart_backoff_s
    return [
        DelayRelaunch(until=until),
        *_on_node_loss(job, replace(facts, relaunch_not_before=until), report, lost),
    ]


def give_up(state: JobState, *, live_attempt: bool, reason: str) -> list[Action]:
    """A job the scheduler cannot decide about (its stored spec does not read back, or
    deciding raised): failed, with the error as its reason, its live attempt ended first,
    so that one bad row costs its own job and no other's pass."""
    if state.is_terminal:
        return []
    actions: list[Action] = []
    if live_attempt:
        actions.append(EndAttempt(outcome=AttemptOutcome.FAILED))
    return [*actions, Transition(to=JobState.FAILED, reason=reason)]


def _decide_pending(job: JobView, facts: Facts) -> list[Action]:
    if job.cancel_requested:
        return [Transition(to=JobState.CANCELLED, reason=CANCELLED_BY_USER)]
    if facts.admission:
        size = facts.admission
        return [
            Transition(
                to=JobState.STARTING, reason=f"admitted at world size {size}", world_size=size
            ),
            *start(job, size, facts),
        ]
    if facts.waiting_reason and facts.waiting_reason != job.state_reason:
        return [SetReason(reason=facts.waiting_reason)]
    return []


def _on_node_loss(
    job: JobView, facts: Facts, report: DriverReport, lost: dict[str, list[int]]
) -> list[Action]:
    # Don't wait for the survivors to notice the dead peers: release the attempt now and
    # relaunch at the size the cluster still holds (from the survivors' memory or the
    # latest checkpoint).
    step = progress(job, report)
    actions: list[Action] = [
        RecordEvent(
            kind=EventKind.NODE_LOST,
            reason=f"node {node[:12]} lost (ranks {ranks}) after step {step}",
            details={"node_id": node, "ranks": ranks, "step": step},
        )
        for node, ranks in lost.items()
    ]
    actions.append(EndAttempt(outcome=AttemptOutcome.NODE_LOST, error=report.error, step=step))
    nodes = ", ".join(n[:12] for n in lost)
    return actions + _enter_recovery(job, facts, reason=f"node lost ({nodes})")


def workers_that_fit_now(job: JobView, facts: Facts) -> int:
    """How many of the job's workers the cluster holds now, its own given back: Ray's
    alive nodes (less those `capacity.found_dead` counts dead, and draining ones) less the
    other jobs' workers. Neither its quota nor its min and max: whether the cluster can
    hold an attempt is a question about the cluster."""
    shape = WorkerShape.of(job.spec)
    return facts.free.workers_that_fit(shape.cpus, shape.gpus)


def gone_since(attempt: AttemptView, nodes_gone: Mapping[str, float]) -> list[str]:
    """The nodes that left after the attempt was launched (sorted): it was sized with them."""
    return sorted(node for node, at in nodes_gone.items() if at > attempt.started_at)


def _outgrown_before_placement(
    job: JobView, attempt: AttemptView, facts: Facts
) -> list[Action] | None:
    """An attempt still waiting for its placement (its driver asks Ray for all its bundles
    at once, and retries until the runtime's placement timeout, 120 s) whose world size
    the cluster no longer holds because a node left after it was launched: it would wait
    out the timeout and then fail as a restart. Released now (a node loss: no restart
    counted), the job relaunches at the size that fits (from its checkpoint or the
    processes' memory), and grows back once capacity returns.

    None (it waits on) while the world size still fits (Ray places it on the others), and
    when no node left since its launch: a start merely slow on a busy cluster waits for
    its placement, even where the ledger's first-fit packing of other jobs' unplaced
    workers of another shape says it does not fit (Ray may pack them otherwise). A node
    that left is not listed alive again (Ray gives a restarted node a new id), so this
    does not flap."""
    gone = gone_since(attempt, facts.nodes_gone)
    if not gone:
        return None
    fit = workers_that_fit_now(job, facts)
    if fit >= attempt.world_size:
        return None
    names = ", ".join(n[:12] for n in gone)
    return [
        RecordEvent(
            kind=EventKind.NODE_LOST,
            reason=f"node {names} left before attempt {attempt.number} was placed: "
            f"{fit} of its {attempt.world_size} workers fit now",
            details={"nodes": gone, "world_size": attempt.world_size, "fit": fit},
        ),
        EndAttempt(outcome=AttemptOutcome.NODE_LOST, step=job.step),
        *_enter_recovery(job, facts, reason=f"node lost before placement ({names})"),
    ]


def _failed_on_a_shrunk_cluster(
    job: JobView, attempt: AttemptView, facts: Facts, error: WorkerError, step: int, fit: int
) -> list[Action]:
    """An attempt that failed before it was placed (its bundles never reserved, a process
    never started) on a cluster that no longer holds its world size: the cluster shrank
    under it (a node died or left, one is draining), which is no fault of the job's. No
    restart counted, no backoff: the relaunch is at the size that fits, smaller than this
    one, so a shrinking cluster cannot loop here. The release before placement
    (`_outgrown_before_placement`) usually comes first; this is for what it cannot see: a
    node that left while no scheduler watched (a restarted one), or one draining since the
    launch. Where the world size still fits, the failure counts as any other (Ray, or the
    job's workload, failed it: `failure.max_restarts` bounds the retries)."""
    return [
        EndAttempt(outcome=AttemptOutcome.FAILED, error=error, step=step, count_restart=False),
        RecordEvent(
            kind=EventKind.CAPACITY,
            reason=f"attempt {attempt.number} failed before it was placed and {fit} of its "
            f"{attempt.world_size} workers fit now: the cluster shrank, no restart counted",
        ),
        *_enter_recovery(job, facts, reason=f"relaunching where it fits after: {error.summary()}"),
    ]


def _on_drain(
    job: JobView,
    attempt: AttemptView,
    facts: Facts,
    report: DriverReport,
    draining: dict[str, list[int]],
) -> list[Action]:
    """A running job with ranks on nodes that are going away. Where the rest of the cluster
    holds its min_workers it leaves them at the next step boundary, its state handed on
    in the survivors' memory (no checkpoint to wait for, no failure, no restart counted).
    Otherwise, like a pod a disruption budget protects, it saves a checkpoint and trains
    on there until the earliest deadline, then stops with a checkpoint and waits."""
    names = ", ".join(n[:12] for n in draining)
    size = facts.target(job.spec)
    if size:
        step = progress(job, report)
        noted: list[Action] = [
            RecordEvent(
                kind=EventKind.NODE_DRAINING,
                reason=f"node {node[:12]} {_going(facts.draining[node])} (ranks {ranks}): "
                f"leaving it after step {step}",
                details={
                    "node_id": node,
                    "ranks": ranks,
                    "step": step,
                    "source": facts.draining[node].source.value,
                    "reason": facts.draining[node].reason,
                    "deadline": facts.draining[node].deadline,
                },
            )
            for node, ranks in draining.items()
        ]
        return [
            *noted,
            SendControl(control=Control.LEAVE),
            Transition(
                to=JobState.RESIZING,
                reason=f"node {names} {_going(*(facts.draining[n] for n in draining))}: "
                f"leaving it, {attempt.world_size} -> {size} workers",
                world_size=size,
            ),
            MarkSpare(since=None),
        ]
    shape = WorkerShape.of(job.spec)
    fit = facts.free.workers_that_fit(shape.cpus, shape.gpus)
    need = job.spec.min_world_size
    deadlines = [d for n in draining if (d := facts.draining[n].deadline) is not None]
    if deadlines and facts.now >= min(deadlines):
        return [
            SendControl(control=Control.STOP),
            Transition(
                to=JobState.RESIZING,
                reason=f"node {names} drain deadline passed: checkpointing and stopping "
                f"(needs {need} workers, {fit} fit elsewhere)",
            ),
        ]
    then = "stops with a checkpoint at the drain deadline" if deadlines else "runs on there"
    reason = f"{DRAIN_WAIT}node {names} draining, needs {need} workers, {fit} fit ({then})"
    if job.state_reason == reason:
        return []  # checkpointed already; no growth while it waits to leave
    return [
        SendControl(control=Control.CHECKPOINT, why=f"checkpoint now (node {names} draining)"),
        SetReason(reason=reason),
    ]


def _on_driver_status(
    job: JobView, attempt: AttemptView, facts: Facts, report: DriverReport
) -> list[Action]:
    status = report.status
    if status == DriverStatus.RUNNING:
        return _on_running(job, attempt, facts, report)
    if status == DriverStatus.SUCCEEDED:
        return [
            EndAttempt(outcome=AttemptOutcome.SUCCEEDED, step=progress(job, report)),
            Transition(to=JobState.SUCCEEDED, reason=f"reached step {progress(job, report)}"),
        ]
    if status == DriverStatus.STOPPED:
        ended = [EndAttempt(outcome=AttemptOutcome.STOPPED, step=progress(job, report))]
        return ended + _relaunch(job, facts)
    if status in (DriverStatus.FAILED, DriverStatus.LOST):
        return _on_failure(job, attempt, facts, report)
    return []  # STARTING: the worker group is still coming up


def _on_running(
    job: JobView, attempt: AttemptView, facts: Facts, report: DriverReport
) -> list[Action]:
    if job.state == JobState.RESIZING and attempt.stop_requested:
        # The attempt we asked to stop trains on until its checkpoint. Ask again if the
        # request never reached its driver (a control is sent once, after the commit).
        if report.stopping:
            return []
        leaving = draining_ranks(attempt.nodes, facts.draining) and facts.target(job.spec)
        return [SendControl(control=Control.LEAVE if leaving else Control.STOP)]
    if job.state == JobState.RUNNING and (job.state_reason or "").startswith(DRAIN_WAIT):
        # It waited to leave a draining node that is back (undrained, or gone from Ray's
        # drains): say so, once.
        return [SetReason(reason=f"drain over: training on at world size {attempt.world_size}")]
    if job.state != JobState.RUNNING:
        if report.resumed_from_step is not None:
            why = f"resumed from step {report.resumed_from_step} at world size {attempt.world_size}"
        else:
            why = f"training started at world size {attempt.world_size}"
        return [Transition(to=JobState.RUNNING, reason=why, world_size=attempt.world_size)]
    return _consider_growth(job, attempt, facts)


def _consider_growth(job: JobView, attempt: AttemptView, facts: Facts) -> list[Action]:
    actions = _growth(job, attempt, facts)
    if any(isinstance(a, SetReason | Transition) for a in actions):
        return [a for a in actions if a != SetReason(reason=job.state_reason or "")]
    if (job.state_reason or "").startswith(GROW_WAIT):
        # It said it would grow, and will not now (the capacity went, a queued job wants
        # it): say so, once.
        actions.append(SetReason(reason=f"training on at world size {attempt.world_size}"))
    return actions


def _growth(job: JobView, attempt: AttemptView, facts: Facts) -> list[Action]:
    current = attempt.world_size
    possible = facts.target(job.spec)
    if possible <= current:
        return [MarkSpare(since=None)] if facts.spare_since is not None else []
    if facts.spare_since is None:
        return [MarkSpare(since=facts.now)]
    if not should_grow(
        current=current,
        possible=possible,
        spare_since=facts.spare_since,
        now=facts.now,
        grow_interval_s=facts.policy.grow_interval_s,
        others_waiting=facts.others_waiting,
    ):
        return []
    if facts.warm_target(job.spec) < possible:
        # The new nodes' processes are still starting: the job trains on meanwhile rather
        # than stop and wait for them (seconds of lost training per grow on a busy node).
        return [SetReason(reason=f"{GROW_WAIT} ({current} -> {possible} workers)")]
    return [
        SendControl(control=Control.STOP),
        Transition(
            to=JobState.RESIZING,
            reason=f"capacity for {possible} workers: growing {current} -> {possible}",
            world_size=possible,
            details=grow_joins(
                facts.free.nodes,
                used=attempt.nodes,
                attempt_started=attempt.started_at,
                now=facts.now,
            )
            or None,
        ),
        MarkSpare(since=None),
    ]


def _on_failure(
    job: JobView, attempt: AttemptView, facts: Facts, report: DriverReport
) -> list[Action]:
    lost_driver = report.status == DriverStatus.LOST
    error = report.error or WorkerError(
        type="DriverLost" if lost_driver else "WorkerGroupError",
        kind=ErrorKind.DRIVER_LOST if lost_driver else ErrorKind.GROUP_FAILED,
        message="driver lost" if lost_driver else "worker group failed",
    )
    step = progress(job, report)
    if error.kind == ErrorKind.CONFIGURATION:
        # Deterministic: every restart would fail the same way, after a backoff each.
        return [
            EndAttempt(outcome=AttemptOutcome.FAILED, error=error, step=step, count_restart=False),
            Transition(
                to=JobState.FAILED,
                reason=f"{error.summary()} (a configuration error: not retried)",
            ),
        ]
    placed = bool(attempt.nodes) or report.placement is not None
    if not lost_driver and not placed:
        fit = workers_that_fit_now(job, facts)
        if fit < attempt.world_size:
            return _failed_on_a_shrunk_cluster(job, attempt, facts, error, step, fit)
    decision = decide_failure(
        signature=error.signature,
        step=step,
        restarts=job.restarts,
        max_restarts=job.spec.failure.max_restarts,
        recent_failures=job.failures,
        backoff_s=facts.policy.restart_backoff_s,
    )
    ended = EndAttempt(
        outcome=AttemptOutcome.FAILED,
        error=error,
        step=step,
        count_restart=decision.action == FailureAction.RETRY,
    )
    if decision.action == FailureAction.GIVE_UP:
        return [ended, Transition(to=JobState.FAILED, reason=decision.reason)]
    restarts = job.restarts + 1
    until = facts.now + decision.delay_s
    reason = f"restart {restarts}/{job.spec.failure.max_restarts} after: {error.summary()}"
    recovering = replace(job, restarts=restarts)
    return [
        ended,
        DelayRelaunch(until=until),
        *_enter_recovery(recovering, replace(facts, relaunch_not_before=until), reason=reason),
    ]


def _enter_recovery(job: JobView, facts: Facts, *, reason: str) -> list[Action]:
    """The attempt has ended badly: RECOVERING (if not already), then relaunch if possible."""
    if job.state == JobState.RECOVERING:  # a relaunched attempt failed in turn
        first: Action = SetReason(reason=reason)
    else:
        target = _relaunch_size(job, facts)
        first = Transition(to=JobState.RECOVERING, reason=reason, world_size=target or None)
    return [first, *_relaunch(replace(job, state=JobState.RECOVERING), facts)]


def _relaunch_size(job: JobView, facts: Facts) -> int:
    """The size the next attempt starts at: the largest that fits on nodes whose warm
    processes are up, when that holds the job's min (a node that joined a moment ago, such
    as a lost one's replacement, would hold the recovery for its process's start: the job
    resumes without it and grows onto it once it is warm), else the largest that fits."""
    warm = facts.warm_target(job.spec)
    return warm if warm >= job.spec.min_world_size else facts.target(job.spec)


def _relaunch(job: JobView, facts: Facts) -> list[Action]:
    """Start the next attempt at the largest size that fits (`_relaunch_size`), or wait
    below min."""
    if facts.now < facts.relaunch_not_before:
        return []
    size = _relaunch_size(job, facts)
    if size == 0:
        return _wait_below_min(job, facts)
    actions: list[Action] = []
    if job.below_min_since is not None:
        waited = facts.now - job.below_min_since
        actions.append(
            StopWaiting(reason=f"capacity for {size} workers after waiting {waited:.0f}s")
        )
    return [*actions, *start(job, size, facts), MarkSpare(since=None)]


def start(job: JobView, size: int, facts: Facts) -> list[Action]:
    """Start an attempt at `size`; an `auto` job first plans which strategy it runs there
    (made again at every launch: the world size may have changed), and says so. It avoids
    the draining nodes and those gone lately: one a driver found dead may still be alive
    to Ray for its health checks' 15 s, and a placement group Ray prepares there never
    answers, and once removed can leak bundles and stop Ray placing any later group
    (ray#64693; the chaos campaign's fsdp job was lost so)."""
    avoid = tuple(sorted({*facts.draining, *facts.nodes_gone}))
    if job.spec.strategy.kind != StrategyKind.auto:
        return [StartAttempt(world_size=size, avoid_nodes=avoid)]
    chosen = choose_for_auto(job.spec, size, facts.worker_memory_bytes)
    details: dict[str, Any] = {
        "world_size": size,
        "strategy": chosen.strategy.value,
        "tensor_parallel": chosen.tensor_parallel,
    }
    if chosen.plan is not None:
        details["rank_bytes"] = {r.label: r.total for r in chosen.plan.rows if r.total}
        details["usable_bytes"] = chosen.plan.usable_bytes
    return [
        RecordEvent(
            kind=EventKind.PLAN, reason=f"at world size {size}: {chosen.why}", details=details
        ),
        StartAttempt(
            world_size=size,
            strategy=chosen.strategy,
            tensor_parallel=chosen.tensor_parallel,
            avoid_nodes=avoid,
        ),
    ]


def _wait_below_min(job: JobView, facts: Facts) -> list[Action]:
    shape = WorkerShape.of(job.spec)
    fit = facts.free.workers_that_fit(shape.cpus, shape.gpus)
    need = job.spec.min_world_size
    if facts.worker_limit is not None and facts.worker_limit < need <= fit:
        reason = (
            f"waiting below min: tenant {job.owner}'s quota leaves {facts.worker_limit} "
            f"workers, the job needs {need}"
        )
    else:
        reason = f"waiting below min: {fit} workers fit, the job needs {need}"
    if facts.draining:
        reason += f" (draining: node {', '.join(n[:12] for n in sorted(facts.draining))})"
    if job.below_min_since is None:
        return [StartWaiting(reason=reason, at=facts.now)]
    waited = facts.now - job.below_min_since
    timeout = facts.policy.below_min_timeout_s
    if waited > timeout:
        return [
            Transition(
                to=JobState.FAILED,
                reason=f"below min_workers for {waited:.0f}s (timeout {timeout:g}s): {reason}",
            )
        ]
    return []


def progress(job: JobView, report: DriverReport | None) -> int:
    """The job's step once this report is persisted."""
    steps = [m.step for m in report.metrics] if report is not None else []
    return max([job.step, *steps])


def lost_ranks(nodes: Sequence[str], alive: frozenset[str]) -> dict[str, list[int]]:
    """node id -> ranks (of `nodes`, the node of each rank) on nodes no longer alive."""
    lost: dict[str, list[int]] = {}
    for rank, node in enumerate(nodes):
        if node not in alive:
            lost.setdefault(node, []).append(rank)
    return lost


def _going(*drains: NodeDrain) -> str:
    """How a node the job leaves is going away: draining, or kept off by this job alone."""
    if all(d.source == DrainSource.STRAGGLER for d in drains):
        return "kept off (a straggler ran there: failure.stragglers evict)"
    return "draining"


def draining_ranks(nodes: Sequence[str], draining: Mapping[str, NodeDrain]) -> dict[str, list[int]]:
    """node id -> ranks (of `nodes`, the node of each rank) on nodes that are draining."""
    found: dict[str, list[int]] = {}
    for rank, node in enumerate(nodes):
        if node in draining:
            found.setdefault(node, []).append(rank)
    return found


def allocation_after(job: JobView, actions: Sequence[Action]) -> Allocation | None:
    """What the job holds once `actions` are carried out: the scheduler charges it to the
    cluster before deciding about the next job."""
    shape = WorkerShape.of(job.spec)
    attempt = job.live_attempt
    held = (
        Allocation(shape=shape, count=attempt.world_size, nodes=attempt.nodes)
        if attempt is not None
        else None
    )
    for action in actions:
        if isinstance(action, EndAttempt):
            held = None
        elif isinstance(action, StartAttempt):
            held = Allocation(shape=shape, count=action.world_size)
        elif (
            isinstance(action, Transition)
            and action.to == JobState.RESIZING
            and held is not None
            and action.world_size
        ):
            # Growing: the extra workers are promised to this job already.
            held = replace(held, count=action.world_size)
        elif isinstance(action, Transition) and action.to.is_terminal:
            held = None
    return held


# Admission (which queued jobs start, once per pass, fair between tenants): service/admission.py
# ---------------------------------------------------------------------------------------


# ---------------------------------------------------------------------------------------
# Failures: retry or give up
# ---------------------------------------------------------------------------------------


class FailureAction(str, Enum):
    RETRY = "retry"
    GIVE_UP = "give_up"


@dataclass(frozen=True, kw_only=True, slots=True)
class FailureDecision:
    action: FailureAction
    reason: str
    delay_s: float = 0.0


#: The same error at the same step this many times in a row fails the job: a restart
#: would only repeat it.
REPEATED_FAILURE_LIMIT = 3
MAX_BACKOFF_S = 60.0


def decide_failure(
    *,
    signature: str,
    step: int,
    restarts: int,
    max_restarts: int,
    recent_failures: Sequence[PastFailure],
    backoff_s: float,
) -> FailureDecision:
    """After an attempt failed (worker error, lost driver): retry after a backoff, or give
    up. Node loss never comes here: it is the cluster's fault, not the job's.

    `recent_failures` are the job's earlier failed attempts, oldest first.
    """
    streak = 1
    for prev in reversed(recent_failures):
        if prev.signature == signature and prev.step == step:
            streak += 1
        else:
            break
    if streak >= REPEATED_FAILURE_LIMIT:
        return FailureDecision(
            action=FailureAction.GIVE_UP,
            reason=f"the same error at step {step} {streak} times in a row: {signature}",
        )
    if restarts >= max_restarts:
        return FailureDecision(
            action=FailureAction.GIVE_UP,
            reason=f"gave up after {restarts} restarts (failure.max_restarts): {signature}",
        )
    # Exponential backoff, capped: a crash loop must not hammer the cluster.
    delay = min(backoff_s * (2 ** (streak - 1)), MAX_BACKOFF_S)
    return FailureDecision(action=FailureAction.RETRY, reason=signature, delay_s=delay)


# ---------------------------------------------------------------------------------------
# Growth
# ---------------------------------------------------------------------------------------


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
