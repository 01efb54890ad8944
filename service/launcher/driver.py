"""The per-attempt driver: a detached, named Ray actor that runs `TorchTrainer.fit()`.

It lives in its own Ray worker process (never in the control plane), so `fit()` and the
torch it imports stay out of the API process. Rank 0 of the worker group pushes typed
messages (`contracts.messages`: metrics, checkpoint commits, events) to it with
fire-and-forget actor calls (no `ray.train.report`, whose ~2 s throttle would slow
training); the driver numbers them, and the scheduler drains them on every pass and
acknowledges what it stored. The train function is named by import path and resolved inside the actor process,
so `service` never imports `workers`.
"""

from __future__ import annotations

import os
import threading

from contracts.messages import (
    Control,
    DriverReport,
    DriverStatus,
    Finished,
    Placement,
    Resumed,
    StepMetrics,
    WorkerError,
    WorkerFailed,
    WorkerMessage,
)
from contracts.spec import JobSpec
from contracts.storage import JobStorage

#: Ray Train settings for this attempt's controller.
DRIVER_ENV = {
    # The scheduler only launches a worker group that fits, so waiting for its workers
    # may take as long as process start-up takes (minutes on a loaded machine); Ray's
    # default of 60 s would abort and retry a start that is merely slow.
    "RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S": "600",
}

#: A report carries at most this many messages; the rest come with the next poll.
MAX_MESSAGES_PER_REPORT = 5000

#: What runs on every worker of the group, resolved inside the driver process.
TRAIN_FN = "workers.ray_entry:train_loop_per_worker"


class JobDriver:
    """Wrapped with `ray.remote` by the launcher (kept a plain class for readability)."""

    def __init__(
        self,
        *,
        job_id: int,
        attempt: int,
        world_size: int,
        spec: JobSpec,
        storage_path: str,
        driver_name: str,
        namespace: str,
    ) -> None:
        self.job_id = job_id
        self.attempt = attempt
        self.world_size = world_size
        self.spec = spec
        self.storage_path = storage_path
        self.driver_name = driver_name
        self.namespace = namespace
        self._lock = threading.Lock()
        self._status = DriverStatus.STARTING
        self._outbox: list[tuple[int, WorkerMessage]] = []  # (seq, message), not yet acked
        self._seq = 0
        self._placement: Placement | None = None
        self._resumed_from: int | None = None
        self._worker_error: WorkerError | None = None
        self._error: WorkerError | None = None
        self._final_step: int | None = None
        self._control: list[Control] = []  # queued one-shot requests
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name="fit", daemon=True)
        self._thread.start()

    # -- called by rank 0 of the worker group (and any rank's failure) -----------------------
    def push(self, message: WorkerMessage) -> None:
        with self._lock:
            self._seq += 1
            self._outbox.append((self._seq, message))
            if isinstance(message, StepMetrics) and self._status == DriverStatus.STARTING:
                self._status = DriverStatus.RUNNING
            elif isinstance(message, Placement):
                self._placement = message
            elif isinstance(message, Resumed):
                self._resumed_from = message.step
            elif isinstance(message, WorkerFailed) and self._worker_error is None:
                # The first worker error is the cause; later ones are usually its echoes.
                self._worker_error = message.error
            elif isinstance(message, Finished):
                self._final_step = message.final_step

    def get_control(self) -> Control:
        with self._lock:
            return self._control.pop(0) if self._control else Control.NONE

    # -- called by the scheduler ------------------------------------------------------------------
    def request(self, control: Control) -> None:
        with self._lock:
            if control == Control.STOP:
                if self._stopping:
                    return  # asked again (level-triggered): once is enough
                self._stopping = True
            if control not in self._control:
                self._control.append(control)

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

    def placement_group_id(self) -> str | None:
        with self._lock:
            return self._placement.placement_group if self._placement else None

    # -- the fit thread -------------------------------------------------------------------------
    def _run(self) -> None:
        try:
            stopped_early = self._fit()
            with self._lock:
                self._status = DriverStatus.STOPPED if stopped_early else DriverStatus.SUCCEEDED
        except BaseException as exc:
            with self._lock:
                self._error = self._worker_error or WorkerError.from_exception(exc)
                self._status = DriverStatus.FAILED

    def _fit(self) -> bool:
        # Set here rather than as the actor's runtime_env, so that the driver can start in
        # an already-running pooled Ray worker process (a runtime_env forces a fresh one);
        # TorchTrainer hands RAY_TRAIN_* variables of this process on to its controller.
        os.environ.update(DRIVER_ENV)
        from ray.train import FailureConfig, RunConfig, ScalingConfig

        TorchTrainer = _trainer_class()

        scaling = self.spec.scaling
        resources = {"CPU": float(scaling.cpus_per_worker)}
        if scaling.use_gpu:
            resources["GPU"] = float(scaling.gpus_per_worker)
        run_dir = JobStorage.of(self.storage_path, self.job_id).ray_runs
        trainer = TorchTrainer(
            train_loop_per_worker=_resolve(TRAIN_FN),
            train_loop_config={
                "job_id": self.job_id,
                "attempt": self.attempt,
                "spec": self.spec,
                "storage_path": self.storage_path,
                "driver_name": self.driver_name,
                "namespace": self.namespace,
            },
            scaling_config=ScalingConfig(
                num_workers=self.world_size,
                use_gpu=scaling.use_gpu,
                resources_per_worker=resources,
            ),
            # Restarts are the scheduler's: it picks the world size from the cluster it
            # sees, which is much faster than Ray Train's retry at the old size.
            run_config=RunConfig(
                name=f"attempt-{self.attempt:03d}",
                storage_path=str(run_dir),
                failure_config=FailureConfig(max_failures=0),
            ),
        )
        result = trainer.fit()
        if getattr(result, "error", None) is not None:
            raise result.error
        with self._lock:
            final = self._final_step
        max_steps = self.spec.training.max_steps
        return final is not None and final < max_steps


def _trainer_class():  # type: ignore[no-untyped-def]
    """TorchTrainer without Ray Train's PlacementGroupCleaner.

    That cleaner is a detached actor per run which polls the State API to notice a dead
    controller; without the Ray dashboard (ray[train] has none) the API never answers, so
    after every killed attempt the cleaner spins forever and the worker group's placement
    group is never freed (the next attempt then waits 60 s for resources). The launcher
    removes the placement group itself when it kills a driver, so the cleaner is dropped.
    """
    from ray.train.torch import TorchTrainer
    from ray.train.v2._internal.callbacks.placement_group_callback import (
        PlacementGroupCleanerCallback,
    )

    class ElastrainTorchTrainer(TorchTrainer):
        def _create_default_callbacks(self):  # type: ignore[no-untyped-def]
            callbacks = super()._create_default_callbacks()  # type: ignore[misc]
            return [c for c in callbacks if not isinstance(c, PlacementGroupCleanerCallback)]

    return ElastrainTorchTrainer


def _resolve(path: str):  # type: ignore[no-untyped-def]
    import importlib

    module, _, attr = path.partition(":")
    return getattr(importlib.import_module(module), attr)
