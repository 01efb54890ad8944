"""One attempt's driver: forms its worker group from pooled processes, runs it, reports.

Drivers live inside the runtime actor (`elastrain.workers.runtime.actor`), one per running
attempt; creating one costs no process and no thread. Rank 0 of the worker group pushes
typed messages (`elastrain.contracts.messages`: metrics, checkpoint commits, events, timeline
marks) to it with fire-and-forget actor calls; the driver numbers them, and the scheduler
drains them on every pass and acknowledges what it stored.

The group, as phases (`elastrain.workers.runtime.phases`): wait for the job's previous
processes to let go (they hold its state), reserve the attempt's resources on the nodes of
the processes chosen for it (`elastrain.workers.runtime.placement`), wait for those still
starting, have rank 0 host the store the others rendezvous at, hand every rank its
`Assignment` and collect the `RunOutcome` each answers when its part ends; then judge
(`elastrain.workers.runtime.verdict`). When a peer dies the survivors fail their next
collective at once and come back holding the state of the last step they all agreed on.

The driver never waits: `advance` observes the facts (which replies came back, what the
pool says), lets the pure `phases.advance` decide, and carries the actions out. The
runtime's attempt loop (`elastrain.workers.runtime.attempts`) calls it whenever one of the
driver's replies arrives (a future's callback wakes the loop) or a timer is due.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import replace
from typing import Any

from ray.util.placement_group import remove_placement_group

from elastrain.contracts.group import Assignment
from elastrain.contracts.messages import (
    Control,
    DriverReport,
    DriverStatus,
    ErrorKind,
    EventKind,
    Phase,
    Placement,
    Resumed,
    StepMetrics,
    Timeline,
    TimelineMark,
    WorkerError,
    WorkerEvent,
    WorkerFailed,
    WorkerMessage,
)
from elastrain.contracts.runtime import LaunchRequest
from elastrain.workers.runtime import phases
from elastrain.workers.runtime.collect import Outcomes
from elastrain.workers.runtime.hangs import Hang, RankSeen, find_hang
from elastrain.workers.runtime.layout import local_layout
from elastrain.workers.runtime.ordering import InOrder
from elastrain.workers.runtime.phases import Facts, State, Step
from elastrain.workers.runtime.placement import (
    ask,
    being_placed,
    bundle_nodes,
    describe,
    gpu_processes_back,
    group_prefix,
    local_gpus,
    preferred_nodes,
    take_processes,
)
from elastrain.workers.runtime.pool import PooledWorker, WorkerPool
from elastrain.workers.runtime.stragglers import (
    Straggler,
    Streak,
    confirm,
    confirmed,
    find_stragglers,
)
from elastrain.workers.runtime.verdict import verdict

log = logging.getLogger("elastrain.driver")

#: A report carries at most this many messages; the rest come with the next poll.
MAX_MESSAGES_PER_REPORT = 5000
#: Most advances of one attempt in one call (each is one step of `phases.advance`).
_MAX_STEPS = 32


def _nothing() -> None:
    return None


class AttemptDriver:
    def __init__(
        self,
        request: LaunchRequest,
        *,
        pool: WorkerPool,
        runtime_name: str,
        namespace: str,
        collective_timeout_s: float,
        capability: str,
        wake: Callable[[], None] = _nothing,
    ) -> None:
        self.request = request
        self.capability = capability  # the attempt's: handed to its ranks (`Assignment`)
        self.key = request.key
        self.group_name = f"{group_prefix(namespace)}{request.name}"
        self.pool = pool
        self.runtime_name = runtime_name
        self.namespace = namespace
        self.collective_timeout_s = collective_timeout_s
        self._wake = wake  # the attempt loop's: called when one of our replies arrives
        self._lock = threading.Lock()
        self._status = DriverStatus.STARTING
        self._outbox: list[tuple[int, WorkerMessage]] = []  # (seq, message), not yet acked
        self._seq = 0
        self._placement: Placement | None = None
        self._resumed_from: int | None = None
        self._error: WorkerError | None = None
        self._control: list[Control] = []  # one-shot requests not yet sent to rank 0
        self._rank0: Any = None  # rank 0's process once it has its rank: controls go there
        self._stopping = False
        self._released = False
        self._marks: dict[Phase, TimelineMark] = {}
        self._batches: InOrder[WorkerMessage] = InOrder()  # rank 0's, by number
        self._command = request.spec.workload.command is not None
        self._ranks: list[Any] = []  # every rank's process, once handed its rank
        self.workers: list[PooledWorker] = []
        self.holders: list[PooledWorker] = []
        """Pooled GPU processes whose GPU a private process of this attempt uses."""
        self.pg: Any = None
        # The phases' state, and what the loop thread alone touches.
        self._state = State()
        self._preferred: list[str] = []
        self._placed: Future[Any] | None = None  # the current ask's pg.ready()
        self._nodes: list[str] | None = None  # the placed bundles' nodes
        self._ready: dict[str, Future[Any]] = {}  # a starting process's first answer, by name
        self._store: Future[Any] | None = None  # rank 0's store port
        self._outcomes = Outcomes(pool, wake)  # RUN: the ranks' outcomes
        # RUN: the hang watch. Each rank's last answer, and its poll still out (with when
        # it was sent); what it found, once it found something.
        self._seen: dict[int, RankSeen] = {}
        self._polls: dict[int, tuple[Future[Any], float]] = {}
        self._hang: Hang | None = None
        # RUN: the straggler watch, over the same answers: the slow ranks now, by rank.
        self._slow: dict[int, Straggler] = {}
        self._streaks: dict[int, Streak] = {}  # ranks found slow, polls in a row
        detected = request.detected_at or time.time()
        if request.joined_at:  # a grow onto a node that joined: its timeline starts there
            self._mark(Phase.NODE_JOINED, at=min(request.joined_at, detected))
        if request.warm_at:
            warm = min(max(request.warm_at, request.joined_at), detected)
            self._mark(Phase.PROCESS_WARM, at=warm)
        self._mark(Phase.DETECTED, at=detected, detail=request.cause)

    # -- called by rank 0 of the worker group -------------------------------------------------
    def push_batch(self, number: int, messages: Sequence[WorkerMessage]) -> None:
        """Rank 0's `number`th batch (from 0): applied in number order, whatever order the
        runtime's threads run the calls in (`elastrain.workers.runtime.ordering`); under one
        hold of the lock, so a later batch's thread cannot slip in between."""
        with self._lock:
            for message in self._batches.add(number, messages):
                self._take(message)

    def push(self, message: WorkerMessage) -> None:
        """One message of the driver's own (its timeline marks, its placement)."""
        with self._lock:
            self._take(message)

    def _take(self, message: WorkerMessage) -> None:
        if isinstance(message, TimelineMark):
            self._marks.setdefault(message.phase, message)
            if message.phase == Phase.FIRST_STEP:
                self._append(self._timeline())
            if (
                message.phase == Phase.GROUP_FORMED
                and self._command
                and self._status == DriverStatus.STARTING
            ):
                # A command job's script may never report a step: running from the
                # moment rank 0's script started (`elastrain.workers.command`).
                self._status = DriverStatus.RUNNING
            return
        self._append(message)
        if isinstance(message, StepMetrics) and self._status == DriverStatus.STARTING:
            self._status = DriverStatus.RUNNING
        elif isinstance(message, Placement):
            self._placement = message
        elif isinstance(message, Resumed):
            self._resumed_from = message.step

    def _append(self, message: WorkerMessage) -> None:
        self._seq += 1
        self._outbox.append((self._seq, message))

    def _mark(self, phase: Phase, *, at: float | None = None, detail: str = "") -> None:
        self.push(TimelineMark(phase=phase, at=time.time() if at is None else at, detail=detail))

    def _timeline(self) -> Timeline:
        order = list(Phase)
        marks = sorted(self._marks.values(), key=lambda m: order.index(m.phase))
        return Timeline(cause=self.request.cause, marks=tuple(marks))

    # -- called by the scheduler (through the runtime) ----------------------------------------
    def request_control(self, control: Control) -> None:
        with self._lock:
            if control in (Control.STOP, Control.LEAVE):
                if self._stopping:
                    return  # asked again (level-triggered): once is enough
                self._stopping = True
            if control not in self._control:
                self._control.append(control)
            self._send_controls()

    def _send_controls(self) -> None:
        """Hand the queued requests to rank 0's process (lock held). Pushed, not polled:
        rank 0 asking the runtime every few steps cost a remote call's CPU on both sides
        on the cores the ranks train on; a push costs one call per request and reaches
        rank 0 at once. Rank 0's process keeps requests by attempt, so one that arrives
        before its rank has started is not lost."""
        if self._rank0 is not None and self._control:
            # A command job's scripts cannot agree on a step to stop at: each rank's
            # process stops its own script (`elastrain.workers.command.ScriptRun.wait`).
            for handle in self._ranks if self._command else [self._rank0]:
                handle.control.remote(self.pool.token, self.key, self._control)
            self._control = []

    def drain(self, ack: int) -> DriverReport:
        """Forget the messages up to `ack` (stored by the scheduler); report the rest."""
        with self._lock:
            self._outbox = [(seq, m) for seq, m in self._outbox if seq > ack]
            batch = self._outbox[:MAX_MESSAGES_PER_REPORT]
            return DriverReport(
                status=self._status,
                messages=tuple(m for _, m in batch),
                seq=batch[-1][0] if batch else ack,
                error=self._error,
                placement=self._placement,
                resumed_from_step=self._resumed_from,
                stopping=self._stopping,
                slow_nodes=tuple(sorted({self.workers[r].node_id for r in self._slow})),
            )

    def release(self) -> None:
        """The attempt is over for the scheduler: let go of the processes (they keep the
        job's state) and of the reserved resources, now (another attempt is about to get
        them); the attempt loop collects what comes back."""
        with self._lock:
            self._released = True
            workers = list(self.workers)
        for w in workers:
            if w.busy and w.lent_to == self.key:  # not one lent on to another since
                w.handle.abort.remote(self.pool.token)
        self._remove_placement_group()
        self._wake()

    # -- called by the attempt loop (`elastrain.workers.runtime.attempts`) ------------------
    @property
    def finished(self) -> bool:
        return self._state.step == Step.DONE and not self._outcomes.stragglers

    @property
    def wake_at(self) -> float | None:
        return self._state.wake_at

    @property
    def step(self) -> Step:
        return self._state.step

    def advance(self) -> bool:
        """Observe, let the phases decide, act; again while the state moves. Whether it
        moved (or a straggler came back)."""
        moved = self._outcomes.stragglers_back()
        for _ in range(_MAX_STEPS):
            before = self._state
            if before.step == Step.DONE:
                break
            try:
                self._state, actions = phases.advance(before, self._observe())
                for action in actions:
                    self._do(action)
            except Exception as exc:
                self._state = replace(self._state, step=Step.DONE)
                self._fail(exc)
            if self._state == before:
                break
            moved = True
        return moved

    def _watch(self, ref: Any) -> Future[Any]:
        """The reply to `ref` as a future whose completion wakes the attempt loop (Ray's
        core worker calls back the moment it arrives: nothing polls)."""
        future: Future[Any] = ref.future()
        future.add_done_callback(lambda _: self._wake())
        return future

    # -- observing ------------------------------------------------------------------------------
    def _observe(self) -> Facts:
        step = self._state.step
        with self._lock:
            released = self._released
        facts = Facts(
            now=time.monotonic(),
            wall=time.time(),
            released=released,
            detected_at=self._marks[Phase.DETECTED].at,
        )
        if step == Step.OLD_GROUP:
            mine = self.pool.job_workers(self.request.job)
            self._preferred = preferred_nodes(self.pool, self.request)
            return replace(
                facts,
                old_group_busy=sum(1 for w in mine if w.busy),
                old_group_left_at=max((w.returned_at for w in mine), default=0.0),
                preferred=bool(self._preferred),
            )
        if step == Step.RESERVE:
            placed = self._placed
            done = placed is not None and placed.done() and placed.exception() is None
            return replace(facts, placed=done)
        if step == Step.GPUS:
            if self._nodes is None:
                self._nodes = bundle_nodes(self.pg, self.request.world_size)
            if self.request.spec.scaling.use_gpu:
                return replace(facts, gpu_processes=gpu_processes_back(self.pool, self._nodes))
            return facts
        if step == Step.START:
            return replace(facts, processes_up=self._processes_up())
        if step == Step.FORM:
            assert self._store is not None
            if self._store.done():
                self._store.result()  # rank 0 failed to open it: raises, the attempt fails
            return replace(facts, store_open=self._store.done())
        if step == Step.RUN:
            self._outcomes.watch_nodes(time.monotonic())
            self._outcomes.take_in()
            known, bad = len(self._outcomes.known), self._outcomes.bad
            hung = self._watch_hangs() if self._hang is None and not bad else False
            return replace(facts, ranks=len(self.workers), outcomes=known, bad=bad, hung=hung)
        return facts

    def _watch_hangs(self) -> bool:
        """Take in the polls' answers; whether the hang watch names hung ranks."""
        for rank, (future, _) in list(self._polls.items()):
            if future.done():
                del self._polls[rank]
                answer = future.result() if future.exception() is None else None
                self._seen[rank] = RankSeen(progress=answer)
        seen: dict[int, RankSeen] = {}
        for rank in range(len(self.workers)):
            last, poll = self._seen.get(rank, RankSeen(None)), self._polls.get(rank)
            seen[rank] = replace(last, unanswered_since=poll[1]) if poll is not None else last
        after = self.request.spec.failure.hang_after_s
        self._hang = find_hang(seen, time.time(), after)
        self._watch_stragglers()
        return self._hang is not None

    def _watch_stragglers(self) -> None:
        """Which ranks are slow now (`stragglers`); an event for each newly found."""
        failure = self.request.spec.failure
        local = {r: s.progress.local for r, s in self._seen.items() if s.progress is not None}
        if len(local) < len(self.workers):
            return  # a rank not heard from yet: nothing to compare it with
        window = failure.straggler_window
        found = {
            s.rank: s
            for s in find_stragglers(local, threshold=failure.straggler_threshold, window=window)
        }
        newest = min(max((step for step, _ in pairs), default=0) for pairs in local.values())
        self._streaks = confirm(found, newest, self._streaks, window)
        slow = {rank: found[rank] for rank in confirmed(self._streaks)}
        with self._lock:
            for rank in sorted(slow.keys() - self._slow.keys()):
                self._append(self._straggler_event(slow[rank]))
            self._slow = slow

    def _straggler_event(self, straggler: Straggler) -> WorkerEvent:
        rank, node = straggler.rank, self.workers[straggler.rank].node_id
        progress = self._seen[rank].progress
        step = progress.step if progress is not None else None
        action = self.request.spec.failure.stragglers.value
        return WorkerEvent(
            event=EventKind.STRAGGLER,
            reason=f"rank {rank} on node {node[:12]} is a straggler: its local work takes "
            f"{straggler.ratio:.1f}x the other ranks' ({straggler.local_s * 1000:.1f} ms vs "
            f"{straggler.others_s * 1000:.1f} ms per step) at step {step} ({action})",
            details={
                "rank": rank,
                "node_id": node,
                "step": step,
                "ratio": round(straggler.ratio, 3),
                "local_ms": round(straggler.local_s * 1000, 3),
                "others_ms": round(straggler.others_s * 1000, 3),
                "action": action,
            },
        )

    def _processes_up(self) -> bool:
        """Whether every chosen process answered once (one that failed to start raises)."""
        up = True
        for w in self.workers:
            if w.info is not None or w.ready_ref is None:
                continue
            if w.name not in self._ready:
                self._ready[w.name] = self._watch(w.ready_ref)
            future = self._ready[w.name]
            if not future.done():
                up = False
                continue
            info = future.result()
            with self.pool.lock:
                if w.info is None:  # (the pool's upkeep may have noticed it first)
                    w.info = info
        return up

    # -- acting ---------------------------------------------------------------------------------
    def _do(self, action: phases.Action) -> None:
        match action:
            case phases.Mark(phase=phase, at=at, detail=detail):
                if detail is None:
                    detail = (
                        describe(self.workers, self.request.job) if phase == Phase.PLACED else ""
                    )
                self._mark(phase, at=at, detail=detail)
            case phases.Ask(where=where):
                self._ask(where)
            case phases.Drop():
                self._placed = None
                self._remove_placement_group()
            case phases.Choose():
                assert self._nodes is not None
                self.workers = take_processes(
                    self.pool, self.request, self.pg, self._nodes, self.holders
                )
            case phases.OpenStore():
                rank0 = self.workers[0].handle
                self._store = self._watch(
                    rank0.host_store.remote(
                        self.pool.token, self.request.world_size, self.collective_timeout_s
                    )
                )
            case phases.Run():
                self._run()
            case phases.Poll():
                self._poll()
            case phases.AbortHung():
                self._abort_hung()
            case phases.LetGo():
                self._outcomes.let_go()
            case phases.AbortStragglers():
                self._outcomes.give_up()
                if self._hang is not None:  # still out after the grace: hung too
                    for rank in self._outcomes.stragglers:
                        self.pool.stop(self.workers[rank], "hung in its attempt")
            case phases.Verdict():
                status, error = verdict(self._outcomes.final(), command=self._command)
                if self._hang is not None:  # the cause, whatever the ranks said after it
                    status, error = DriverStatus.FAILED, self._hang_error(self._hang)
                self._finish(status, error)
            case phases.Fail(type=type_, message=message):
                self._fail(RuntimeError(message), error=WorkerError(type=type_, message=message))

    def _poll(self) -> None:
        """Ask each rank's process how far it got; a rank whose last ask is still out is
        not asked again (how long it has been out is what the watch reads)."""
        if self._command:
            return  # a script reports no loop's progress
        sent = time.time()
        for rank, w in enumerate(self.workers):
            if rank not in self._polls:
                ref = w.handle.progress.remote(self.pool.token, self.key)
                self._polls[rank] = (self._watch(ref), sent)

    def _abort_hung(self) -> None:
        """Stop the hung ranks' processes (a rank stuck in its own code never lets go) and
        tell the others to let go: those blocked in a collective on a hung peer are freed
        by the abort's release of the group's connections, holding the job's state. When
        every rank is named, every one is told to let go; those still out after the grace
        are stopped then."""
        hang = self._hang
        assert hang is not None
        log.warning("attempt %s hung: %s", self.key, hang.why)
        named = set(hang.ranks) if len(hang.ranks) < len(self.workers) else set()
        for rank, w in enumerate(self.workers):
            if rank in named:
                self.pool.stop(w, "hung in its attempt")
            elif w.busy and w.lent_to == self.key:
                w.handle.abort.remote(self.pool.token)

    def _hang_error(self, hang: Hang) -> WorkerError:
        first = hang.ranks[0]
        return WorkerError(
            type="Hang",
            kind=ErrorKind.HANG,
            message=f"hung: {hang.why} (no progress for {hang.threshold_s:.0f}s, the "
            "threshold: failure.hang_after_s)",
            rank=first,
            node_id=self.workers[first].node_id,
        )

    def _ask(self, where: phases.Where) -> None:
        """Replace the current ask with a new one (Ray places a new request at once, and a
        pending one only about every second), unless Ray is placing the current one now
        (`being_placed`: then it is left to end placed or pending; the next ask decides)."""
        if self.pg is not None and being_placed(self.pg):
            return
        self._placed = None
        self._remove_placement_group()
        with self._lock:
            if self._released:
                return  # (the phases see it next)
            pg = ask(self.request, self.group_name, where, self._preferred)
            self.pg = pg
        self._placed = self._watch(pg.ready())

    def _run(self) -> None:
        """Hand every rank its part: rank 0's process hosts the store at the port it
        answered; rank 0 gets the controls asked for meanwhile."""
        request, workers = self.request, self.workers
        assert self._store is not None
        port = self._store.result()
        rank0 = workers[0]
        assert rank0.info is not None
        layout = local_layout([w.node_id for w in workers])
        assignments = [
            Assignment(
                job_id=request.job_id,
                attempt=request.attempt,
                rank=rank,
                world_size=request.world_size,
                master_addr=rank0.info.address,
                master_port=port,
                spec=request.spec,
                storage_path=request.storage_path,
                database=request.database,
                runtime_name=self.runtime_name,
                namespace=self.namespace,
                collective_timeout_s=self.collective_timeout_s,
                local_gpus=local_gpus(workers, rank, use_gpu=request.spec.scaling.use_gpu),
                capability=self.capability,
                run_as=request.run_as,
                **layout[rank],
            )
            for rank in range(len(workers))
        ]
        with self._lock:  # a release from now on aborts the ranks it finds busy
            if self._released:
                raise RuntimeError("released before it started")
            refs = [
                w.handle.run.remote(self.pool.token, assignment)
                for w, assignment in zip(workers, assignments, strict=True)
            ]
            self._rank0 = rank0.handle
            self._ranks = [w.handle for w in workers]
            self._send_controls()
        self._outcomes.start(workers, {rank: self._watch(ref) for rank, ref in enumerate(refs)})
        self.push(
            Placement(
                nodes={r: w.node_id for r, w in enumerate(workers)},
                pids={r: w.info.pid for r, w in enumerate(workers) if w.info is not None},
                placement_group=self.pg.id.hex() if self.pg is not None else None,
            )
        )

    def _fail(self, exc: BaseException, *, error: WorkerError | None = None) -> None:
        """Over before (or while) its ranks were handed their parts: processes taken but
        never handed a rank go back to the pool as they were; ranks handed theirs are told
        to let go and come back as stragglers."""
        with self._lock:
            released = self._released
        if error is None and not released:
            log.error("attempt %s", self.key, exc_info=exc)
        elif not released:
            log.warning("attempt %s: %s", self.key, error.message if error else exc)
        self._outcomes.give_up()
        handed = self._outcomes.handed()
        for rank, w in enumerate(self.workers):
            if rank not in handed and w.busy and w.lent_to == self.key:
                self.pool.give_back(w, w.held, alive=True)
        self._finish(DriverStatus.FAILED, error or WorkerError.from_exception(exc))

    def _finish(self, status: DriverStatus, error: WorkerError | None) -> None:
        with self._lock:
            released = self._released
        if released:  # released while placing: what was reserved since
            self._remove_placement_group()
        for holder in self.holders:  # the private processes that used their GPUs are done
            self.pool.give_back(holder, None, alive=True)
        with self._lock:
            if error is not None:
                self._append(WorkerFailed(error=error))
            self._error = error
            self._status = status

    def _remove_placement_group(self) -> None:
        with self._lock:
            pg, self.pg = self.pg, None
        if pg is not None:
            try:
                remove_placement_group(pg)
            except Exception as exc:  # already removed is fine
                log.info("remove placement group: %s", exc)
