"""The one module of the control plane that talks to Ray."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Mapping
from typing import Any

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from contracts.messages import Control, DriverReport, DriverStatus, WorkerError
from service.capacity import ClusterCapacity, NodeCapacity
from service.launcher.base import AttemptKey, LaunchRequest, driver_name
from service.launcher.driver import JobDriver
from service.settings import Settings

log = logging.getLogger("elastrain.launcher")

#: How long one poll waits for all drivers together. A driver that has not answered by
#: then reports its last known status; the pass goes on (it holds no DB lock meanwhile).
_POLL_TIMEOUT_S = 5.0


class RayLauncher:
    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.namespace = settings.ray_namespace
        self._driver_cls: Any = None
        self._handles: dict[str, Any] = {}
        self._last_status: dict[str, DriverStatus] = {}
        self._placement_groups: dict[str, str] = {}  # driver name -> its worker group's PG
        self._connect()

    def _connect(self) -> None:
        if not ray.is_initialized():
            if self.settings.ray_address:
                ray.init(address=self.settings.ray_address, namespace=self.namespace)
            else:
                ray.init(
                    namespace=self.namespace,
                    num_cpus=self.settings.ray_num_cpus,
                    include_dashboard=False,
                )
        # Drivers are pinned (softly) to the head node, so that losing a worker node never
        # takes a driver (and the Ray Train controller next to it) with it. Not "the node
        # this process runs on": several raylets may share one IP, and Ray then attaches
        # a client to any of them.
        self._home_node = _head_node_id() or ray.get_runtime_context().get_node_id()
        self._driver_cls = ray.remote(JobDriver)

    # -- Launcher -----------------------------------------------------------------------------
    def capacity(self) -> ClusterCapacity:
        nodes = []
        for n in ray.nodes():
            res = n.get("Resources", {})
            nodes.append(
                NodeCapacity(
                    node_id=n["NodeID"],
                    address=n.get("NodeManagerAddress", ""),
                    alive=bool(n.get("Alive")),
                    cpus=float(res.get("CPU", 0.0)),
                    gpus=float(res.get("GPU", 0.0)),
                )
            )
        return ClusterCapacity(nodes=tuple(nodes), dashboard_url=self._dashboard_url())

    def _dashboard_url(self) -> str | None:
        try:
            url = ray.get_runtime_context().worker.node.address_info.get("webui_url")
        except Exception:
            return None
        return f"http://{url}" if url else None

    def launch(self, request: LaunchRequest) -> None:
        handle = self._driver_cls.options(
            name=request.driver_name,
            namespace=self.namespace,
            lifetime="detached",
            num_cpus=0,
            max_restarts=0,
            scheduling_strategy=NodeAffinitySchedulingStrategy(self._home_node, soft=True),
        ).remote(
            job_id=request.job_id,
            attempt=request.attempt,
            world_size=request.world_size,
            spec=request.spec,
            storage_path=request.storage_path,
            driver_name=request.driver_name,
            namespace=self.namespace,
        )
        self._handles[request.driver_name] = handle
        log.info("launched %s at world size %d", request.driver_name, request.world_size)

    def _handle(self, key: AttemptKey) -> Any | None:
        name = driver_name(*key)
        if name not in self._handles:
            try:  # a restarted control plane re-attaches by name
                self._handles[name] = ray.get_actor(name, namespace=self.namespace)
            except ValueError:
                return None
        return self._handles[name]

    def poll(self, acks: Mapping[AttemptKey, int]) -> dict[AttemptKey, DriverReport]:
        reports: dict[AttemptKey, DriverReport] = {}
        refs: dict[Any, AttemptKey] = {}
        for key, ack in acks.items():
            handle = self._handle(key)
            if handle is None:
                reports[key] = _lost(key, "driver actor not found")
            else:
                refs[handle.drain.remote(ack)] = key
        ready = (
            ray.wait(list(refs), num_returns=len(refs), timeout=_POLL_TIMEOUT_S)[0] if refs else []
        )
        for ref in refs:
            key = refs[ref]
            name = driver_name(*key)
            if ref not in ready:
                reports[key] = DriverReport(
                    status=self._last_status.get(name, DriverStatus.STARTING), seq=acks[key]
                )
                continue
            try:
                report: DriverReport = ray.get(ref)
            except ray.exceptions.RayActorError as exc:
                self._handles.pop(name, None)
                reports[key] = _lost(key, f"driver died: {str(exc)[-300:]}")
                continue
            self._last_status[name] = report.status
            if report.placement is not None and report.placement.placement_group:
                self._placement_groups[name] = report.placement.placement_group
            reports[key] = report
        return reports

    def send_control(self, key: AttemptKey, control: Control) -> None:
        handle = self._handle(key)
        if handle is not None:
            handle.request.remote(control)

    def release(self, key: AttemptKey) -> None:
        # Killing the driver takes its TorchTrainer controller and worker actors with it
        # (they are owned by the driver). Their placement group outlives them (it belongs
        # to the Ray job, not the actor), so it is removed here to free the resources now.
        name = driver_name(*key)
        handle = self._handle(key)
        pg_id = self._placement_groups.pop(name, None)
        if handle is not None:
            if pg_id is None:
                with contextlib.suppress(Exception):
                    pg_id = ray.get(handle.placement_group_id.remote(), timeout=2)
            try:
                ray.kill(handle, no_restart=True)
            except Exception as exc:
                log.warning("kill %s: %s", name, exc)
        # Also when the driver is already gone (it died with its node): its workers'
        # placement group would otherwise hold their CPUs on the surviving nodes.
        if pg_id:
            _remove_placement_group(pg_id)
        self._handles.pop(name, None)
        self._last_status.pop(name, None)


def _lost(key: AttemptKey, why: str) -> DriverReport:
    return DriverReport(status=DriverStatus.LOST, error=WorkerError(type="DriverLost", message=why))


def _head_node_id() -> str | None:
    for node in ray.nodes():
        if node.get("Alive") and "node:__internal_head__" in node.get("Resources", {}):
            return str(node["NodeID"])
    return None


def _remove_placement_group(pg_id: str) -> None:
    from ray._raylet import PlacementGroupID
    from ray.util.placement_group import PlacementGroup, remove_placement_group

    try:
        remove_placement_group(PlacementGroup(PlacementGroupID(bytes.fromhex(pg_id))))
    except Exception as exc:  # already removed (the run ended cleanly) is fine
        log.info("remove placement group %s: %s", pg_id, exc)
