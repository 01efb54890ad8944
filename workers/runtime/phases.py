"""An attempt's start and run as phases: a pure transition function over observed facts,
table-tested (tests/unit/test_attempt_phases.py).

wait for the old group -> reserve -> (GPU processes back) -> start -> form -> run -> done

`advance(state, facts)` answers the next state and the actions that move the attempt
there; it never waits. The runtime's one attempt loop (`elastrain.workers.runtime.attempts`)
calls it through each attempt's driver (`elastrain.workers.runtime.driver`) whenever
something happened (an object ref came back, a launch, a release, a pool upkeep pass) or a
timer of `wake_at` is due, and the driver carries the actions out. The timeline marks the
control plane stores are among the actions, so the phases of a start are those of
`elastrain.contracts.messages.Phase` whatever drives them.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from enum import Enum

from elastrain.contracts.messages import Phase

#: How long a new attempt waits for the job's previous processes to let go (they hold its
#: state); after that it takes other processes and a checkpoint.
OLD_GROUP_GRACE_S = 5.0
#: How long to try a placement on the preferred nodes before placing anywhere, asking
#: again after PLACEMENT_RETRY_S, then twice as long each time up to PLACEMENT_RETRY_MAX_S.
#: The resources are often being freed right now (the old attempt's bundles); Ray retries a
#: pending placement group only about every second, while a new request is placed at once.
#: (The driver replaces an ask only while Ray is not preparing its bundles: `being_placed`.)
PREFERRED_PLACEMENT_S = 1.5
PLACEMENT_RETRY_S = 0.15
PLACEMENT_RETRY_MAX_S = 2.0
#: How long to wait for Ray to reserve the attempt's resources at all.
PLACEMENT_TIMEOUT_S = 120.0
#: How long a GPU rank waits for a process owning a GPU of its bundle's node to come back
#: from an attempt that is over (one whose job ended or shrank lets go at its next step
#: boundary), before a second process is started on that GPU beside it.
GPU_RETURN_GRACE_S = 15.0
#: How long a process may take to start when no warm one is left on a node.
START_TIMEOUT_S = 300.0
#: How long rank 0's process may take to open the group's store.
STORE_TIMEOUT_S = 30.0
#: After the first rank's part ended badly, how long to wait for the others' outcomes
#: (they are told to let go at once and do within milliseconds; a dead process is known to
#: Ray within a second or two).
OUTCOME_GRACE_S = 15.0
#: RUN: how often the ranks' processes are asked how far they got (the hang watch,
#: `elastrain.workers.runtime.hangs`); also how often the driver wakes to probe the
#: raylets of its ranks' nodes (`elastrain.workers.runtime.liveness`).
POLL_S = 0.5


class Step(str, Enum):
    OLD_GROUP = "old_group"  # the job's previous processes still run: they hold its state
    RESERVE = "reserve"  # a placement group asked of Ray, not placed yet
    GPUS = "gpus"  # placed; a bundle's node lacks a GPU process still lent to an attempt over
    START = "start"  # processes chosen; one is still starting
    FORM = "form"  # rank 0's process opening the group's store
    RUN = "run"  # every rank handed its part; collecting their outcomes
    DONE = "done"  # the verdict is given (a straggler may still come back later)


class Where(str, Enum):
    PREFERRED = "preferred"  # on the nodes of the processes holding the job's newest state
    ANYWHERE = "anywhere"  # anywhere but the draining nodes


@dataclass(frozen=True, kw_only=True, slots=True)
class State:
    step: Step = Step.OLD_GROUP
    deadline: float | None = None
    """When the current step's wait is given up (monotonic; None: not started yet)."""
    where: Where | None = None
    """RESERVE: where the current ask places the bundles."""
    ask_until: float = 0.0
    """RESERVE: when the current ask is replaced by a new one."""
    retry_s: float = PLACEMENT_RETRY_S
    """RESERVE: how long the current ask was given."""
    grace_until: float | None = None
    """RUN: when the ranks still out are given up (set by the first that ended badly)."""
    poll_at: float | None = None
    """RUN: when the ranks are next asked how far they got (None: no more polls)."""
    hung: bool = False
    """RUN: the hang watch found hung ranks; the attempt is over."""

    @property
    def wake_at(self) -> float | None:
        """When `advance` must look again though nothing happened (monotonic)."""
        if self.step == Step.RESERVE:
            return self.ask_until
        if self.step == Step.RUN:
            due = [t for t in (self.grace_until, self.poll_at) if t is not None]
            return min(due) if due else None
        return None if self.step == Step.DONE else self.deadline


@dataclass(frozen=True, kw_only=True, slots=True)
class Facts:
    """What the driver observed just now (each field matters in the steps it names)."""

    now: float
    """The monotonic clock."""
    wall: float = 0.0
    """The wall clock (timeline marks)."""
    released: bool = False
    old_group_busy: int = 0
    """OLD_GROUP: the job's processes still running another attempt."""
    old_group_left_at: float = 0.0
    """OLD_GROUP: when the last of the job's processes let go (wall clock), or 0."""
    detected_at: float = 0.0
    """When the control plane decided on this attempt (wall clock): no phase is earlier."""
    preferred: bool = False
    """OLD_GROUP: an idle process holds the job's state on a node it may use."""
    placed: bool = False
    """RESERVE: the current ask is placed."""
    gpu_processes: bool = True
    """GPUS: every bundle's node has a GPU process for it, idle or starting."""
    processes_up: bool = False
    """START: every chosen process answered once."""
    store_open: bool = False
    """FORM: rank 0's process answered with the store's port."""
    ranks: int = 0
    """RUN: the group's size."""
    outcomes: int = 0
    """RUN: ranks whose outcome is known."""
    bad: bool = False
    """RUN: a rank's part ended badly (an error, an abort, its process died)."""
    hung: bool = False
    """RUN: the hang watch names hung ranks (`elastrain.workers.runtime.hangs`)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Mark:
    phase: Phase
    at: float | None = None
    """None: now."""
    detail: str | None = None
    """None: the driver says what it did (PLACED: the processes it chose)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Ask:
    """Drop the current ask, if any, and ask Ray for the placement group again."""

    where: Where


@dataclass(frozen=True, slots=True)
class Drop:
    """Remove the placement group asked for."""


@dataclass(frozen=True, slots=True)
class Choose:
    """Take a process on each bundle's node, holders of the job's state first."""


@dataclass(frozen=True, slots=True)
class OpenStore:
    """Ask rank 0's process to open the group's store."""


@dataclass(frozen=True, slots=True)
class Run:
    """Hand every rank its part (and rank 0 the controls asked for meanwhile)."""


@dataclass(frozen=True, slots=True)
class Poll:
    """Ask every rank's process how far it got (those that answered the last ask)."""


@dataclass(frozen=True, slots=True)
class AbortHung:
    """The attempt hung: stop the hung ranks' processes, tell the others to let go."""


@dataclass(frozen=True, slots=True)
class LetGo:
    """A rank ended badly: tell the ranks still out to let go now, not at the grace's end.
    A peer blocked in a collective on it learns of it only when its connection breaks, and
    a connection that went silent (a cut link, a hung NIC) breaks only at TCP's timeout;
    the release frees it at once, holding the job's state."""


@dataclass(frozen=True, slots=True)
class AbortStragglers:
    """Tell the ranks still out to let go; the pool takes them back when they do."""


@dataclass(frozen=True, slots=True)
class Verdict:
    """Judge the outcomes: the attempt is over."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Fail:
    """The attempt is over before it ran: hand back what it took."""

    type: str
    message: str


Action = (
    Mark
    | Ask
    | Drop
    | Choose
    | OpenStore
    | Run
    | Poll
    | AbortHung
    | LetGo
    | AbortStragglers
    | Verdict
    | Fail
)

RELEASED = Fail(type="RuntimeError", message="released before it started")


def advance(state: State, f: Facts) -> tuple[State, list[Action]]:
    """The state after the facts `f` and what to do to get there: one step at a time (the
    driver observes again after acting, and calls again while the state changes)."""
    s = state.step
    if s == Step.DONE:
        return state, []
    if f.released and s != Step.RUN:  # (a running group is told to let go: collected)
        return replace(state, step=Step.DONE), [RELEASED]
    if s == Step.OLD_GROUP:
        return _old_group(state, f)
    if s == Step.RESERVE:
        return _reserve(state, f)
    if s == Step.GPUS:
        return _choose(state, f) if f.gpu_processes or _due(state, f) else (state, [])
    if s == Step.START:
        if f.processes_up:
            after = replace(state, step=Step.FORM, deadline=f.now + STORE_TIMEOUT_S)
            return after, [Mark(phase=Phase.PROCESSES_UP), OpenStore()]
        if _due(state, f):
            return _fail(state, f"a process did not start in {START_TIMEOUT_S:g}s")
        return state, []
    if s == Step.FORM:
        if f.store_open:
            return replace(state, step=Step.RUN, deadline=None, poll_at=f.now + POLL_S), [Run()]
        if _due(state, f):
            return _fail(state, f"rank 0 did not open the group's store in {STORE_TIMEOUT_S:g}s")
        return state, []
    return _run(state, f)


def _due(state: State, f: Facts) -> bool:
    return state.deadline is not None and f.now >= state.deadline


def _old_group(state: State, f: Facts) -> tuple[State, list[Action]]:
    if state.deadline is None:  # just launched: the wait begins
        return replace(state, deadline=f.now + OLD_GROUP_GRACE_S), []
    if f.old_group_busy == 0:
        mark = Mark(phase=Phase.OLD_GROUP_STOPPED, at=max(f.old_group_left_at, f.detected_at),
                    detail="")  # fmt: skip
    elif f.now >= state.deadline:
        mark = Mark(
            phase=Phase.OLD_GROUP_STOPPED,
            at=max(f.wall, f.detected_at),
            detail=f"{f.old_group_busy} process(es) still in the old group after "
            f"{OLD_GROUP_GRACE_S:g}s: not waited for",
        )
    else:
        return state, []
    where = Where.PREFERRED if f.preferred else Where.ANYWHERE
    return _ask(state, f, where, first=True), [mark, Ask(where=where)]


def _ask(state: State, f: Facts, where: Where, *, first: bool) -> State:
    """The state of a new ask: the first of `where` gets its own deadline and the shortest
    wait; a repeat doubles the wait (never past the deadline)."""
    if first:
        window = PREFERRED_PLACEMENT_S if where == Where.PREFERRED else PLACEMENT_TIMEOUT_S
        deadline, retry = f.now + window, PLACEMENT_RETRY_S
    else:
        deadline = state.deadline if state.deadline is not None else f.now
        retry = min(state.retry_s * 2, PLACEMENT_RETRY_MAX_S)
    return replace(
        state, step=Step.RESERVE, where=where, deadline=deadline, retry_s=retry,
        ask_until=min(f.now + retry, deadline),
    )  # fmt: skip


def _reserve(state: State, f: Facts) -> tuple[State, list[Action]]:
    if f.placed:
        return replace(state, step=Step.GPUS, deadline=f.now + GPU_RETURN_GRACE_S), []
    if f.now < state.ask_until:
        return state, []
    if not _due(state, f):
        where = state.where or Where.ANYWHERE
        return _ask(state, f, where, first=False), [Ask(where=where)]
    if state.where == Where.PREFERRED:  # no room there in time: anywhere
        return _ask(state, f, Where.ANYWHERE, first=True), [Ask(where=Where.ANYWHERE)]
    message = f"Ray could not reserve the attempt's bundles in {PLACEMENT_TIMEOUT_S:g}s"
    return _fail(state, message, type_="RuntimeError", drop=True)


def _choose(state: State, f: Facts) -> tuple[State, list[Action]]:
    return replace(state, step=Step.START, deadline=f.now + START_TIMEOUT_S), [
        Choose(),
        Mark(phase=Phase.PLACED),
    ]


def _run(state: State, f: Facts) -> tuple[State, list[Action]]:
    if f.outcomes >= f.ranks:
        return replace(state, step=Step.DONE, grace_until=None, poll_at=None), [Verdict()]
    if state.grace_until is not None and f.now >= state.grace_until:
        done = replace(state, step=Step.DONE, grace_until=None, poll_at=None)
        return done, [AbortStragglers(), Verdict()]
    if f.hung and not state.hung:  # the others get the grace to let go
        after = replace(state, hung=True, poll_at=None, grace_until=f.now + OUTCOME_GRACE_S)
        return after, [AbortHung()]
    if f.bad and state.grace_until is None:  # polls (and the raylet probes) go on
        return replace(state, grace_until=f.now + OUTCOME_GRACE_S), [LetGo()]
    if state.poll_at is not None and f.now >= state.poll_at:
        return replace(state, poll_at=f.now + POLL_S), [Poll()]
    return state, []


def _fail(
    state: State, message: str, *, type_: str = "GetTimeoutError", drop: bool = False
) -> tuple[State, list[Action]]:
    actions: list[Action] = [Drop()] if drop else []
    return replace(state, step=Step.DONE), [*actions, Fail(type=type_, message=message)]
