"""An attempt's phases (`elastrain.workers.runtime.phases`), row by row, and the loop that
drives every attempt (`elastrain.workers.runtime.attempts`): woken, never sleeping."""

from __future__ import annotations

import threading
import time
from dataclasses import replace

import pytest

from elastrain.contracts.group import RunOutcome
from elastrain.contracts.messages import DriverStatus, ErrorKind, Phase, WorkerError
from elastrain.workers.runtime.attempts import AttemptLoop
from elastrain.workers.runtime.phases import (
    GPU_RETURN_GRACE_S,
    OLD_GROUP_GRACE_S,
    OUTCOME_GRACE_S,
    PLACEMENT_RETRY_MAX_S,
    PLACEMENT_RETRY_S,
    PLACEMENT_TIMEOUT_S,
    POLL_S,
    PREFERRED_PLACEMENT_S,
    RELEASED,
    START_TIMEOUT_S,
    STORE_TIMEOUT_S,
    AbortHung,
    AbortStragglers,
    Action,
    Ask,
    Choose,
    Drop,
    Facts,
    Fail,
    LetGo,
    Mark,
    OpenStore,
    Poll,
    Run,
    State,
    Step,
    Verdict,
    Where,
    advance,
)
from elastrain.workers.runtime.verdict import ended_badly, process_died, stuck, verdict

T = 1000.0  # the monotonic clock at the row's state
WALL = 5000.0
DETECTED = 4990.0


def facts(now: float = T, **kw: object) -> Facts:
    return Facts(now=now, wall=WALL, detected_at=DETECTED, **kw)  # type: ignore[arg-type]


def at(step: Step, deadline: float | None = T + 1, **kw: object) -> State:
    return State(step=step, deadline=deadline, **kw)  # type: ignore[arg-type]


STOPPED_NOW = Mark(phase=Phase.OLD_GROUP_STOPPED, at=DETECTED, detail="")
RESERVING = State(step=Step.RESERVE, where=Where.PREFERRED, deadline=T + PREFERRED_PLACEMENT_S,
                  ask_until=T + PLACEMENT_RETRY_S, retry_s=PLACEMENT_RETRY_S)  # fmt: skip


@pytest.mark.parametrize(
    ("state", "observed", "after", "actions"),
    [
        # launched: the old group's wait begins
        (State(), facts(), at(Step.OLD_GROUP, T + OLD_GROUP_GRACE_S), []),
        # nothing of the job runs: stopped at once (not before it was detected), placed
        # on the nodes holding its state
        (
            at(Step.OLD_GROUP),
            facts(preferred=True),
            RESERVING,
            [STOPPED_NOW, Ask(where=Where.PREFERRED)],
        ),
        # nobody holds its state: anywhere, for the whole placement timeout
        (
            at(Step.OLD_GROUP),
            facts(old_group_left_at=WALL - 1),
            State(
                step=Step.RESERVE,
                where=Where.ANYWHERE,
                deadline=T + PLACEMENT_TIMEOUT_S,
                ask_until=T + PLACEMENT_RETRY_S,
                retry_s=PLACEMENT_RETRY_S,
            ),
            [
                Mark(phase=Phase.OLD_GROUP_STOPPED, at=WALL - 1, detail=""),
                Ask(where=Where.ANYWHERE),
            ],
        ),
        # the old group still runs: wait
        (at(Step.OLD_GROUP), facts(old_group_busy=2), at(Step.OLD_GROUP), []),
        # ... not past the grace: placed without it, and the timeline says so
        (
            at(Step.OLD_GROUP),
            facts(T + 1, old_group_busy=2, preferred=True),
            State(
                step=Step.RESERVE,
                where=Where.PREFERRED,
                deadline=T + 1 + PREFERRED_PLACEMENT_S,
                ask_until=T + 1 + PLACEMENT_RETRY_S,
                retry_s=PLACEMENT_RETRY_S,
            ),
            [
                Mark(
                    phase=Phase.OLD_GROUP_STOPPED,
                    at=WALL,
                    detail="2 process(es) still in the old group after 5s: not waited for",
                ),
                Ask(where=Where.PREFERRED),
            ],
        ),
        # released before it ran: over
        (at(Step.OLD_GROUP), facts(released=True), at(Step.DONE), [RELEASED]),
        (
            RESERVING,
            facts(released=True),
            replace(RESERVING, step=Step.DONE),
            [RELEASED],
        ),
        (at(Step.FORM), facts(released=True, store_open=True), at(Step.DONE), [RELEASED]),
        # placed: then the GPU processes are waited for
        (
            RESERVING,
            facts(placed=True),
            replace(RESERVING, step=Step.GPUS, deadline=T + GPU_RETURN_GRACE_S),
            [],
        ),
        # not placed yet, the ask not given up yet: wait
        (RESERVING, facts(T + 0.1), RESERVING, []),
        # the ask's wait is over: ask again, waiting twice as long
        (
            RESERVING,
            facts(T + PLACEMENT_RETRY_S),
            replace(
                RESERVING,
                retry_s=2 * PLACEMENT_RETRY_S,
                ask_until=T + PLACEMENT_RETRY_S + 2 * PLACEMENT_RETRY_S,
            ),
            [Ask(where=Where.PREFERRED)],
        ),
        # ... never past the step's deadline, never longer than the longest wait
        (
            State(
                step=Step.RESERVE,
                where=Where.ANYWHERE,
                deadline=T + 1.0,
                ask_until=T,
                retry_s=PLACEMENT_RETRY_MAX_S,
            ),
            facts(),
            State(
                step=Step.RESERVE,
                where=Where.ANYWHERE,
                deadline=T + 1.0,
                ask_until=T + 1.0,
                retry_s=PLACEMENT_RETRY_MAX_S,
            ),
            [Ask(where=Where.ANYWHERE)],
        ),
        # no room on the preferred nodes in time: anywhere
        (
            RESERVING,
            facts(T + PREFERRED_PLACEMENT_S),
            State(
                step=Step.RESERVE,
                where=Where.ANYWHERE,
                deadline=T + PREFERRED_PLACEMENT_S + PLACEMENT_TIMEOUT_S,
                ask_until=T + PREFERRED_PLACEMENT_S + PLACEMENT_RETRY_S,
                retry_s=PLACEMENT_RETRY_S,
            ),
            [Ask(where=Where.ANYWHERE)],
        ),
        # nowhere in time: over
        (
            State(step=Step.RESERVE, where=Where.ANYWHERE, deadline=T, ask_until=T),
            facts(),
            State(step=Step.DONE, where=Where.ANYWHERE, deadline=T, ask_until=T),
            [
                Drop(),
                Fail(
                    type="RuntimeError",
                    message="Ray could not reserve the attempt's bundles in 120s",
                ),
            ],
        ),
        # GPU processes back (or a CPU job): choose, then mark PLACED
        (
            at(Step.GPUS),
            facts(),
            at(Step.START, T + START_TIMEOUT_S),
            [Choose(), Mark(phase=Phase.PLACED)],
        ),
        (at(Step.GPUS), facts(gpu_processes=False), at(Step.GPUS), []),
        (
            at(Step.GPUS),
            facts(T + 1, gpu_processes=False),
            at(Step.START, T + 1 + START_TIMEOUT_S),
            [Choose(), Mark(phase=Phase.PLACED)],
        ),
        # processes up: rank 0 opens the store
        (
            at(Step.START),
            facts(processes_up=True),
            at(Step.FORM, T + STORE_TIMEOUT_S),
            [Mark(phase=Phase.PROCESSES_UP), OpenStore()],
        ),
        (at(Step.START), facts(), at(Step.START), []),
        (
            at(Step.START),
            facts(T + 1),
            at(Step.DONE),
            [Fail(type="GetTimeoutError", message="a process did not start in 300s")],
        ),
        # the store open: run
        (at(Step.FORM), facts(store_open=True), at(Step.RUN, None, poll_at=T + POLL_S), [Run()]),
        (
            at(Step.FORM),
            facts(T + 1),
            at(Step.DONE),
            [Fail(type="GetTimeoutError", message="rank 0 did not open the group's store in 30s")],
        ),
        # running: every outcome in, the verdict
        (at(Step.RUN, None), facts(ranks=2, outcomes=1), at(Step.RUN, None), []),
        (
            at(Step.RUN, None),
            facts(ranks=2, outcomes=2, bad=True),
            at(Step.DONE, None),
            [Verdict()],
        ),
        # a release while running changes nothing here: the ranks are told to let go
        (at(Step.RUN, None), facts(ranks=2, outcomes=0, released=True), at(Step.RUN, None), []),
        # the first bad outcome tells the others to let go and starts their grace; past
        # it, they are given up
        (
            at(Step.RUN, None),
            facts(ranks=3, outcomes=1, bad=True),
            at(Step.RUN, None, grace_until=T + OUTCOME_GRACE_S),
            [LetGo()],
        ),
        (
            at(Step.RUN, None, grace_until=T + 1),
            facts(ranks=3, outcomes=2, bad=True),
            at(Step.RUN, None, grace_until=T + 1),
            [],
        ),
        (
            at(Step.RUN, None, grace_until=T),
            facts(ranks=3, outcomes=2, bad=True),
            at(Step.DONE, None),
            [AbortStragglers(), Verdict()],
        ),
        # the hang watch: polls every POLL_S while all run ...
        (
            at(Step.RUN, None, poll_at=T),
            facts(ranks=2),
            at(Step.RUN, None, poll_at=T + POLL_S),
            [Poll()],
        ),
        (at(Step.RUN, None, poll_at=T + 1), facts(ranks=2), at(Step.RUN, None, poll_at=T + 1), []),
        # ... hung ranks end the attempt: stopped, the others get the grace to let go ...
        (
            at(Step.RUN, None, poll_at=T + 1),
            facts(ranks=2, hung=True),
            at(Step.RUN, None, hung=True, grace_until=T + OUTCOME_GRACE_S),
            [AbortHung()],
        ),
        (
            at(Step.RUN, None, hung=True, grace_until=T + 5),
            facts(ranks=2, outcomes=1, bad=True, hung=True),
            at(Step.RUN, None, hung=True, grace_until=T + 5),
            [],
        ),
        # ... a bad outcome lets the others go; the polls go on through their grace (a
        # rank whose process went with its raylet answers none: its node is probed) ...
        (
            at(Step.RUN, None, poll_at=T),
            facts(ranks=2, outcomes=1, bad=True),
            at(Step.RUN, None, poll_at=T, grace_until=T + OUTCOME_GRACE_S),
            [LetGo()],
        ),
        (
            at(Step.RUN, None, poll_at=T, grace_until=T + 5),
            facts(ranks=2, outcomes=1, bad=True),
            at(Step.RUN, None, poll_at=T + POLL_S, grace_until=T + 5),
            [Poll()],
        ),
        # over: nothing more
        (at(Step.DONE), facts(released=True, placed=True), at(Step.DONE), []),
    ],
)
def test_advance(state: State, observed: Facts, after: State, actions: list[Action]) -> None:
    assert advance(state, observed) == (after, actions)


@pytest.mark.parametrize(
    ("state", "wake_at"),
    [
        (State(), None),  # launched: advanced at once, by the launch's wake-up
        (at(Step.OLD_GROUP, T + 5), T + 5),
        (RESERVING, T + PLACEMENT_RETRY_S),  # the next ask, not the step's deadline
        (at(Step.RUN, None), None),  # woken by the outcomes alone
        (at(Step.RUN, None, grace_until=T + 15), T + 15),
        (at(Step.RUN, None, poll_at=T + 2), T + 2),  # the next poll
        (at(Step.RUN, None, poll_at=T + 2, grace_until=T + 1), T + 1),  # whichever is first
        (at(Step.DONE), None),
    ],
)
def test_the_timer_an_attempt_sets(state: State, wake_at: float | None) -> None:
    assert state.wake_at == wake_at


def test_a_start_runs_every_timeline_phase_in_order() -> None:
    """A warm start from launch to the verdict, the facts arriving one by one: every phase
    the driver marks, once, in the order of `Phase`."""
    state, marks, now = State(), [], T
    script = [
        facts(now),
        facts(now, preferred=True),
        facts(now, placed=True),
        facts(now),
        facts(now, processes_up=True),
        facts(now, store_open=True),
        facts(now, ranks=2, outcomes=2),
    ]
    done: list[Action] = []
    for observed in script:
        state, actions = advance(state, observed)
        done += actions
        marks += [a.phase for a in actions if isinstance(a, Mark)]
    assert state.step == Step.DONE
    assert marks == [Phase.OLD_GROUP_STOPPED, Phase.PLACED, Phase.PROCESSES_UP]
    assert [type(a) for a in done if not isinstance(a, Mark)] == [
        Ask, Choose, OpenStore, Run, Verdict,
    ]  # fmt: skip


# -- the verdict ---------------------------------------------------------------------------------
DIED = WorkerError(type="ActorDiedError", message="gone", kind=ErrorKind.PROCESS_DIED, rank=1)
BROKE = WorkerError(type="DistBackendError", message="peer", kind=ErrorKind.PEER_LOST, rank=0)
OWN = WorkerError(type="ValueError", message="bad lr", kind=ErrorKind.RAISED, rank=1)


@pytest.mark.parametrize(
    ("outcomes", "status", "error"),
    [
        ([RunOutcome(rank=0), RunOutcome(rank=1)], DriverStatus.SUCCEEDED, None),
        ([RunOutcome(rank=0, stopped_early=True), RunOutcome(rank=1)], DriverStatus.STOPPED, None),
        ([RunOutcome(rank=0, error=BROKE), DIED], DriverStatus.FAILED, DIED),
        ([RunOutcome(rank=0, error=BROKE), stuck(1)], DriverStatus.FAILED, stuck(1)),
            ([RunOutcome(rank=0, error=BROKE), RunOutcome(rank=1, error=OWN)], DriverStatus.FAILED,
             OWN),
        ([RunOutcome(rank=0, aborted=True), RunOutcome(rank=1, aborted=True)], DriverStatus.FAILED,
         WorkerError(type="AttemptAborted", kind=ErrorKind.ABORTED, message="attempt released")),
    ],
)  # fmt: skip
def test_verdict(outcomes: list, status: DriverStatus, error: WorkerError | None) -> None:  # type: ignore[type-arg]
    assert verdict(outcomes, command=False) == (status, error)


def test_what_ends_a_rank_badly_and_how_a_death_reads() -> None:
    assert not ended_badly(RunOutcome(rank=0, stopped_early=True))
    assert ended_badly(RunOutcome(rank=0, aborted=True)) and ended_badly(DIED)
    error = process_died(RuntimeError("gone\nmore"), rank=2, node_id="n", pid=7, node_gone=True)
    assert (error.kind, error.message, error.node_id, error.pid) == (
        ErrorKind.NODE_DIED, "the process of rank 2 died: gone", "n", 7,
    )  # fmt: skip
    assert process_died(RuntimeError(), rank=0, node_id=None, pid=None, node_gone=False).message \
        == "the process of rank 0 died: RuntimeError"  # fmt: skip


# -- the loop ----------------------------------------------------------------------------------
class _Attempt:
    """Moves one step each time `go` was called since it last moved; over at `steps`."""

    def __init__(self, steps: int, *, wake_at: float | None = None) -> None:
        self.steps, self.done, self.pending = steps, 0, 0
        self.timer = wake_at
        self.advanced = threading.Event()
        self.calls = 0

    def advance(self) -> bool:
        self.calls += 1
        if self.timer is not None and time.monotonic() >= self.timer:
            self.timer, self.pending = None, self.pending + 1
        moved = self.pending > 0 and self.done < self.steps
        if moved:
            self.pending -= 1
            self.done += 1
        self.advanced.set()
        return moved

    @property
    def finished(self) -> bool:
        return self.done >= self.steps

    @property
    def wake_at(self) -> float | None:
        return self.timer


class _Waiter(_Attempt):
    """Moves once `other` is over (one attempt's processes coming back is what another
    waits for)."""

    def __init__(self, other: _Attempt) -> None:
        super().__init__(1)
        self.other = other

    def advance(self) -> bool:
        if self.other.finished and self.done == 0:
            self.done = 1
            return True
        return False


def test_one_pass_moves_every_attempt_until_none_moves() -> None:
    loop = AttemptLoop()
    first = _Attempt(2)
    first.pending = 2
    waiter = _Waiter(first)
    loop.add(waiter)  # the newer one first: it still moves in the same pass
    loop.add(first)
    assert loop.run_pass() is None
    assert first.finished and waiter.finished and loop.held() == 0


def test_a_pass_answers_the_earliest_timer() -> None:
    loop = AttemptLoop()
    loop.add(_Attempt(1, wake_at=time.monotonic() + 30))
    loop.add(_Attempt(1, wake_at=time.monotonic() + 5))
    assert 4 < (loop.run_pass() or 0) <= 5


def test_the_loop_wakes_on_an_event_and_on_a_timer_and_never_polls() -> None:
    loop = AttemptLoop()
    woken = _Attempt(1)
    timed = _Attempt(1, wake_at=time.monotonic() + 0.2)
    loop.add(woken)
    loop.add(timed)
    loop.start()
    assert woken.advanced.wait(5)
    calls = woken.calls
    time.sleep(0.05)
    assert woken.calls == calls  # nothing happened: nothing ran
    woken.pending, started = 1, time.monotonic()
    woken.advanced.clear()
    loop.wake()  # e.g. a reply's callback
    assert woken.advanced.wait(5) and time.monotonic() - started < 0.1
    deadline = time.monotonic() + 5
    while not timed.finished and time.monotonic() < deadline:
        time.sleep(0.01)
    assert timed.finished and woken.finished
