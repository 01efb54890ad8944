"""The function every Ray Train worker runs: wires Ray to the plain-torch training loop.

Only glue lives here: build the `TrainContext` from Ray Train's context, hooks that push
to this attempt's driver actor, and error reporting with rank and node. The loop itself
(`workers.loop.train`) knows nothing of Ray.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import traceback
from pathlib import Path
from typing import Any

import ray
import torch
import torch.distributed as dist

from workers.api import Control, TrainContext


class DriverHooks:
    """`TrainHooks` for rank 0: fire-and-forget calls to the driver actor, never blocking
    the training step (control requests are fetched one step late, asynchronously)."""

    def __init__(self, driver: Any) -> None:
        self.driver = driver
        self._control_ref: Any = None

    def push(self, kind: str, payload: dict[str, Any]) -> None:
        self.driver.push.remote(kind, payload)

    def report_metrics(self, point: dict[str, Any]) -> None:
        self.push("metric", point)

    def checkpoint_committed(self, info: dict[str, Any]) -> None:
        self.push("commit", info)

    def event(self, kind: str, reason: str, details: dict[str, Any] | None = None) -> None:
        self.push("event", {"kind": kind, "reason": reason, "details": details})
        if kind == "resumed" and details is not None:
            self.push("started", {"resumed_from_step": details.get("step")})

    def poll_control(self) -> Control:
        if self._control_ref is None:
            self._control_ref = self.driver.get_control.remote()
            return Control.NONE
        ready, _ = ray.wait([self._control_ref], timeout=0)
        if not ready:
            return Control.NONE
        value = ray.get(self._control_ref)
        self._control_ref = self.driver.get_control.remote()
        return Control(value)


class _SilentHooks:
    """Ranks other than 0 report nothing (rank 0 speaks for the group)."""

    def report_metrics(self, point: dict[str, Any]) -> None: ...

    def checkpoint_committed(self, info: dict[str, Any]) -> None: ...

    def event(self, kind: str, reason: str, details: dict[str, Any] | None = None) -> None: ...

    def poll_control(self) -> Control:
        return Control.NONE


def train_loop_per_worker(config: dict[str, Any]) -> None:
    from workers.loop import train

    spec: dict[str, Any] = config["spec"]
    scaling = spec["scaling"]
    # Fractional CPUs per worker on small machines: never oversubscribe with threads.
    torch.set_num_threads(max(1, int(scaling["cpus_per_worker"])))

    train_ctx = ray.train.get_context()
    rank = train_ctx.get_world_rank()
    world_size = train_ctx.get_world_size()
    local_rank = train_ctx.get_local_rank()
    device = ray.train.torch.get_device() if scaling["use_gpu"] else torch.device("cpu")
    node_id = ray.get_runtime_context().get_node_id()

    job_root = Path(config["storage_path"]) / "jobs" / str(config["job_id"])
    log_path = job_root / "logs" / f"attempt-{config['attempt']:03d}-rank-{rank}.log"
    log_path.parent.mkdir(parents=True, exist_ok=True)
    ctx = TrainContext(
        rank=rank,
        world_size=world_size,
        local_rank=local_rank,
        device=device,
        job_id=int(config["job_id"]),
        attempt=int(config["attempt"]),
        checkpoint_root=job_root / "checkpoints",
        log_path=log_path,
    )
    driver = ray.get_actor(config["driver_name"], namespace=config["namespace"])
    hooks = DriverHooks(driver) if rank == 0 else _SilentHooks()

    # Which node holds which rank: the scheduler needs it to see node loss at once.
    nodes: list[Any] = [None] * world_size
    dist.all_gather_object(nodes, (node_id, os.getpid()))
    if rank == 0:
        pg = ray.util.get_current_placement_group()
        driver.push.remote(
            "placement",
            {
                "ranks": {str(r): n for r, (n, _) in enumerate(nodes)},
                "pids": {str(r): pid for r, (_, pid) in enumerate(nodes)},
                "placement_group": pg.id.hex() if pg is not None else None,
            },
        )

    try:
        result = train(ctx, spec, hooks)
    except BaseException as exc:
        message = (
            f"rank {rank} on node {node_id[:12]} ({socket.gethostname()}, pid {os.getpid()}): "
            + _last_line(exc)
        )
        logging.getLogger("elastrain.worker").error("%s\n%s", message, traceback.format_exc())
        # Waited for (briefly), so the cause is at the driver before fit() returns.
        _push_and_wait(
            driver,
            "error",
            {
                "message": message,
                "rank": rank,
                "node_id": node_id,
                "traceback": traceback.format_exc()[-4000:],
            },
        )
        raise
    if rank == 0:
        _push_and_wait(
            driver,
            "finished",
            {"final_step": result.final_step, "stopped_early": result.stopped_early},
        )


def _push_and_wait(driver: Any, kind: str, payload: dict[str, Any]) -> None:
    # The driver may be gone (a cancel); then there is nobody left to tell.
    with contextlib.suppress(Exception):
        ray.get(driver.push.remote(kind, payload), timeout=10)


def _last_line(exc: BaseException) -> str:
    lines = [
        ln for ln in traceback.format_exception_only(type(exc), exc)[-1].splitlines() if ln.strip()
    ]
    return lines[-1] if lines else type(exc).__name__
