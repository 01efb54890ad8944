"""The one module of the control plane that talks to Ray."""

from __future__ import annotations

import contextlib
import logging
from typing import Any

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from service.launcher.base import (
    ClusterCapacity,
    DriverReport,
    DriverStatus,
    LaunchRequest,
    NodeCapacity,
    driver_name,
)
from service.launcher.driver import JobDriver
from service.settings import Settings

log = logging.getLogger("elastrain.launcher")

_POLL_TIMEOUT_S = 10.0


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
            url = ray.get_runtime_context().worker.node.address_info.get("webui_url")  # type: ignore[union-attr]
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

    def _handle(self, job_id: int, attempt: int) -> Any | None:
        name = driver_name(job_id, attempt)
        if name not in self._handles:
            try:  # a restarted control plane re-attaches by name
                self._handles[name] = ray.get_actor(name, namespace=self.namespace)
            except ValueError:
                return None
        return self._handles[name]

    def poll(self, job_id: int, attempt: int) -> DriverReport:
        name = driver_name(job_id, attempt)
        handle = self._handle(job_id, attempt)
        if handle is None:
            return DriverReport(status=DriverStatus.LOST, error="driver actor not found")
        try:
            out = ray.get(handle.drain.remote(), timeout=_POLL_TIMEOUT_S)
        except ray.exceptions.GetTimeoutError:
            return DriverReport(status=self._last_status.get(name, DriverStatus.STARTING))
        except ray.exceptions.RayActorError as exc:
            self._handles.pop(name, None)
            return DriverReport(status=DriverStatus.LOST, error=f"driver died: {str(exc)[-300:]}")
        status = DriverStatus(out["status"])
        self._last_status[name] = status
        if out.get("placement_group"):
            self._placement_groups[name] = out["placement_group"]
        return DriverReport(
            status=status,
            metrics=out["metrics"],
            commits=out["commits"],
            events=out["events"],
            error=out["error"],
            resumed_from_step=out["resumed_from_step"],
            placement={int(k): v for k, v in out["placement"].items()},
            pids={int(k): v for k, v in out.get("pids", {}).items()},
            final_step=out["final_step"],
        )

    def request_checkpoint(self, job_id: int, attempt: int) -> None:
        handle = self._handle(job_id, attempt)
        if handle is not None:
            handle.request.remote("checkpoint")

    def request_stop(self, job_id: int, attempt: int) -> None:
        handle = self._handle(job_id, attempt)
        if handle is not None:
            handle.request.remote("stop")

    def kill(self, job_id: int, attempt: int) -> None:
        # Killing the driver takes its TorchTrainer controller and worker actors with it
        # (they are owned by the driver). Their placement group outlives them (it belongs
        # to the Ray job, not the actor), so it is removed here to free the resources now.
        name = driver_name(job_id, attempt)
        handle = self._handle(job_id, attempt)
        pg_id = self._placement_groups.get(name)
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

    def release(self, job_id: int, attempt: int) -> None:
        self.kill(job_id, attempt)
        name = driver_name(job_id, attempt)
        self._handles.pop(name, None)
        self._last_status.pop(name, None)
        self._placement_groups.pop(name, None)


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
