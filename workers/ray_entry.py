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
from typing import Any

import ray
import ray.train
import ray.train.torch
import torch
import torch.distributed as dist

from contracts.messages import (
    Control,
    Finished,
    Placement,
    WorkerError,
    WorkerFailed,
    WorkerMessage,
)
from contracts.spec import JobSpec
from contracts.storage import JobStorage
from workers.api import TrainContext

#: How long a rank waits for the driver to take its last word (error or finish).
_LAST_WORD_TIMEOUT_S = 10


class DriverHooks:
    """`TrainHooks` for rank 0: fire-and-forget calls to the driver actor, never blocking
    the training step (control requests are fetched one step late, asynchronously)."""

    def __init__(self, driver: Any) -> None:
        self.driver = driver
        self._control_ref: Any = None

    def send(self, message: WorkerMessage) -> None:
        self.driver.push.remote(message)

    def poll_control(self) -> Control:
        if self._control_ref is None:
            self._control_ref = self.driver.get_control.remote()
            return Control.NONE
        ready, _ = ray.wait([self._control_ref], timeout=0)
        if not ready:
            return Control.NONE
        value = ray.get(self._control_ref)
        self._control_ref = self.driver.get_control.remote()
        return Control(value)  # a Control, or its value as a plain string


class _SilentHooks:
    """Ranks other than 0 report nothing (rank 0 speaks for the group)."""

    def send(self, message: WorkerMessage) -> None: ...

    def poll_control(self) -> Control:
        return Control.NONE


def train_loop_per_worker(config: dict[str, Any]) -> None:
    from workers.loop import train

    spec = config["spec"]
    if not isinstance(spec, JobSpec):
        spec = JobSpec.model_validate(spec)
    scaling = spec.scaling
    # Fractional CPUs per worker on small machines: never oversubscribe with threads.
    torch.set_num_threads(max(1, int(scaling.cpus_per_worker)))

    train_ctx = ray.train.get_context()
    rank = train_ctx.get_world_rank()
    world_size = train_ctx.get_world_size()
    local_rank = train_ctx.get_local_rank()
    device = ray.train.torch.get_device() if scaling.use_gpu else torch.device("cpu")
    node_id = ray.get_runtime_context().get_node_id()

    job_id, attempt = int(config["job_id"]), int(config["attempt"])
    storage = JobStorage.of(config["storage_path"], job_id)
    log_path = storage.log_file(attempt=attempt, rank=rank)
    log_path.parent.mkdir(parents=True, exist_ok=True)
    ctx = TrainContext(
        rank=rank,
        world_size=world_size,
        local_rank=local_rank,
        device=device,
        job_id=job_id,
        attempt=attempt,
        checkpoint_root=storage.checkpoints,
        log_path=log_path,
    )
    driver = ray.get_actor(config["driver_name"], namespace=config["namespace"])
    hooks = DriverHooks(driver) if rank == 0 else _SilentHooks()

    # Which node holds which rank: the scheduler needs it to see node loss at once.
    nodes: list[Any] = [None] * world_size
    dist.all_gather_object(nodes, (node_id, os.getpid()))
    if rank == 0:
        pg = ray.util.get_current_placement_group()
        hooks.send(
            Placement(
                nodes={r: n for r, (n, _) in enumerate(nodes)},
                pids={r: pid for r, (_, pid) in enumerate(nodes)},
                placement_group=pg.id.hex() if pg is not None else None,
            )
        )

    try:
        result = train(ctx, spec, hooks)
    except BaseException as exc:
        error = WorkerError.from_exception(
            exc,
            rank=rank,
            node_id=node_id,
            hostname=socket.gethostname(),
            pid=os.getpid(),
            step=ctx.step,
            traceback=traceback.format_exc()[-4000:],
        )
        logging.getLogger("elastrain.worker").error("%s\n%s", error.summary(), error.traceback)
        # Waited for (briefly), so the cause is at the driver before fit() returns.
        _push_and_wait(driver, WorkerFailed(error=error))
        raise
    if rank == 0:
        _push_and_wait(
            driver, Finished(final_step=result.final_step, stopped_early=result.stopped_early)
        )


def _push_and_wait(driver: Any, message: WorkerMessage) -> None:
    # The driver may be gone (a cancel); then there is nobody left to tell.
    with contextlib.suppress(Exception):
        ray.get(driver.push.remote(message), timeout=_LAST_WORD_TIMEOUT_S)
