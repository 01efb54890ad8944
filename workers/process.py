"""A worker process that outlives attempts: a Ray actor per process, warm and reused.

Every attempt used to start new processes that each imported torch (seconds per process
on a small machine) and threw away the model they had trained. A `WorkerProcess` is
started once, ahead of need, with torch, the training loop and the workloads imported.
The runtime (`elastrain.workers.runtime`) hands it one rank of one attempt at a time
(`run`): it joins a fresh `torch.distributed` process group for that attempt, trains,
and leaves the group again when the attempt ends, however it ends. What it trained stays
in `self.memory`, so the next attempt's group can take the state from here (no step
lost) rather than from the last checkpoint.

Only glue lives here: process group set-up, hooks that report to the runtime, and error
records with rank and node. The loop itself (`elastrain.workers.loop.train`) knows nothing of Ray.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import logging
import math
import os
import socket
import threading
import time
import traceback
from collections import deque
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import ray

from elastrain.contracts.capability import matches_digest
from elastrain.contracts.group import Assignment, HeldState, RankProgress, RunOutcome, WorkerInfo
from elastrain.contracts.messages import (
    Control,
    ErrorKind,
    EventKind,
    Phase,
    StepMetrics,
    TimelineMark,
    WorkerError,
    WorkerEvent,
    WorkerMessage,
)
from elastrain.contracts.runtime import AttemptKey, JobRef
from elastrain.contracts.storage import JobStorage
from elastrain.workers.comm_release import GroupSockets, attempt_groups, release_group
from elastrain.workers.progress import Progress
from elastrain.workers.rank_output import captured_output
from elastrain.workers.runtime.guard import RefusalLog
from elastrain.workers.start_priority import imports_first

if TYPE_CHECKING:  # torch is imported when the process starts, not by the runtime
    from torch.distributed import TCPStore

log = logging.getLogger("elastrain.worker")

#: Step metrics are sent to the runtime at most this often (in batches).
_PUSH_INTERVAL_S = 0.5
#: The most an ending attempt waits for its last messages to reach the runtime.
_FLUSH_TIMEOUT_S = 10.0
#: After an abort, how long a rank may take to reach its step boundary before its group's
#: connections are cut (`elastrain.workers.comm_release`): a rank blocked in a collective on a peer
#: that is gone never would.
RELEASE_AFTER_S = 0.5
#: The most metric points rank 0 keeps while not known to have reached the runtime: a node
#: cut off from the service trains on until its attempt is fenced (hundreds of steps at a
#: small model's speed), and the loop saves these with each checkpoint.
UNDELIVERED_KEPT = 10_000


class RuntimeHooks:
    """`TrainHooks` for rank 0: fire-and-forget calls to the runtime actor, never blocking
    the training step.

    Each remote call costs rank 0 and the runtime actor CPU on the cores training runs on,
    so step metrics are sent in batches, at most every `_PUSH_INTERVAL_S` (any other message,
    rarer and wanted at once, goes immediately with what is pending, in order). Controls
    are not asked for: the runtime pushes them into this process (`WorkerProcess.control`)
    and `take_control` reads them from memory: a remote call per step made steps
    measurably slower than a plain torchrun script (docs/benchmarks.md, part 1)."""

    def __init__(
        self,
        runtime: Any,
        key: AttemptKey,
        take_control: Callable[[], Control],
        *,
        capability: str,
        clock: Callable[[], float] = time.monotonic,
        wait: Callable[..., tuple[list[Any], list[Any]]] = ray.wait,
    ) -> None:
        self.runtime = runtime
        self.key = key
        self._capability = capability  # the attempt's: the runtime takes no report without it
        self.take_control = take_control
        self.clock = clock
        self._wait = wait  # Ray's, or a test's
        self._in_flight: list[tuple[Any, int]] = []  # (push, its last step or -1), in order
        self._batches = 0  # pushes so far: the next one's number
        self._delivered = -1  # the newest step the runtime is known to have
        self._undelivered: deque[StepMetrics] = deque(maxlen=UNDELIVERED_KEPT)
        self._pending: list[WorkerMessage] = []
        self._pushed_at = -math.inf

    def send(self, message: WorkerMessage) -> None:
        self._pending.append(message)
        if isinstance(message, StepMetrics):
            self._undelivered.append(message)
        now = self.clock()
        if isinstance(message, StepMetrics) and now - self._pushed_at < _PUSH_INTERVAL_S:
            return
        self._push(now)

    def _push(self, now: float) -> None:
        if not self._pending:
            return
        batch, self._pending = self._pending, []
        self._pushed_at = now
        last = max((m.step for m in batch if isinstance(m, StepMetrics)), default=-1)
        # Numbered: the runtime actor is threaded, so it may run two calls in flight out of
        # order; the driver puts them back in this order (`elastrain.workers.runtime.ordering`).
        ref = self.runtime.push_many.remote(self.key, self._capability, self._batches, batch)
        self._batches += 1
        self._in_flight.append((ref, last))
        self._forget_delivered()

    def _forget_delivered(self) -> None:
        """Note which pushes the runtime has (a look, no waiting) and forget them. The
        runtime applies them in number order, so only an unbroken run of answered pushes
        from the oldest is known applied; its newest step is the bound."""
        refs = [ref for ref, _ in self._in_flight]
        ready, _ = self._wait(refs, num_returns=len(refs), timeout=0)
        done = set(ready)
        applied = 0
        for ref, last in self._in_flight:
            if ref not in done:
                break
            self._delivered = max(self._delivered, last)
            applied += 1
        self._in_flight = self._in_flight[applied:]
        while self._undelivered and self._undelivered[0].step <= self._delivered:
            self._undelivered.popleft()

    def undelivered(self) -> list[StepMetrics]:
        return list(self._undelivered)

    def flush(self, timeout_s: float = _FLUSH_TIMEOUT_S) -> None:
        """Send what is pending and wait until the runtime has every message sent so far.
        The attempt's end travels another way (this process's `run` returning to the
        driver), which could otherwise overtake the last metric or checkpoint message and
        leave it unreported."""
        self._push(self.clock())
        if self._in_flight:
            refs = [ref for ref, _ in self._in_flight]
            self._wait(refs, num_returns=len(refs), timeout=timeout_s)
            self._in_flight = []

    def poll_control(self) -> Control:
        control = self.take_control()
        if control != Control.NONE:
            # Whatever follows (a checkpoint, the end) comes after the metrics before it.
            self._push(self.clock())
        return control


class SilentHooks:
    """Ranks other than 0 report nothing (rank 0 speaks for the group)."""

    def send(self, message: WorkerMessage) -> None: ...

    def poll_control(self) -> Control:
        return Control.NONE

    def undelivered(self) -> list[StepMetrics]:
        return []  # rank 0's checkpoint manifest carries the points, not this rank's


def run_at_normal_priority() -> None:
    """Train at niceness 0, as a torchrun rank does. Ray starts worker processes at
    niceness 15 (its `worker_niceness`, so that its daemons stay responsive); a rank there
    loses its core to any normal-priority process (the service, Ray's daemons) for as long
    as that process wants it, and every peer then waits at the next collective
    (docs/benchmarks.md, part 1). Linux keeps niceness per thread: this sets the calling
    thread's (the one `run` trains on), and the threads it starts (the process group's)
    inherit it. Lowering niceness needs CAP_SYS_NICE or a nice rlimit; without either the
    rank trains at Ray's niceness, as before (or start Ray with `RAY_worker_niceness=0`)."""
    thread = threading.get_native_id()
    try:
        if os.getpriority(os.PRIO_PROCESS, thread) > 0:
            os.setpriority(os.PRIO_PROCESS, thread, 0)
    except OSError as exc:
        log.info("training at Ray's worker niceness: %s", exc)


class WorkerProcess:
    """Wrapped with `ray.remote` by the runtime (kept a plain class for readability)."""

    def __init__(
        self,
        name: str,
        gpu: int | None = None,
        pool_digest: bytes = b"",
        *,
        imports_ahead: bool = True,
    ) -> None:
        # Before torch can initialise CUDA: this process sees its own GPU (a GPU process,
        # `gpu` = the node-local index it owns for its lifetime) or none (a CPU process).
        from elastrain.workers.devices import pin_visible_gpu, warm_cuda

        # What the raylet gave: a command job's script sees its node's ranks' GPUs.
        self._inherited_gpus = os.environ.get("CUDA_VISIBLE_DEVICES")
        pin_visible_gpu(gpu)
        # The imports are the point: paid once, when the process starts, not per attempt.
        # torch._dynamo alone takes seconds (docs/bench-elastic.md): DistributedDataParallel
        # imports it lazily, on its first construction, which would otherwise land in the
        # first attempt. Ahead of the ranks training beside it (`imports_first`) when a
        # rank, or a grow onto this node, waits for this process (the pool says which).
        with imports_first() if imports_ahead else contextlib.nullcontext():
            import torch
            import torch._dynamo
            import torch.distributed.fsdp
            import torch.distributed.pipelining

            import elastrain.checkpoints.dcp
            import elastrain.workers.loop
            import elastrain.workers.workloads  # noqa: F401
            from elastrain.workers.memory.replica import ReplicaMemory
            from elastrain.workers.netif import pin_collectives_to
            from elastrain.workers.workloads.gpt import load_corpus

            load_corpus()  # the built-in corpus, parsed once per process

        torch.set_num_threads(1)
        self.gpu = gpu
        self.device = warm_cuda(gpu)  # the CUDA context too, when it owns a GPU
        self.name = name
        # Only the digest of the pool's token (`elastrain.contracts.capability`): a job's own
        # code runs in this process and could read the token itself from its memory.
        self._pool_digest = pool_digest
        self._refusals = RefusalLog(name)
        self.node_id = ray.get_runtime_context().get_node_id()
        self.address = ray.util.get_node_ip_address()
        # Collectives listen where the cluster reaches this node, not wherever the hostname
        # happens to resolve (containers, network namespaces, several NICs).
        pin_collectives_to(self.address)
        self.memory = ReplicaMemory()
        self.database = ""  # of the job whose state `memory` holds
        self._lock = threading.Lock()
        self._busy = False
        self._abort = threading.Event()
        self._progress: Progress | None = None  # the running rank's, for `progress`
        self._group_sockets: GroupSockets | None = None
        self._running: AttemptKey | None = None  # the attempt this process runs a rank of
        self._own_code_of: JobRef | None = None  # told to the pool (`runs_own_code`)
        # Controls pushed by the runtime, by attempt, until that attempt's rank 0 takes them
        # (one can arrive before the rank it is for has started).
        self._controls: dict[AttemptKey, list[Control]] = {}
        self._hosted_store: TCPStore | None = None  # the next group's, until rank 0 takes it
        self.warm_at = time.time()  # its imports done: from now on a rank starts at once

    def accepts(self, token: str) -> bool:
        """Whether `token` is the pool token this process was made with (a runtime that
        adopts it checks it can command it)."""
        return matches_digest(self._pool_digest, token)

    def _check(self, token: object, method: str, claimed: object = None) -> None:
        """The calls below act on an attempt or a job: the runtime's alone."""
        if not matches_digest(self._pool_digest, token):
            raise self._refusals.refuse(method, claimed)

    def describe(self) -> WorkerInfo:
        with self._lock:
            return WorkerInfo(
                name=self.name,
                node_id=self.node_id,
                pid=os.getpid(),
                address=self.address,
                busy=self._busy,
                held=self._held(),
                gpu=self.gpu,
                device=self.device,
                own_code_of=self._own_code_of,
                warm_at=self.warm_at,
            )

    def _held(self) -> HeldState | None:
        held = self.memory.describe()
        return None if held is None else dataclasses.replace(held, database=self.database)

    def host_store(self, token: str, world_size: int, timeout_s: float) -> int:
        """Open the TCPStore of the next group, whose rank 0 will run here, and return its
        port. It listens from now on, on a port the OS picked: a port merely found free now
        and bound when rank 0 starts could be taken in between (by one of the collectives'
        own connections, which use the same ephemeral range). Rank 0's assignment takes it;
        a newer call replaces one that was never used."""
        from elastrain.workers.rendezvous import host_store

        self._check(token, "host_store")
        store = host_store(self.address, world_size, datetime.timedelta(seconds=timeout_s))
        with self._lock:
            self._hosted_store = store
        return int(store.port)

    def _take_hosted_store(self, a: Assignment) -> TCPStore | None:
        """The store `host_store` opened for this assignment (rank 0 on its port), or None."""
        with self._lock:
            store, self._hosted_store = self._hosted_store, None
        if a.rank == 0 and store is not None and store.port == a.master_port:
            return store
        return None

    def abort(self, token: str) -> None:
        """Let go of the current attempt at the next step boundary (the others fail their
        next collective and let go too); no-op when idle."""
        self._check(token, "abort", self._running)
        with self._lock:
            if not self._busy:
                return
            self._abort.set()
            running = self._running
        threading.Thread(target=self._free_if_blocked, args=(running,), daemon=True).start()

    def _free_if_blocked(self, aborted: AttemptKey | None) -> None:
        """Still busy `RELEASE_AFTER_S` after an abort: blocked in a collective (on a peer
        that is gone, or one that is itself blocked); free it, and the loop stops as on a
        peer loss, keeping its state for the next attempt."""
        deadline = time.monotonic() + RELEASE_AFTER_S
        while time.monotonic() < deadline:
            with self._lock:
                if self._running != aborted:
                    return  # that attempt ended here (another may have begun)
            time.sleep(0.02)
        with self._lock:
            if self._running != aborted or not self._abort.is_set():
                return
            sockets = self._group_sockets
        how = release_group(sockets)
        log.warning("%s: still in its attempt %.1fs after an abort: %s", self.name,
                    RELEASE_AFTER_S, how)  # fmt: skip

    def progress(self, token: str, key: AttemptKey) -> RankProgress | None:
        """How far this process's rank of attempt `key` got (the runtime's hang watch);
        None when it runs no such rank, or one whose loop has not started."""
        self._check(token, "progress", key)
        with self._lock:
            progress = self._progress if self._running == AttemptKey(*key) else None
        return progress.snapshot() if progress is not None else None

    def control(self, token: str, key: AttemptKey, controls: list[Control]) -> None:
        """The runtime's requests for an attempt whose rank 0 runs here (or will)."""
        self._check(token, "control", key)
        with self._lock:
            self._controls.setdefault(AttemptKey(*key), []).extend(Control(c) for c in controls)

    def _take_control(self, key: AttemptKey) -> Control:
        with self._lock:
            queued = self._controls.get(key)
            return queued.pop(0) if queued else Control.NONE

    def forget(self, token: str) -> None:
        """Drop the held state (its job ended); no-op while training."""
        self._check(token, "forget")
        with self._lock:
            if not self._busy:
                self.memory.forget()

    def free_gpu(self, token: str) -> None:
        """Lend this process's GPU to a process of the same attempt (a job with its own pip
        packages runs in a private process on this GPU): drop the held state and give the
        cached device memory back to the driver; no-op while training."""
        import gc

        import torch

        self._check(token, "free_gpu")
        with self._lock:
            if self._busy:
                return
            self.memory.forget()
        gc.collect()
        if torch.cuda.is_initialized():
            torch.cuda.empty_cache()

    def run(self, token: str, assignment: Assignment) -> RunOutcome:
        self._check(token, "run", getattr(assignment, "job_id", None))
        with self._lock:
            if self._busy:
                return RunOutcome(
                    rank=assignment.rank,
                    error=WorkerError(
                        type="WorkerBusy", kind=ErrorKind.BUSY, message=f"{self.name} is busy"
                    ),
                )
            self._busy = True
            self._abort.clear()
            if assignment.database != self.database:  # never another database's job 1
                self.memory.forget()
                self.database = assignment.database
            key = AttemptKey(assignment.job_id, assignment.attempt)
            self._running = key
            # Requests for attempts that ended here (or never started) are moot now.
            self._controls = {k: v for k, v in self._controls.items() if k == key}
        try:
            run_at_normal_priority()
            outcome = self._run(assignment)
        finally:
            with self._lock:
                self._busy = False
                self._running = None
                self._progress = None
                self._controls.pop(key, None)
        return dataclasses.replace(outcome, held=self._held())

    def _use_package(self, a: Assignment) -> WorkerEvent | None:
        """Make the job's uploaded package (if any) importable, verified against its digest;
        what rank 0 reports about it (every attempt says which package it ran)."""
        from elastrain.workers.packages import activate, import_from, materialize

        workload = a.spec.workload
        if workload.package is None or workload.entrypoint is None:
            activate(None)  # nothing of an earlier job's package stays importable
            return None
        t0 = time.perf_counter()
        files = materialize(Path(a.storage_path), workload.package)
        activate(files)
        import_from(files, workload.entrypoint.partition(":")[0])
        return WorkerEvent(
            event=EventKind.PACKAGE,
            reason=f"runs package {workload.package} (verified, "
            f"{time.perf_counter() - t0:.2f}s to make importable)",
            details={"digest": workload.package, "node_id": self.node_id},
        )

    def _run_command(self, a: Assignment, storage: JobStorage, log_path: Path) -> RunOutcome:
        """A command job's rank: its script in a child process (`elastrain.workers.command`)."""
        from elastrain.workers.command import ScriptRun
        from elastrain.workers.devices import visible_devices_for
        from elastrain.workers.errors import script_error_kind
        from elastrain.workers.packages import materialize

        key = AttemptKey(a.job_id, a.attempt)
        package = a.spec.workload.package
        cwd = materialize(Path(a.storage_path), package) if package else storage.files
        store = self._take_hosted_store(a)
        if a.rank == 0 and store is None:  # not hosted ahead (an older driver): host it now
            import torch.distributed as dist

            store = dist.TCPStore(
                a.master_addr, a.master_port, a.world_size, is_master=True,
                wait_for_workers=False,
                timeout=datetime.timedelta(seconds=a.collective_timeout_s),
            )  # fmt: skip
        hooks: RuntimeHooks | None = None
        if a.rank == 0:
            runtime = ray.get_actor(a.runtime_name, namespace=a.namespace)
            hooks = RuntimeHooks(runtime, key, lambda: Control.NONE, capability=a.capability)
        gpus = None
        if a.local_gpus:
            gpus = ",".join(visible_devices_for(g, self._inherited_gpus) for g in a.local_gpus)
        try:
            script = ScriptRun(
                a,
                cwd=cwd,
                job_dir=storage.files,
                log_path=log_path,
                send=hooks.send if hooks is not None else None,
                abort=self._abort,
                take_control=lambda: self._take_control(key),
                visible_gpus=gpus,
            )
            if hooks is not None:
                hooks.send(TimelineMark(phase=Phase.GROUP_FORMED, at=script.started_at,
                                        detail="rank 0's script started"))  # fmt: skip
            result = script.wait()
        finally:
            if hooks is not None:
                hooks.flush()
            del store  # rank 0's: open until every script has exited
        if result.aborted:
            return RunOutcome(rank=a.rank, final_step=result.last_step, aborted=True)
        if result.stopped or result.returncode == 0:
            return RunOutcome(
                rank=a.rank, final_step=result.last_step, stopped_early=result.stopped
            )
        error = WorkerError(
            type="ScriptFailed",
            message=result.failure_line()[:500],
            kind=script_error_kind(result.stderr_tail),
            rank=a.rank,
            node_id=self.node_id,
            hostname=socket.gethostname(),
            pid=os.getpid(),
            step=result.last_step,
            traceback=result.stderr_tail,
        )
        log.error("%s", error.summary())
        return RunOutcome(rank=a.rank, final_step=result.last_step, error=error)

    def _run_prepare(self, a: Assignment) -> RunOutcome:
        """A prepare job's one rank: Ray Data tokenizes its inputs over the cluster
        (`elastrain.workers.prepare`) while this process writes the shards and reports."""
        from elastrain.contracts.workload_params import PrepareParams
        from elastrain.workers.prepare import Preparation
        from elastrain.workers.workloads import builtin_params

        key = AttemptKey(a.job_id, a.attempt)
        runtime = ray.get_actor(a.runtime_name, namespace=a.namespace)
        hooks = RuntimeHooks(runtime, key, lambda: self._take_control(key), capability=a.capability)
        hooks.send(TimelineMark(phase=Phase.GROUP_FORMED, at=time.time(), detail="prepare"))
        steps = [0]

        def report(point: StepMetrics) -> None:
            steps[0] = point.step
            hooks.send(point)

        try:
            params = builtin_params("prepare", a.spec.workload.params)
            assert isinstance(params, PrepareParams)
            index = Preparation(params).run(
                Path(a.storage_path), report, hooks.take_control, self._abort
            )
        finally:
            hooks.flush()
        return RunOutcome(rank=a.rank, final_step=steps[0], stopped_early=index is None)

    def _run(self, a: Assignment) -> RunOutcome:
        if a.spec.workload.command is not None:  # its own output is piped to its log already
            return self._run_attempt(a)
        # Every line the rank's process writes (the job's prints, warnings, a traceback
        # below) in the rank's log file, not only in Ray's.
        log_path = JobStorage.of(a.storage_path, a.job_id).log_file(attempt=a.attempt, rank=a.rank)
        with captured_output(log_path, a.rank):
            return self._run_attempt(a)

    def _run_attempt(self, a: Assignment) -> RunOutcome:
        import torch
        import torch.distributed as dist

        from elastrain.workers.api import AttemptAborted, TrainContext
        from elastrain.workers.devices import rank_device
        from elastrain.workers.errors import error_kind
        from elastrain.workers.loop import train
        from elastrain.workers.strategies.mesh import leave_group

        if self.memory.job_id not in (None, a.job_id):
            self.memory.forget()  # another job's state: never resumed from here again
        scaling = a.spec.scaling
        # Fractional CPUs per worker on small machines: never oversubscribe with threads.
        torch.set_num_threads(max(1, int(scaling.cpus_per_worker)))
        where, backend = rank_device(scaling.use_gpu)
        device = torch.device(where)
        storage = JobStorage.of(a.storage_path, a.job_id)
        log_path = storage.log_file(attempt=a.attempt, rank=a.rank)
        ctx = TrainContext(
            rank=a.rank,
            world_size=a.world_size,
            local_rank=0,
            device=device,
            job_id=a.job_id,
            attempt=a.attempt,
            checkpoint_root=storage.checkpoints,
            log_path=log_path,
            progress=Progress(),
            storage_root=Path(a.storage_path),
            abort=self._abort,
            database=a.database,
            node=self.node_id,
        )
        with self._lock:
            self._progress = ctx.progress
        if a.spec.workload.runs_own_code and self._own_code_of is None:
            self._own_code_of = JobRef(a.database, a.job_id)
        try:
            if scaling.use_gpu and self.gpu is None:
                raise RuntimeError(f"{self.name} owns no GPU: a GPU rank reached a CPU process")
            if a.spec.workload.command is not None:
                return self._run_command(a, storage, log_path)
            if a.spec.workload.name == "prepare":
                return self._run_prepare(a)
            package = self._use_package(a)
            timeout = datetime.timedelta(seconds=a.collective_timeout_s)
            store = self._take_hosted_store(a)
            if store is None:
                store = dist.TCPStore(
                    a.master_addr, a.master_port, a.world_size, is_master=a.rank == 0,
                    timeout=timeout,
                )  # fmt: skip
            if device.type == "cuda":
                torch.cuda.set_device(device)
            with GroupSockets.opened(store_port=a.master_port) as sockets:
                dist.init_process_group(
                    backend,
                    store=store,
                    rank=a.rank,
                    world_size=a.world_size,
                    timeout=timeout,
                )
            with self._lock:
                self._group_sockets = sockets
            hooks: Any = SilentHooks()
            if a.rank == 0:
                runtime = ray.get_actor(a.runtime_name, namespace=a.namespace)
                key = AttemptKey(a.job_id, a.attempt)
                hooks = RuntimeHooks(
                    runtime, key, lambda: self._take_control(key), capability=a.capability
                )
                hooks.send(TimelineMark(phase=Phase.GROUP_FORMED, at=time.time()))
                if package is not None:
                    hooks.send(package)
            try:
                with attempt_groups(sockets):  # the groups the loop forms are released too
                    result = train(ctx, a.spec, hooks, self.memory)
            finally:
                if isinstance(hooks, RuntimeHooks):
                    hooks.flush()
            return RunOutcome(
                rank=a.rank, final_step=result.final_step, stopped_early=result.stopped_early
            )
        except AttemptAborted:
            return RunOutcome(rank=a.rank, final_step=ctx.step, aborted=True)
        except Exception as exc:
            error = WorkerError.from_exception(
                exc,
                kind=error_kind(exc),
                rank=a.rank,
                node_id=self.node_id,
                hostname=socket.gethostname(),
                pid=os.getpid(),
                step=ctx.step,
                traceback=traceback.format_exc()[-4000:],
            )
            log.error("%s\n%s", error.summary(), error.traceback)
            return RunOutcome(rank=a.rank, final_step=ctx.step, error=error)
        finally:
            # Leave the group whatever happened: the next attempt forms a new one.
            with self._lock:
                self._group_sockets = None
            with contextlib.suppress(Exception):
                leave_group()
