"""One attempt's driver: forms its worker group from pooled processes, runs it, reports.

Drivers live inside the runtime actor (`elastrain.workers.runtime.actor`), one per running
attempt, each on its own thread; creating one costs no process. Rank 0 of the worker group
pushes typed messages (`elastrain.contracts.messages`: metrics, checkpoint commits, events, timeline
marks) to it with fire-and-forget actor calls; the driver numbers them, and the scheduler
drains them on every pass and acknowledges what it stored.

The group: a placement group reserves the attempt's resources on the nodes of the
processes chosen for it (`WorkerPool`), preferring processes that hold the job's state;
rank 0 hosts the store the others rendezvous at; every rank `run`s its `Assignment` and
answers with a `RunOutcome` when its part ends. When a peer dies the survivors fail their
next collective at once and come back holding the state of the last step they all
agreed on.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from collections.abc import Sequence
from typing import Any

import ray
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from elastrain.contracts.group import Assignment, RunOutcome
from elastrain.contracts.messages import (
    Control,
    DriverReport,
    DriverStatus,
    ErrorKind,
    Phase,
    Placement,
    Resumed,
    StepMetrics,
    Timeline,
    TimelineMark,
    WorkerError,
    WorkerFailed,
    WorkerMessage,
)
from elastrain.contracts.runtime import JobRef, LaunchRequest
from elastrain.contracts.spec import JobSpec
from elastrain.workers.runtime.layout import Slot, local_layout, rank_order
from elastrain.workers.runtime.liveness import raylet_gone
from elastrain.workers.runtime.ordering import InOrder
from elastrain.workers.runtime.pool import PooledWorker, WorkerPool, choose_worker

log = logging.getLogger("elastrain.driver")

#: A report carries at most this many messages; the rest come with the next poll.
MAX_MESSAGES_PER_REPORT = 5000
#: How long a new attempt waits for the job's previous processes to let go (they hold its
#: state); after that it takes other processes and a checkpoint.
OLD_GROUP_GRACE_S = 5.0
#: After the first rank's part ended badly, how long to wait for the others' outcomes
#: (survivors fail their next collective within milliseconds; a dead process is known to
#: Ray within a second or two).
OUTCOME_GRACE_S = 15.0
#: How long to try a placement on the preferred nodes before placing anywhere, asking
#: again every PLACEMENT_RETRY_S.
PREFERRED_PLACEMENT_S = 1.5
PLACEMENT_RETRY_S = 0.15
#: How long to wait for Ray to reserve the attempt's resources at all.
PLACEMENT_TIMEOUT_S = 120.0
#: How long a GPU rank waits for a process owning a GPU of its bundle's node to come back
#: from an attempt that is over (one whose job ended or shrank lets go at its next step
#: boundary), before a second process is started on that GPU beside it.
GPU_RETURN_GRACE_S = 15.0
#: How long a process may take to start when no warm one is left on a node.
START_TIMEOUT_S = 300.0


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
    ) -> None:
        self.request = request
        self.capability = capability  # the attempt's: handed to its ranks (`Assignment`)
        self.key = request.key
        self.group_name = f"{group_prefix(namespace)}{request.name}"
        self.pool = pool
        self.runtime_name = runtime_name
        self.namespace = namespace
        self.collective_timeout_s = collective_timeout_s
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
        self._released = threading.Event()
        self._marks: dict[Phase, TimelineMark] = {}
        self._batches: InOrder[WorkerMessage] = InOrder()  # rank 0's, by number
        self._command = request.spec.workload.command is not None
        self._ranks: list[Any] = []  # every rank's process, once handed its rank
        self.workers: list[PooledWorker] = []
        self.holders: list[PooledWorker] = []
        """Pooled GPU processes whose GPU a private process of this attempt uses."""
        self.pg: Any = None
        detected = request.detected_at or time.time()
        self._mark(Phase.DETECTED, at=detected, detail=request.cause)
        self._thread = threading.Thread(target=self._run, name=f"attempt-{self.key}", daemon=True)
        self._thread.start()

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
            )

    def release(self) -> None:
        """The attempt is over for the scheduler: let go of the processes (they keep the
        job's state) and of the reserved resources."""
        self._released.set()
        for w in self.workers:
            if w.busy:
                w.handle.abort.remote(self.pool.token)
        self._remove_placement_group()

    # -- the group -----------------------------------------------------------------------------
    def _run(self) -> None:
        try:
            outcomes = self._run_group()
            status, error = self._verdict(outcomes)
        except Exception as exc:
            if not self._released.is_set():
                log.exception("attempt %s", self.key)
            status, error = DriverStatus.FAILED, WorkerError.from_exception(exc)
            for w in self.workers:  # taken but never handed a rank: back to the pool
                if w.busy and w.lent_to == self.key:
                    self.pool.give_back(w, w.held, alive=True)
        if self._released.is_set():  # released while placing: what was reserved since
            self._remove_placement_group()
        for holder in self.holders:  # the private processes that used their GPUs are done
            self.pool.give_back(holder, None, alive=True)
        with self._lock:
            if error is not None:
                self._append(WorkerFailed(error=error))
            self._error = error
            self._status = status

    def _run_group(self) -> list[RunOutcome | WorkerError]:
        request = self.request
        spec = request.spec
        stopped_at, detail = self._wait_for_old_group()
        detected = self._marks[Phase.DETECTED].at
        self._mark(Phase.OLD_GROUP_STOPPED, at=max(stopped_at, detected), detail=detail)
        self.workers = self._place(request.world_size)
        if self._released.is_set():
            raise RuntimeError("released before it started")
        self._mark(Phase.PLACED, detail=self._describe_workers())
        self.pool.wait_ready(self.workers, timeout=START_TIMEOUT_S)
        self._mark(Phase.PROCESSES_UP)
        rank0 = self.workers[0]
        port = ray.get(
            rank0.handle.host_store.remote(
                self.pool.token, request.world_size, self.collective_timeout_s
            ),
            timeout=30,
        )
        assert rank0.info is not None
        layout = local_layout([w.node_id for w in self.workers])
        refs = [
            w.handle.run.remote(
                self.pool.token,
                Assignment(
                    job_id=request.job_id,
                    attempt=request.attempt,
                    rank=rank,
                    world_size=request.world_size,
                    master_addr=rank0.info.address,
                    master_port=port,
                    spec=spec,
                    storage_path=request.storage_path,
                    database=request.database,
                    runtime_name=self.runtime_name,
                    namespace=self.namespace,
                    collective_timeout_s=self.collective_timeout_s,
                    local_gpus=self._local_gpus(rank),
                    capability=self.capability,
                    run_as=request.run_as,
                    **layout[rank],
                ),
            )
            for rank, w in enumerate(self.workers)
        ]
        with self._lock:
            self._rank0 = rank0.handle
            self._ranks = [w.handle for w in self.workers]
            self._send_controls()
        self.push(
            Placement(
                nodes={r: w.node_id for r, w in enumerate(self.workers)},
                pids={r: w.info.pid for r, w in enumerate(self.workers) if w.info is not None},
                placement_group=self.pg.id.hex() if self.pg is not None else None,
            )
        )
        return self._collect(refs)

    def _local_gpus(self, rank: int) -> tuple[int, ...]:
        """The GPUs of the ranks on `rank`'s node, by local rank (a GPU job's)."""
        node = self.workers[rank].node_id
        gpus = [w.gpu for w in self.workers if w.node_id == node]
        if not self.request.spec.scaling.use_gpu or any(g is None for g in gpus):
            return ()
        return tuple(g for g in gpus if g is not None)

    def _wait_for_old_group(self) -> tuple[float, str]:
        """Wait (a little) for this job's processes still running an older attempt: they
        hold its newest state. Returns when the last of them let go, or when the wait
        was given up. A survivor blocked in a collective on a peer that vanished without
        closing its sockets frees itself `RELEASE_AFTER_S` after the release's abort
        (`elastrain.workers.comm_release`), not at the collective's timeout."""
        deadline = time.monotonic() + OLD_GROUP_GRACE_S
        while time.monotonic() < deadline:
            busy = [w for w in self.pool.job_workers(self.request.job) if w.busy]
            if not busy:
                returned = [w.returned_at for w in self.pool.job_workers(self.request.job)]
                return max(returned, default=0.0), ""
            time.sleep(0.02)
        return time.time(), (
            f"{len(busy)} process(es) still in the old group after {OLD_GROUP_GRACE_S:g}s: "
            "not waited for"
        )

    def _place(self, n: int) -> list[PooledWorker]:
        """Reserve `n` bundles, pick a process on each bundle's node (holders of the job's
        newest state first) and number them node by node (`elastrain.workers.runtime.layout`)."""
        job = self.request.job
        avoid = set(self.request.avoid_nodes)
        holders = sorted(
            (
                w
                for w in self.pool.job_workers(job)
                if w.idle and w.held is not None and w.node_id not in avoid
            ),
            key=lambda w: -w.held.step,  # type: ignore[union-attr]
        )
        preferred = [w.node_id for w in holders][:n]
        self.pg = self._reserve(n, preferred)
        table = ray.util.placement_group_table(self.pg)
        nodes = [table["bundles_to_node_id"][i] for i in range(n)]
        gpu = self.request.spec.scaling.use_gpu
        if gpu:
            self._wait_for_gpu_processes(nodes)
        options = private_worker_options(self.request.spec)
        own_code = self.request.spec.workload.runs_own_code
        chosen: list[PooledWorker] = []
        with self.pool.lock:
            try:
                for index, node in enumerate(nodes):
                    taken = chosen + self.holders
                    if options is None:
                        worker = self._warm_worker(node, taken, gpu=gpu)
                    else:
                        holder = self._warm_worker(node, taken, gpu=True) if gpu else None
                        if holder is not None:  # its GPU is lent to the private process
                            self.pool.take(holder, self.key, job)
                            self.holders.append(holder)
                            holder.handle.free_gpu.remote(self.pool.token)
                        worker = self.pool.start(
                            node,
                            private=True,
                            gpu=holder.gpu if holder is not None else None,
                            scheduling_strategy=PlacementGroupSchedulingStrategy(self.pg, index),
                            **options,
                        )
                    self.pool.take(worker, self.key, job, own_code=own_code)
                    chosen.append(worker)
            except BaseException:
                for w in chosen:  # never handed a rank: back to the pool as they were
                    self.pool.give_back(w, w.held, alive=True)
                raise

        strategy = self.request.spec.strategy
        order = rank_order(
            [Slot(w.node_id, _held_step(w, job)) for w in chosen],
            group_sizes=(strategy.model_parallel_size, strategy.tensor_parallel_degree),
        )
        return [chosen[i] for i in order]

    def _wait_for_gpu_processes(self, nodes: Sequence[str]) -> None:
        """Wait (a little) until every node of the bundles has a GPU process for each of
        its bundles: Ray frees a GPU when the attempt using it is released, a moment
        before that attempt's process lets go."""
        need = Counter(nodes)
        deadline = time.monotonic() + GPU_RETURN_GRACE_S
        while time.monotonic() < deadline and not self._released.is_set():
            with self.pool.lock:
                if all(self.pool.gpu_slots(node) >= k for node, k in need.items()):
                    return
            time.sleep(0.05)

    def _warm_worker(self, node: str, taken: Sequence[PooledWorker], *, gpu: bool) -> PooledWorker:
        """A pooled process on `node` for one rank (call with the pool's lock held): an
        idle one of the right kind (`choose_worker`), else a new or starting one. A GPU
        rank's bundle holds one of the node's GPUs in Ray, so a process owning a GPU is
        idle there unless one is stuck in an attempt that is over."""
        candidates = [w for w in self.pool.workers.values() if w.node_id == node and w not in taken]
        chosen = choose_worker(candidates, self.request.job, gpu=gpu)
        if chosen is not None:
            return chosen
        return self.pool.spare_gpu_worker(node, taken) if gpu else self.pool.start(node)

    def _reserve(self, n: int, preferred: Sequence[str]) -> Any:
        """A placement group of `n` bundles: on the `preferred` nodes (holders of the job's
        state) if they have room within PREFERRED_PLACEMENT_S, else anywhere."""
        scaling = self.request.spec.scaling
        bundle: dict[str, float] = {"CPU": float(scaling.cpus_per_worker)}
        if scaling.use_gpu:
            bundle["GPU"] = float(scaling.gpus_per_worker)
        anywhere = avoiding(self.request.avoid_nodes)
        if preferred:
            selectors = [{"ray.io/node-id": node} for node in preferred]
            selectors += [anywhere] * (n - len(selectors))
            pg = self._ask([bundle] * n, selectors, PREFERRED_PLACEMENT_S)
            if pg is not None:
                return pg
        pg = self._ask([bundle] * n, [anywhere] * n if anywhere else None, PLACEMENT_TIMEOUT_S)
        if pg is None:
            raise RuntimeError(f"Ray could not reserve {n} x {bundle} in {PLACEMENT_TIMEOUT_S}s")
        return pg

    def _ask(self, bundles: list[dict[str, float]], selectors: Any, timeout: float) -> Any:
        """Ask Ray for the placement group until it is placed or `timeout` passes. The
        resources are often being freed right now (the old attempt's bundles); Ray retries a
        pending placement group only about every second, while a new request is placed at
        once, so this asks again, soon at first and then less and less often."""
        deadline = time.monotonic() + timeout
        wait = PLACEMENT_RETRY_S
        while time.monotonic() < deadline and not self._released.is_set():
            pg = placement_group(bundles, strategy="PACK", name=self.group_name,
                                 bundle_label_selector=selectors)  # fmt: skip
            if self._ready(pg, min(wait, max(0.0, deadline - time.monotonic()))):
                return pg
            remove_placement_group(pg)
            wait = min(wait * 2, 2.0)
        return None

    def _ready(self, pg: Any, timeout: float) -> bool:
        ref = pg.ready()
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and not self._released.is_set():
            ready, _ = ray.wait([ref], timeout=0.05)
            if ready:
                return True
        return False

    def _collect(self, refs: list[Any]) -> list[RunOutcome | WorkerError]:
        """Every rank's outcome; once one ended badly, the others get a grace period."""
        by_ref = dict(zip(refs, range(len(refs)), strict=True))
        outcomes: dict[int, RunOutcome | WorkerError] = {}
        node_gone: dict[str | None, bool] = {}  # one raylet probe per node, not per rank
        pending = list(refs)
        deadline: float | None = None
        while pending:
            timeout = None if deadline is None else max(0.0, deadline - time.monotonic())
            ready, pending = ray.wait(pending, num_returns=1, timeout=timeout)
            if not ready:
                break  # grace over: the rest are stuck or their death is not known yet
            ref = ready[0]
            rank = by_ref[ref]
            worker = self.workers[rank]
            try:
                outcome: RunOutcome = ray.get(ref)
                self.pool.give_back(worker, outcome.held, alive=True)
                outcomes[rank] = outcome
                bad = outcome.error is not None or outcome.aborted
            except ray.exceptions.RayActorError as exc:
                self.pool.give_back(worker, None, alive=False)
                # Its node's raylet gone too: the node died, not the process alone
                # (`elastrain.workers.runtime.liveness`).
                if worker.node_id not in node_gone:
                    node_gone[worker.node_id] = raylet_gone(worker.node_id)
                gone = node_gone[worker.node_id]
                outcomes[rank] = WorkerError(
                    type=type(exc).__name__,
                    kind=ErrorKind.NODE_DIED if gone else ErrorKind.PROCESS_DIED,
                    message=f"the process of rank {rank} died: {str(exc).splitlines()[0][:300]}",
                    rank=rank,
                    node_id=worker.node_id,
                    pid=worker.info.pid if worker.info else None,
                )
                bad = True
            if bad and deadline is None:
                deadline = time.monotonic() + OUTCOME_GRACE_S
        for ref in pending:  # stuck: told to let go; the pool takes them back when they do
            rank = by_ref[ref]
            self.workers[rank].handle.abort.remote(self.pool.token)
            threading.Thread(target=self._late_return, args=(ref, rank), daemon=True).start()
        return [outcomes.get(r, _stuck(r)) for r in range(len(refs))]

    def _late_return(self, ref: Any, rank: int) -> None:
        worker = self.workers[rank]
        try:
            outcome: RunOutcome = ray.get(ref)
            self.pool.give_back(worker, outcome.held, alive=True)
        except Exception:
            self.pool.give_back(worker, None, alive=False)

    def _verdict(
        self, outcomes: Sequence[RunOutcome | WorkerError]
    ) -> tuple[DriverStatus, WorkerError | None]:
        errors = [o for o in outcomes if isinstance(o, WorkerError)]
        errors += [o.error for o in outcomes if isinstance(o, RunOutcome) and o.error is not None]
        stopped = any(isinstance(o, RunOutcome) and o.stopped_early for o in outcomes)
        if self._command and stopped and not any(e.kind in _DIED for e in errors):
            # Asked to stop (a resize): a script that exited first broke its peers'
            # collectives, and their exits are echoes of the stop, not failures.
            return DriverStatus.STOPPED, None
        if errors:
            return DriverStatus.FAILED, cause_of(errors)
        if any(isinstance(o, RunOutcome) and o.aborted for o in outcomes):
            return DriverStatus.FAILED, WorkerError(
                type="AttemptAborted", kind=ErrorKind.ABORTED, message="attempt released"
            )
        rank0 = outcomes[0]
        assert isinstance(rank0, RunOutcome)
        return (DriverStatus.STOPPED if rank0.stopped_early else DriverStatus.SUCCEEDED), None

    def _describe_workers(self) -> str:
        warm = sum(1 for w in self.workers if w.info is not None)
        holders = sum(
            1 for w in self.workers if w.held is not None and w.held.job == self.request.job
        )
        return f"{len(self.workers)} processes: {warm} warm, {holders} holding the job's state"

    def _remove_placement_group(self) -> None:
        pg, self.pg = self.pg, None
        if pg is not None:
            try:
                remove_placement_group(pg)
            except Exception as exc:  # already removed is fine
                log.info("remove placement group: %s", exc)


def avoiding(nodes: Sequence[str]) -> dict[str, str]:
    """A bundle label selector that keeps a bundle off these (draining) nodes: Ray's
    `!in(...)` on the node id label every node carries; {} when there are none. No space
    after the commas: Ray 2.60 matches the values as written, so `!in(a, b)` would not
    keep a bundle off b."""
    return {"ray.io/node-id": f"!in({','.join(sorted(nodes))})"} if nodes else {}


def group_prefix(namespace: str) -> str:
    """Placement groups of this namespace's attempts are named with it (then the attempt's
    name): the runtime removes those no live attempt owns, and no other service's."""
    return f"{namespace}:"


def _held_step(w: PooledWorker, job: JobRef) -> int | None:
    held = w.held
    return held.step if held is not None and held.job == job else None


def private_worker_options(spec: JobSpec) -> dict[str, Any] | None:
    """Ray options for a rank that cannot run in a warm pooled process, or None.

    Ray gives a process its pip packages only when it starts in their environment: such a
    rank is a new process inside its bundle, private to its attempt and gone with the
    placement group. (Ray caches the pip environment per node and requirement list, so
    only the first start pays the install.) A GPU rank of such a job borrows the GPU of a
    pooled process, which stays lent to the attempt meanwhile (`AttemptDriver._place`).
    GPU jobs otherwise run in the pool's warm GPU processes (`elastrain.workers.runtime.pool`).
    """
    if spec.workload.requirements:
        return {"runtime_env": {"pip": list(spec.workload.requirements)}}
    return None


def cause_of(errors: Sequence[WorkerError]) -> WorkerError:
    """The error that explains the failure: a process that died, else an error that is not
    merely a survivor's broken collective (nor a rank stuck behind one), else the first."""
    died = [e for e in errors if e.kind in _DIED]
    if died:
        return died[0]
    own = [e for e in errors if e.kind not in _ECHOES]
    return (own or list(errors))[0]


#: A rank's process died (alone, or with its node).
_DIED = frozenset({ErrorKind.PROCESS_DIED, ErrorKind.NODE_DIED})
#: Kinds that follow from another rank's failure rather than explain it.
_ECHOES = frozenset({ErrorKind.PEER_LOST, ErrorKind.STUCK})


def _stuck(rank: int) -> WorkerError:
    return WorkerError(
        type="WorkerStuck",
        kind=ErrorKind.STUCK,
        message=f"rank {rank} did not let go in time",
        rank=rank,
    )
