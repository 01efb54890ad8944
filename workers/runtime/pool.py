"""Warm worker processes, kept per node, handed to attempts and taken back.

A `WorkerProcess` (`workers.process`) is a detached Ray actor with torch and the training
loop imported. The pool keeps a few idle ones on every node ahead of need, so a new
worker group costs no process start and no imports. A process that trained in an
attempt comes back holding the job's state in memory; the job's next attempt prefers it
(`choose_worker`), which is how a survivor of a node loss hands its state on.

The processes ask Ray for no CPU themselves (`num_cpus=0`): they are started before any
job needs them. An attempt reserves its CPUs (and GPUs) with a placement group whose
bundles sit on the nodes of the processes it runs on, so Ray's resource view stays true.

This lives inside the runtime actor (`workers.runtime.actor`); the worker class is
imported when the pool is made, so importing the runtime loads no torch.
"""

from __future__ import annotations

import itertools
import logging
import math
import threading
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any, cast

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from contracts.group import HeldState, WorkerInfo
from contracts.runtime import AttemptKey, JobRef

log = logging.getLogger("elastrain.pool")

WORKER_PREFIX = "elastrain-worker-"
#: A describe() that takes longer marks the process as gone.
_PING_TIMEOUT_S = 10.0


@dataclass
class PooledWorker:
    name: str
    handle: Any
    node_id: str
    info: WorkerInfo | None = None
    """None until the process answered once (it is still starting)."""
    busy: bool = False
    """Handed to an attempt, not yet given back."""
    lent_to: AttemptKey | None = None
    """The attempt that has it (or had it last)."""
    lent_job_ref: JobRef | None = None
    """That attempt's job."""
    returned_at: float = 0.0
    forget_job: JobRef | None = None
    """Drop this job's state when the process comes back (the job ended)."""
    ready_ref: Any = None
    private: bool = False
    """Started for one attempt (its GPUs or pip environment): never lent to another."""

    @property
    def held(self) -> HeldState | None:
        return self.info.held if self.info is not None else None

    @property
    def lent_job(self) -> JobRef | None:
        """The job of the attempt running here now."""
        return self.lent_job_ref if self.busy else None

    @property
    def idle(self) -> bool:
        return self.info is not None and not self.busy


def choose_worker(candidates: Sequence[PooledWorker], job: JobRef) -> PooledWorker | None:
    """Among idle processes on one node: the one holding the newest state of `job`, else
    one holding nothing, else any (its other job's state is dropped)."""

    def rank(w: PooledWorker) -> tuple[int, int]:
        held = w.held
        if held is not None and held.job == job:
            return (2, held.step)
        return (1 if held is None else 0, 0)

    idle = [w for w in candidates if w.idle and not w.private]
    return max(idle, key=rank) if idle else None


def warm_target(*, node_cpus: float, busy: int, per_node: int) -> int:
    """Idle processes to keep on a node: `per_node`, but no more than the node has CPUs
    left to run (busy ones count), except one spare: when a job's processes are stuck (a
    collective waiting on a peer that is gone without closing its sockets), its next
    attempt takes the spare instead of starting a process."""
    if per_node <= 0:
        return 0
    return min(per_node, max(1, math.ceil(node_cpus) - busy))


@dataclass
class WorkerPool:
    namespace: str
    warm_per_node: int
    workers: dict[str, PooledWorker] = field(default_factory=dict)
    lock: threading.RLock = field(default_factory=threading.RLock)
    _cls: Any = None
    _counter: itertools.count[int] = field(default_factory=lambda: itertools.count(1))

    def __post_init__(self) -> None:
        from workers.process import WorkerProcess  # torch: only inside the runtime actor

        self._cls = ray.remote(WorkerProcess)
        self._adopt()

    # -- processes ---------------------------------------------------------------------------
    def _adopt(self) -> None:
        """After a runtime restart: take over the processes the old runtime left."""
        for entry in ray.util.list_named_actors(all_namespaces=True):
            name = entry["name"]
            if entry["namespace"] != self.namespace or not name.startswith(WORKER_PREFIX):
                continue
            try:
                handle = ray.get_actor(name, namespace=self.namespace)
                info = cast(WorkerInfo, ray.get(handle.describe.remote(), timeout=_PING_TIMEOUT_S))
            except Exception:
                continue
            if info.busy:  # its attempt's driver died with the old runtime
                handle.abort.remote()
            self.workers[name] = PooledWorker(
                name=name, handle=handle, node_id=info.node_id, info=info, busy=info.busy
            )
        if self.workers:
            log.info("adopted %d worker processes", len(self.workers))

    def start(self, node_id: str, *, private: bool = False, **options: Any) -> PooledWorker:
        """Start a process on `node_id` (it answers when its imports are done)."""
        name = f"{WORKER_PREFIX}{node_id[:8]}-{next(self._counter)}-{uuid.uuid4().hex[:4]}"
        if "scheduling_strategy" not in options:
            options["scheduling_strategy"] = NodeAffinitySchedulingStrategy(node_id, soft=False)
        handle = self._cls.options(
            name=name,
            namespace=self.namespace,
            lifetime="detached",
            max_restarts=0,
            max_concurrency=8,
            **{"num_cpus": 0, **options},
        ).remote(name)
        worker = PooledWorker(name=name, handle=handle, node_id=node_id, private=private)
        worker.ready_ref = handle.describe.remote()
        with self.lock:
            self.workers[name] = worker
        return worker

    def wait_ready(self, workers: Sequence[PooledWorker], timeout: float) -> None:
        """Block until each of `workers` answered once (raises if one never does)."""
        for w in workers:
            if w.info is None:
                w.info = ray.get(w.ready_ref, timeout=timeout)

    # -- lending -----------------------------------------------------------------------------
    def job_workers(self, job: JobRef) -> list[PooledWorker]:
        """This job's processes that hold its state or still run its last attempt."""
        with self.lock:
            return [
                w
                for w in self.workers.values()
                if (w.held is not None and w.held.job == job) or w.lent_job == job
            ]

    def take(self, worker: PooledWorker, key: AttemptKey, job: JobRef) -> None:
        with self.lock:
            worker.busy = True
            worker.lent_to, worker.lent_job_ref = key, job

    def give_back(self, worker: PooledWorker, held: HeldState | None, *, alive: bool) -> None:
        with self.lock:
            if not alive or worker.private:  # a private one dies with its placement group
                self.workers.pop(worker.name, None)
                return
            worker.busy = False
            worker.returned_at = time.time()
            if held is not None and worker.forget_job == held.job:
                worker.handle.forget.remote()
                held = None
            if worker.info is not None:
                worker.info = replace(worker.info, busy=False, held=held)
            worker.forget_job = None

    def forget_job(self, job: JobRef) -> None:
        """The job ended: its processes drop its state (now, or when they come back)."""
        with self.lock:
            for w in self.workers.values():
                if w.lent_job == job:
                    w.forget_job = job
                elif w.held is not None and w.held.job == job:
                    w.handle.forget.remote()
                    w.info = replace(w.info, held=None) if w.info is not None else None

    def held_jobs(self) -> set[JobRef]:
        """Jobs whose state a process holds, or will hold when its attempt lets go (unless
        it is to drop it then)."""
        with self.lock:
            held = {w.held.job for w in self.workers.values() if w.held is not None}
            lent = {
                job
                for w in self.workers.values()
                if (job := w.lent_job) is not None and w.forget_job != job
            }
        return held | lent

    def abort_strays(self, live: set[AttemptKey]) -> None:
        """Tell processes still running an attempt that is not live to let go (again: the
        abort sent when it was released may have been lost)."""
        with self.lock:
            strays = [w for w in self.workers.values() if w.busy and w.lent_to not in live]
        for w in strays:
            w.handle.abort.remote()

    # -- upkeep --------------------------------------------------------------------------------
    def top_up(self, nodes: Sequence[dict[str, Any]]) -> None:
        """One upkeep pass: forget processes on dead nodes, notice started ones, and keep
        `warm_per_node` idle processes on every node that has CPUs."""
        alive = {n["NodeID"]: n for n in nodes if n.get("Alive")}
        with self.lock:
            for w in list(self.workers.values()):
                if w.node_id not in alive:
                    self.workers.pop(w.name, None)
                elif w.info is None and w.ready_ref is not None:
                    ready, _ = ray.wait([w.ready_ref], timeout=0)
                    if ready:
                        try:
                            w.info = ray.get(w.ready_ref)
                        except Exception as exc:
                            log.warning("worker %s failed to start: %s", w.name, exc)
                            self.workers.pop(w.name, None)
            by_node: dict[str, list[PooledWorker]] = {}
            for w in self.workers.values():
                by_node.setdefault(w.node_id, []).append(w)
        for node_id, node in alive.items():
            cpus = float(node.get("Resources", {}).get("CPU", 0.0))
            if cpus <= 0:
                continue
            mine = by_node.get(node_id, [])
            busy = sum(1 for w in mine if w.busy)
            spare = sum(1 for w in mine if not w.busy and not w.private)  # idle or starting
            for _ in range(
                warm_target(node_cpus=cpus, busy=busy, per_node=self.warm_per_node) - spare
            ):
                self.start(node_id)

    def check_idle(self) -> None:
        """Ping idle processes, and busy ones no driver collects (adopted from a runtime
        that died, told to let go); forget those that died (killed, OOM), take back the
        adopted ones that let go."""
        with self.lock:
            idle = [w for w in self.workers.values() if w.idle or _adopted_busy(w)]
        refs = {w.handle.describe.remote(): (w, w.returned_at) for w in idle}
        if not refs:
            return
        ready, _ = ray.wait(list(refs), num_returns=len(refs), timeout=_PING_TIMEOUT_S)
        for ref, (w, returned_at) in refs.items():
            if ref not in ready:
                continue
            try:
                info = ray.get(ref)
            except Exception:
                with self.lock:
                    self.workers.pop(w.name, None)
                continue
            with self.lock:
                if _adopted_busy(w) and not info.busy:
                    w.busy = False
                if not w.busy and w.returned_at == returned_at:  # not lent out meanwhile
                    w.info = info


def _adopted_busy(w: PooledWorker) -> bool:
    return w.busy and w.lent_to is None and w.info is not None
