"""The one module of the control plane that talks to Ray: the runtime actor
(`elastrain.workers.runtime.actor`, which runs the attempts) is created here, launched into once per
attempt and reconciled with once per scheduler pass; exports run here as Ray tasks. Its
class and the export task are the names the control plane imports from `workers`
(tests/unit/test_imports.py): their modules load no torch."""

from __future__ import annotations

import logging
import time
from dataclasses import replace
from typing import Any

import ray
from ray.exceptions import GetTimeoutError, RayError
from ray.experimental import internal_kv
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from elastrain.contracts.capability import control_token
from elastrain.contracts.group import WorkerInfo
from elastrain.contracts.messages import Control, DriverReport, DriverStatus, ErrorKind, WorkerError
from elastrain.contracts.runtime import (
    NOTICE_KV_NAMESPACE,
    NOTICE_KV_PREFIX,
    RUNTIME_NAME,
    AttemptKey,
    ExportOutcome,
    ExportRequest,
    LaunchRequest,
    PreemptionNotice,
    Reconcile,
)
from elastrain.service.capacity import (
    ClusterCapacity,
    DrainSource,
    NodeCapacity,
    NodeDrain,
    warming_nodes,
)
from elastrain.service.settings import Settings
from elastrain.service.worker_env import scrubbed_environ
from elastrain.workers.export_task import run_export
from elastrain.workers.runtime.actor import Runtime

log = logging.getLogger("elastrain.launcher")

#: How long one reconcile waits for the runtime. When it has not answered by then, every
#: attempt reports its last known status; the pass goes on (it holds no DB lock meanwhile).
_RECONCILE_TIMEOUT_S = 5.0
_CALL_TIMEOUT_S = 30.0
#: How long a runtime just created (or restarted by Ray) may take to answer its first call:
#: its process must start and import torch first, which took over 30 s on a loaded 2-core
#: CI machine while a killed runtime's pool processes were being torn down.
_START_TIMEOUT_S = 180.0
#: How long a replaced runtime's name may take to come free.
_REPLACE_TIMEOUT_S = 30.0


class RuntimeClient:
    def __init__(self, settings: Settings, control_key: bytes) -> None:
        """`control_key`: the database's (`elastrain.service.identity.runtime_control_key`);
        the runtime is created with it and answers only calls that carry its token."""
        self.settings = settings
        self._control_key = control_key
        self._token = control_token(control_key)
        self.namespace = settings.ray_namespace
        self._last_status: dict[AttemptKey, DriverStatus] = {}
        self._ready_nodes: frozenset[str] | None = None  # as the last reconcile said
        self._first_seen: dict[str, float] = {}  # node id -> when capacity() first saw it
        # The same and when it was first reported ready, as wall clock: where the timeline
        # of a grow onto the node starts (`elastrain.service.capacity.grow_joins`). Nodes up
        # before the first capacity() joined at a time not known (None): after a restart of
        # the control plane they are no join.
        self._joined_at: dict[str, float | None] = {}
        self._listed_once = False
        self._warm_at: dict[str, float] = {}
        self._connect()

    def _connect(self) -> None:
        if not ray.is_initialized():
            if self.settings.ray_address:
                ray.init(address=self.settings.ray_address, namespace=self.namespace)
            else:
                # The local Ray's processes, and so every job's worker, start without the
                # service's secrets (service/worker_env.py).
                with scrubbed_environ(self.settings.secrets):
                    ray.init(
                        namespace=self.namespace,
                        num_cpus=self.settings.ray_num_cpus,
                        include_dashboard=False,
                    )
        self.runtime = self._runtime()

    def _runtime(self) -> Any:
        """The cluster's runtime actor, created on first use and found by name after a
        control-plane restart. Pinned to the head node, so that losing a worker node never
        takes the drivers with it: by the head's own resource, `node:__internal_head__`,
        which follows the head even when it is replaced (GCS fault tolerance). (A soft
        node-affinity to a head with 0 CPUs, as we had, let Ray place it on a worker node:
        seen on real multi-host clusters, tests/chaos/test_partitions.py.) Without a head
        resource (a client attached oddly), softly to this process's node.
        Ray restarts it if its process dies (it then adopts the worker processes), with the
        control key it was created with. One found by name that does not take this control
        plane's token (made by another database's control plane, or by a version before
        capabilities) is replaced: it would refuse every call."""
        handle = self._create_runtime()
        if _owned_by(handle, self._token):
            return handle
        log.warning(
            "replacing the runtime actor %s: it was made with another control key (another "
            "database's control plane, or an older version) and would refuse this one",
            RUNTIME_NAME,
        )
        ray.kill(handle, no_restart=True)
        deadline = time.monotonic() + _REPLACE_TIMEOUT_S
        while time.monotonic() < deadline:
            try:
                ray.get_actor(RUNTIME_NAME, namespace=self.namespace)
            except ValueError:
                break  # the name is free
            time.sleep(0.2)
        handle = self._create_runtime()
        if not _owned_by(handle, self._token):
            raise RuntimeError(f"the runtime actor {RUNTIME_NAME} refuses this control plane")
        return handle

    def _create_runtime(self) -> Any:
        placement: dict[str, Any]
        if _head_node_id() is not None:
            placement = {"resources": {HEAD_RESOURCE: 0.001}}
        else:
            here = ray.get_runtime_context().get_node_id()
            placement = {"scheduling_strategy": NodeAffinitySchedulingStrategy(here, soft=True)}
        return (
            ray.remote(Runtime)
            .options(
                name=RUNTIME_NAME,
                namespace=self.namespace,
                lifetime="detached",
                get_if_exists=True,
                num_cpus=0,
                max_concurrency=64,
                max_restarts=-1,
                **placement,
            )
            .remote(
                control_key=self._control_key,
                namespace=self.namespace,
                warm_per_node=self.settings.warm_workers_per_node,
                collective_timeout_s=self.settings.collective_timeout_s,
                preemption_notice=self.settings.preemption_notice,
            )
        )

    # -- Launcher -----------------------------------------------------------------------------
    def capacity(self) -> ClusterCapacity:
        now, wall = time.monotonic(), time.time()
        listed = ray.nodes()
        alive = [n["NodeID"] for n in listed if n.get("Alive")]
        known, self._listed_once = self._listed_once, True
        for node_id in alive:
            self._first_seen.setdefault(node_id, now)
            self._joined_at.setdefault(node_id, wall if known else None)
        self._first_seen = {n: self._first_seen[n] for n in alive}
        self._joined_at = {n: self._joined_at[n] for n in alive}
        self._warm_at = {n: t for n, t in self._warm_at.items() if n in self._joined_at}
        # The longest a running job waits for a new node's warm processes before growing
        # onto it anyway (its attempt then waits for a process there itself).
        wait_s = self.settings.grow_warm_wait_s
        warming = warming_nodes(alive, self._ready_nodes, self._first_seen, now=now, wait_s=wait_s)
        nodes = []
        for n in listed:
            res = n.get("Resources", {})
            nodes.append(
                NodeCapacity(
                    node_id=n["NodeID"],
                    address=n.get("NodeManagerAddress", ""),
                    alive=bool(n.get("Alive")),
                    cpus=float(res.get("CPU", 0.0)),
                    gpus=float(res.get("GPU", 0.0)),
                    memory_bytes=int(res.get("memory", 0)),
                    warming=n["NodeID"] in warming,
                    joined_at=self._joined_at.get(n["NodeID"]),
                    warm_at=self._warm_at.get(n["NodeID"]),
                )
            )
        return ClusterCapacity(
            nodes=tuple(nodes), dashboard_url=self._dashboard_url(), drains=ray_drains()
        )

    def _dashboard_url(self) -> str | None:
        try:
            url = ray.get_runtime_context().worker.node.address_info.get("webui_url")
        except Exception:
            return None
        return f"http://{url}" if url else None

    def launch(self, request: LaunchRequest) -> None:
        request = replace(request, sent_at=time.time())
        ray.get(self.runtime.launch.remote(self._token, request), timeout=_CALL_TIMEOUT_S)
        log.info("launched %s at world size %d", request.name, request.world_size)

    def reconcile(self, want: Reconcile) -> dict[AttemptKey, DriverReport]:
        try:
            answer = ray.get(
                self.runtime.reconcile.remote(self._token, want), timeout=_RECONCILE_TIMEOUT_S
            )
        except ray.exceptions.GetTimeoutError:
            return {
                k: DriverReport(status=self._last_status.get(k, DriverStatus.STARTING), seq=a.ack)
                for k, a in want.attempts.items()
            }
        except ray.exceptions.RayActorError as exc:
            self.runtime = self._runtime()
            return {k: _lost(f"runtime died: {str(exc)[-300:]}") for k in want.attempts}
        self._ready_nodes = answer.ready_nodes
        seen_at, warm_at = time.time(), getattr(answer, "warm_at", None) or {}  # None: older
        for node_id in answer.ready_nodes or ():
            if node_id in self._joined_at:  # alive at the last capacity()
                # The process's own clock if the runtime said it, else when we heard.
                self._warm_at.setdefault(node_id, warm_at.get(node_id) or seen_at)
        for name in answer.released:
            log.warning("the runtime released %s: its attempt is not live in the database", name)
        for job_id in answer.forgotten_jobs:
            log.info("the runtime's processes dropped job %s's state: not unfinished", job_id)
        for name in answer.removed_groups:
            log.warning("the runtime removed placement group %s: no live attempt owned it", name)
        reports: dict[AttemptKey, DriverReport] = {}
        for key in want.attempts:
            report = answer.reports.get(key)
            if report is None:
                reports[key] = _lost("the runtime does not hold this attempt")
                continue
            self._last_status[key] = report.status
            reports[key] = report
        self._last_status = {k: v for k, v in self._last_status.items() if k in want.attempts}
        return reports

    def send_control(self, key: AttemptKey, control: Control) -> None:
        self.runtime.request.remote(self._token, key, control)

    def release(self, key: AttemptKey, *, final: bool = False) -> None:
        # Synchronous: the attempt's placement group is gone before anything is launched
        # into the resources it held.
        ray.get(self.runtime.release.remote(self._token, key, final), timeout=_CALL_TIMEOUT_S)
        self._last_status.pop(key, None)

    def export(self, request: ExportRequest) -> ExportOutcome:
        # A Ray task of the workers' user, not the API: the checkpoint is the job's to
        # write, so it is read where the job's code runs, with its rights
        # (elastrain.workers.export_task). No CPU asked: exports at once are bounded by
        # the API's export slots, and one must not queue behind the job it exports from.
        task = ray.remote(run_export).options(num_cpus=0, max_retries=0)
        ref = task.remote(request)
        try:
            outcome = ray.get(ref, timeout=request.timeout_s + _CALL_TIMEOUT_S)
        except GetTimeoutError:
            ray.cancel(ref, force=True)
            return ExportOutcome(failed=f"the export took longer than {request.timeout_s:.0f} s")
        except RayError as exc:  # its worker died, the node went
            return ExportOutcome(failed="the export task failed", details=str(exc)[-2000:])
        assert isinstance(outcome, ExportOutcome)
        return outcome

    def workers(self) -> list[WorkerInfo]:
        """The runtime's pool processes (for tests, benches and debugging)."""
        return list(ray.get(self.runtime.workers.remote(self._token), timeout=_CALL_TIMEOUT_S))


def _owned_by(handle: Any, token: str) -> bool:
    """Whether the runtime behind `handle` takes `token`; False for one too old to check
    (its handle has no `owned_by`). The first call to a runtime: it waits for its start."""
    try:  # an old runtime: no such method on its handle, or an error raised by its call
        return bool(ray.get(handle.owned_by.remote(token), timeout=_START_TIMEOUT_S))
    except AttributeError:  # (Ray's error from a task is an instance of the task's error)
        return False


def _lost(why: str) -> DriverReport:
    return DriverReport(
        status=DriverStatus.LOST,
        error=WorkerError(type="DriverLost", kind=ErrorKind.DRIVER_LOST, message=why),
    )


def ray_drains() -> tuple[NodeDrain, ...]:
    """Nodes Ray is draining (its drain API, which the autoscaler, KubeRay's scale-down,
    `ray drain-node` and `elastrain.workers.runtime.notice` call), with their deadlines. Read the
    way Ray Serve and Ray Data read it (`ray._private.state`: Ray has no public API for
    it yet); a Ray without it reports none."""
    try:
        draining: dict[str, int] = ray._private.state.state.get_draining_nodes()
    except Exception as exc:  # an older or newer Ray: drains from Ray go unseen
        log.debug("cannot read Ray's draining nodes: %s", exc)
        return ()
    notices = preemption_notices()
    return tuple(
        notices.get(node_id)
        or NodeDrain(
            node_id=node_id,
            reason="drained by Ray (autoscaler, KubeRay scale-down or ray drain-node)",
            deadline=deadline_ms / 1000 if deadline_ms else None,
            source=DrainSource.RAY,
        )
        for node_id, deadline_ms in sorted(draining.items())
    )


def preemption_notices() -> dict[str, NodeDrain]:
    """The preemption notices `elastrain.workers.runtime.notice` left in Ray's KV store, by node."""
    found: dict[str, NodeDrain] = {}
    try:
        for key in internal_kv._internal_kv_list(NOTICE_KV_PREFIX, namespace=NOTICE_KV_NAMESPACE):
            raw = internal_kv._internal_kv_get(key, namespace=NOTICE_KV_NAMESPACE)
            if raw:
                notice = PreemptionNotice.from_json(raw)
                found[notice.node_id] = NodeDrain(
                    node_id=notice.node_id,
                    reason=notice.reason,
                    deadline=notice.deadline,
                    source=DrainSource.PREEMPTION,
                )
    except Exception as exc:  # a notice we cannot read: the drain shows as Ray's
        log.debug("cannot read preemption notices: %s", exc)
    return found


HEAD_RESOURCE = "node:__internal_head__"


def _head_node_id() -> str | None:
    for node in ray.nodes():
        if node.get("Alive") and HEAD_RESOURCE in node.get("Resources", {}):
            return str(node["NodeID"])
    return None
