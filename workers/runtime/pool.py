"""Warm worker processes, kept per node, handed to attempts and taken back.

A `WorkerProcess` (`elastrain.workers.process`) is a detached Ray actor with torch and the training
loop imported. The pool keeps a few idle ones on every node ahead of need, so a new
worker group costs no process start and no imports. A process that trained in an
attempt comes back holding the job's state in memory; the job's next attempt prefers it
(`choose_worker`), which is how a survivor of a node loss hands its state on.

On a node with GPUs the pool also keeps one process per GPU that owns it for its
lifetime (`elastrain.workers.devices`): started with the GPU's node-local index, it sees that GPU
alone, has made its CUDA context, and serves GPU ranks only (a CPU process sees no GPU
and serves CPU ranks only). GPU jobs are lent these processes like CPU jobs are lent CPU
ones, so their ranks keep their processes (and the state in them) across recovery and
resize too.

The processes ask Ray for no CPU and no GPU themselves (`num_cpus=0`, `num_gpus=0`):
they are started before any job needs them. An attempt reserves its CPUs and GPUs with a
placement group whose bundles sit on the nodes of the processes it runs on, so Ray's
resource view stays true: a GPU is free in Ray exactly when no attempt borrows the
process that owns it, and the service's capacity arithmetic (node totals less what live
attempts hold) says the same. (Had each GPU process asked for `num_gpus=1`, Ray would
count every GPU as used for good, and an attempt's bundle asking for the GPU again would
never be placed: the same GPU counted twice.)

This lives inside the runtime actor (`elastrain.workers.runtime.actor`); the worker class is
imported when the pool is made, so importing the runtime loads no torch.
"""

from __future__ import annotations

import contextlib
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

from elastrain.contracts.capability import token_digest
from elastrain.contracts.group import HeldState, WorkerInfo
from elastrain.contracts.runtime import AttemptKey, JobRef

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
    """Started for one attempt (its pip environment): never lent to another."""
    gpu: int | None = None
    """The node-local index of the GPU it owns (None: a CPU process)."""
    dedicated_to: JobRef | None = None
    """The job whose own code (package or custom entrypoint) it ran: lent to that job's
    attempts only, and stopped when that job ends (`WorkloadSpec.runs_own_code`)."""

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


def choose_worker(
    candidates: Sequence[PooledWorker], job: JobRef, *, gpu: bool = False
) -> PooledWorker | None:
    """Among idle processes on one node of the kind the rank needs (owning a GPU or
    not): the one holding the newest state of `job`, else one holding nothing, else any
    (its other job's state is dropped). Never one dedicated to another job."""

    def rank(w: PooledWorker) -> tuple[int, int]:
        held = w.held
        if held is not None and held.job == job:
            return (2, held.step)
        return (1 if held is None else 0, 0)

    idle = [
        w
        for w in candidates
        if w.idle and not w.private and (w.gpu is not None) == gpu and w.dedicated_to in (None, job)
    ]
    return max(idle, key=rank) if idle else None


def gpus_to_start(node_gpus: float, owners: Sequence[PooledWorker]) -> list[int]:
    """The node-local GPU indices with no process owning them (`owners`: the node's GPU
    processes, busy, idle or starting)."""
    owned = {w.gpu for w in owners}
    return [i for i in range(int(node_gpus + 1e-9)) if i not in owned]


def surplus_gpu_workers(owners: Sequence[PooledWorker]) -> list[PooledWorker]:
    """GPU processes to stop: a second idle one on a GPU that already has a process (one
    was started beside a process stuck in a dead group, which has let go since). Kept per
    GPU: a busy one, else the one holding the newest state; starting ones are left be."""
    by_gpu: dict[int | None, list[PooledWorker]] = {}
    for w in owners:
        by_gpu.setdefault(w.gpu, []).append(w)
    doomed: list[PooledWorker] = []
    for same in by_gpu.values():
        if len(same) < 2 or any(w.info is None for w in same):
            continue
        keep = max(same, key=lambda w: (w.busy, w.held.step if w.held is not None else -1))
        doomed += [w for w in same if w is not keep and w.idle]
    return doomed


def warm_target(*, node_cpus: float, busy: int, per_node: int) -> int:
    """Idle processes to keep on a node: `per_node`, but no more than the node has CPUs
    left to run (busy ones count), except one spare: when a job's processes are stuck (a
    collective waiting on a peer that is gone without closing its sockets), its next
    attempt takes the spare instead of starting a process."""
    if per_node <= 0:
        return 0
    return min(per_node, max(1, math.ceil(node_cpus) - busy))


def spares_to_start(cpu_procs: Sequence[PooledWorker], *, node_cpus: float, per_node: int) -> int:
    """CPU processes the upkeep starts on a node now (`cpu_procs`: the node's CPU processes
    in any state): up to `warm_target` idle or starting ones free to serve any job, but
    none while a rank waits for a process still starting there (its imports and a new
    spare's would share the node's cores; the spare comes once it answered)."""
    if any(w.busy and w.info is None for w in cpu_procs):
        return 0
    busy = sum(1 for w in cpu_procs if w.busy)
    spare = sum(1 for w in cpu_procs if not w.busy and not w.private and w.dedicated_to is None)
    return max(0, warm_target(node_cpus=node_cpus, busy=busy, per_node=per_node) - spare)


@dataclass
class WorkerPool:
    namespace: str
    warm_per_node: int
    token: str
    """The pool token (`elastrain.contracts.capability.pool_token`): the processes act only on
    calls that carry it (they keep its digest)."""
    workers: dict[str, PooledWorker] = field(default_factory=dict)
    lock: threading.RLock = field(default_factory=threading.RLock)
    node_gpus: dict[str, float] = field(default_factory=dict)
    """GPUs of each alive node, as of the last upkeep pass."""
    live: set[AttemptKey] = field(default_factory=set)
    """The attempts live at the last reconcile: a process lent to another is let go of."""
    _cls: Any = None
    _counter: itertools.count[int] = field(default_factory=lambda: itertools.count(1))

    def __post_init__(self) -> None:
        from elastrain.workers.process import WorkerProcess  # torch: only inside the runtime actor

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
                ours = _accepts(handle, self.token)
            except Exception:  # gone meanwhile
                continue
            if not ours:  # another control key's (or an older runtime's): it would refuse us
                log.info("stopping %s: made by a runtime of another control key", name)
                with contextlib.suppress(Exception):
                    ray.kill(handle)
                continue
            if info.busy:  # its attempt's driver died with the old runtime
                handle.abort.remote(self.token)
            self.workers[name] = PooledWorker(
                name=name, handle=handle, node_id=info.node_id, info=info, busy=info.busy,
                gpu=info.gpu, dedicated_to=info.own_code_of,
            )  # fmt: skip
        if self.workers:
            log.info("adopted %d worker processes", len(self.workers))

    def start(
        self,
        node_id: str,
        *,
        gpu: int | None = None,
        private: bool = False,
        spare: bool = False,
        **options: Any,
    ) -> PooledWorker:
        """Start a process on `node_id` (it answers when its imports are done), owning the
        node's GPU of index `gpu` if one is given. Its imports run ahead of the ranks
        training beside it (`elastrain.workers.start_priority`) when something waits for
        it: a rank (not `spare`: the upkeep's top-up), or a grow onto its node (the
        node's first process)."""
        with self.lock:
            ahead = not spare or not any(w.node_id == node_id for w in self.workers.values())
        kind = "" if gpu is None else f"gpu{gpu}-"
        name = f"{WORKER_PREFIX}{node_id[:8]}-{kind}{next(self._counter)}-{uuid.uuid4().hex[:4]}"
        if "scheduling_strategy" not in options:
            options["scheduling_strategy"] = NodeAffinitySchedulingStrategy(node_id, soft=False)
        handle = self._cls.options(
            name=name,
            namespace=self.namespace,
            lifetime="detached",
            max_restarts=0,
            max_concurrency=8,
            **{"num_cpus": 0, "num_gpus": 0, **options},
        ).remote(name, gpu, token_digest(self.token), imports_ahead=ahead)
        worker = PooledWorker(name=name, handle=handle, node_id=node_id, private=private, gpu=gpu)
        worker.ready_ref = handle.describe.remote()
        with self.lock:
            self.workers[name] = worker
        # Noticed the moment it answers (Ray's core worker calls back), not at the next
        # upkeep pass: a job waiting to grow onto its node hears of it one pass sooner.
        worker.ready_ref.future().add_done_callback(lambda done: self._answered(worker, done))
        return worker

    def _answered(self, worker: PooledWorker, done: Any) -> None:
        """A starting process's first answer arrived (an error is left to `top_up`). Runs
        on Ray's callback thread, which must not wait: no lock taken. Nothing reads a
        starting process's `info` but to see that it is set (one assignment, the answer
        `top_up` would set), and none is lent before it is."""
        try:
            info = done.result()
        except Exception:
            return
        if worker.info is None:
            worker.info = info

    def spare_cpu_worker(self, node_id: str, exclude: Sequence[PooledWorker]) -> PooledWorker:
        """A CPU process on `node_id` for a rank when no idle one is left (call with `lock`
        held): one of the pool's still starting there, else a new one. Taking a starting
        one rather than starting another: on a fresh service the first job's ranks waited
        for new processes of their own while the pool's started too, all importing torch
        at once on the same cores (docs/bench-elastic.md)."""
        starting = [
            w
            for w in self.workers.values()
            if w.node_id == node_id
            and w.info is None
            and w.gpu is None
            and not w.busy
            and not w.private
            and w.dedicated_to is None
            and w not in exclude
        ]
        return starting[0] if starting else self.start(node_id)

    def gpu_slots(self, node_id: str) -> int:
        """GPU processes on `node_id` a rank could take now or soon: idle or starting ones,
        and GPUs nobody owns yet (call with `lock` held)."""
        owners = _owners([w for w in self.workers.values() if w.node_id == node_id])
        free = gpus_to_start(self.node_gpus.get(node_id, 0.0), owners)
        return sum(1 for w in owners if not w.busy) + len(free)

    def spare_gpu_worker(self, node_id: str, exclude: Sequence[PooledWorker]) -> PooledWorker:
        """A GPU process on `node_id` for a rank whose bundle Ray placed there when no idle
        one is left (call with `lock` held): one still starting, else a new one on a GPU
        nobody owns, else a new one beside a process stuck in an attempt that is over (a
        survivor blocked in a collective on a lost peer: the GPU is free in Ray, and the
        stuck process is stopped once it let go, `surplus_gpu_workers`)."""
        on_node = [w for w in self.workers.values() if w.node_id == node_id]
        owners = [w for w in _owners(on_node) if w not in exclude]
        starting = [w for w in owners if w.info is None and not w.busy]
        if starting:
            return starting[0]
        if node_id not in self.node_gpus:
            self.node_gpus.update(_gpus_of(ray.nodes()))
        free = gpus_to_start(self.node_gpus.get(node_id, 0.0), owners)
        if free:
            return self.start(node_id, gpu=free[0])
        kept = [w for w in owners if w.idle and w.dedicated_to is not None]
        if kept:  # it holds another job's state, and ran that job's code: not lent here
            self._retire(kept[0], "its GPU is wanted by another job")
            return self.start(node_id, gpu=kept[0].gpu)
        stuck = [w for w in owners if w.busy and w.lent_to not in self.live]
        if stuck:
            log.warning("GPU %s of node %s: a second process beside stuck %s",
                        stuck[0].gpu, node_id[:8], stuck[0].name)  # fmt: skip
            return self.start(node_id, gpu=stuck[0].gpu)
        raise RuntimeError(
            f"no free GPU process on node {node_id}: its {len(owners)} are all lent to live "
            "attempts (a GPU in use outside elastrain?)"
        )

    # -- lending -----------------------------------------------------------------------------
    def job_workers(self, job: JobRef) -> list[PooledWorker]:
        """This job's processes that hold its state or still run its last attempt."""
        with self.lock:
            return [
                w
                for w in self.workers.values()
                if (w.held is not None and w.held.job == job) or w.lent_job == job
            ]

    def take(
        self, worker: PooledWorker, key: AttemptKey, job: JobRef, *, own_code: bool = False
    ) -> None:
        with self.lock:
            worker.busy = True
            worker.lent_to, worker.lent_job_ref = key, job
            if own_code:
                worker.dedicated_to = job

    def give_back(self, worker: PooledWorker, held: HeldState | None, *, alive: bool) -> None:
        with self.lock:
            if not alive or worker.private:  # a private one dies with its placement group
                self.workers.pop(worker.name, None)
                return
            if worker.dedicated_to is not None and worker.forget_job == worker.dedicated_to:
                self._retire(worker, "its job ended")
                return
            worker.busy = False
            worker.returned_at = time.time()
            if held is not None and worker.forget_job == held.job:
                worker.handle.forget.remote(self.token)
                held = None
            if worker.info is not None:
                worker.info = replace(worker.info, busy=False, held=held)
            worker.forget_job = None

    def forget_job(self, job: JobRef) -> None:
        """The job ended: its processes drop its state (now, or when they come back)."""
        with self.lock:
            for w in list(self.workers.values()):
                if w.lent_job == job and w.busy:
                    w.forget_job = job
                elif w.dedicated_to == job:
                    self._retire(w, "its job ended")
                elif w.lent_job == job:
                    w.forget_job = job
                elif w.held is not None and w.held.job == job:
                    w.handle.forget.remote(self.token)
                    w.info = replace(w.info, held=None) if w.info is not None else None

    def stop(self, worker: PooledWorker, why: str) -> None:
        """Stop a process for good, now (upkeep starts another in its place)."""
        with self.lock:
            self.workers.pop(worker.name, None)
        log.warning("stopping %s: %s", worker.name, why)
        try:
            ray.kill(worker.handle)
        except Exception as exc:  # gone already
            log.info("stop %s: %s", worker.name, exc)

    def _retire(self, worker: PooledWorker, why: str) -> None:
        """Stop a process for good (call with `lock` held): upkeep starts a clean one."""
        self.workers.pop(worker.name, None)
        log.info("stopping %s (%s): it ran job %s's own code", worker.name, why,
                 worker.dedicated_to)  # fmt: skip
        try:
            ray.kill(worker.handle)
        except Exception as exc:  # gone already
            log.info("stop %s: %s", worker.name, exc)

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
            self.live = set(live)
            strays = [w for w in self.workers.values() if w.busy and w.lent_to not in live]
        for w in strays:
            w.handle.abort.remote(self.token)

    def ready_nodes(self) -> frozenset[str]:
        """The alive nodes (as of the last upkeep pass) where a rank need not wait for a
        process to start: a process of the pool has answered there (on a node with GPUs,
        one owning a GPU: what starts slowest), or the pool keeps none there."""
        with self.lock:
            answered = {w.node_id for w in self.workers.values() if w.info is not None}
            answered_gpu = {
                w.node_id for w in _owners(list(self.workers.values())) if w.info is not None
            }
            return frozenset(
                node
                for node, gpus in self.node_gpus.items()
                if (node in answered_gpu if gpus > 0 else node in answered)
                or (gpus <= 0 and self.warm_per_node <= 0)
            )

    def warm_at(self) -> dict[str, float]:
        """Node -> when the first of its answered processes had its imports done."""
        with self.lock:
            found: dict[str, float] = {}
            for w in self.workers.values():
                if w.info is not None and w.info.warm_at > 0:
                    found[w.node_id] = min(found.get(w.node_id, w.info.warm_at), w.info.warm_at)
            return found

    # -- upkeep --------------------------------------------------------------------------------
    def top_up(self, nodes: Sequence[dict[str, Any]]) -> None:
        """One upkeep pass: forget processes on dead nodes, notice started ones, keep
        `warm_per_node` idle CPU processes on every node that has CPUs and one process per
        GPU on every node that has GPUs (stopping a second one on a GPU)."""
        alive = {n["NodeID"]: n for n in nodes if n.get("Alive")}
        gpus = _gpus_of(nodes)
        with self.lock:
            self.node_gpus = gpus
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
            surplus = [w for mine in by_node.values() for w in surplus_gpu_workers(_owners(mine))]
            for w in surplus:
                self.workers.pop(w.name, None)
                by_node[w.node_id].remove(w)
            # Under the lock: a driver may start a process on a free GPU meanwhile
            # (`spare_gpu_worker`), and a GPU gets one owner, not two.
            for node_id in alive:
                for index in gpus_to_start(
                    gpus.get(node_id, 0.0), _owners(by_node.get(node_id, []))
                ):
                    started = self.start(node_id, gpu=index, spare=True)
                    by_node.setdefault(node_id, []).append(started)
        for w in surplus:
            log.info("stopping %s: a second process on GPU %s", w.name, w.gpu)
            ray.kill(w.handle)
        for node_id, node in alive.items():
            mine = by_node.get(node_id, [])
            cpus = float(node.get("Resources", {}).get("CPU", 0.0))
            if cpus <= 0:
                continue
            cpu_procs = [w for w in mine if w.gpu is None]
            for _ in range(spares_to_start(cpu_procs, node_cpus=cpus, per_node=self.warm_per_node)):
                self.start(node_id, spare=True)

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


def _owners(workers: Sequence[PooledWorker]) -> list[PooledWorker]:
    """The processes that own a GPU (a private one merely borrows its holder's)."""
    return [w for w in workers if w.gpu is not None and not w.private]


def _gpus_of(nodes: Sequence[dict[str, Any]]) -> dict[str, float]:
    return {
        n["NodeID"]: float(n.get("Resources", {}).get("GPU", 0.0)) for n in nodes if n.get("Alive")
    }


def _accepts(handle: Any, token: str) -> bool:
    """Whether a process takes this pool's token; False for one made by a runtime too old
    to give it a digest (its handle has no `accepts`)."""
    try:  # an old process: no such method on its handle, or an error raised by its call
        return bool(ray.get(handle.accepts.remote(token), timeout=_PING_TIMEOUT_S))
    except AttributeError:  # (Ray's error from a task is an instance of the task's error)
        return False


def _adopted_busy(w: PooledWorker) -> bool:
    return w.busy and w.lent_to is None and w.info is not None
