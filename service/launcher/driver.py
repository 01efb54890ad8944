"""The per-attempt driver: a detached, named Ray actor that runs `TorchTrainer.fit()`.

It lives in its own Ray worker process (never in the control plane), so `fit()` and the
torch it imports stay out of the API process. Rank 0 of the worker group pushes metrics,
checkpoint commits and events to it with fire-and-forget actor calls (no `ray.train.report`,
whose ~2 s throttle would slow training: RAY_NOTES.md); the scheduler drains them on every
pass. The train function is named by import path and resolved inside the actor process,
so `service` never imports `workers`.
"""

from __future__ import annotations

import os
import threading
import traceback
from pathlib import Path
from typing import Any

#: Ray Train settings for this attempt's controller.
DRIVER_ENV = {
    # The scheduler only launches a worker group that fits, so waiting for its workers
    # may take as long as process start-up takes (minutes on a loaded machine); Ray's
    # default of 60 s would abort and retry a start that is merely slow.
    "RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S": "600",
}

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
        spec: dict[str, Any],
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
        self._status = "starting"
        self._metrics: list[dict[str, Any]] = []
        self._commits: list[dict[str, Any]] = []
        self._events: list[dict[str, Any]] = []
        self._placement: dict[int, str] = {}
        self._placement_group: str | None = None
        self._pids: dict[int, int] = {}
        self._error: str | None = None
        self._worker_error: str | None = None
        self._resumed_from: int | None = None
        self._final_step: int | None = None
        self._control: list[str] = []  # queued one-shot requests: "checkpoint" | "stop"
        self._thread = threading.Thread(target=self._run, name="fit", daemon=True)
        self._thread.start()

    # -- called by rank 0 of the worker group -------------------------------------------------
    def push(self, kind: str, payload: dict[str, Any]) -> None:
        with self._lock:
            if kind == "metric":
                self._metrics.append(payload)
                if self._status == "starting":
                    self._status = "running"
            elif kind == "commit":
                self._commits.append(payload)
            elif kind == "placement":
                self._placement = {int(k): v for k, v in payload["ranks"].items()}
                self._placement_group = payload.get("placement_group")
                self._pids = {int(k): v for k, v in payload.get("pids", {}).items()}
            elif kind == "started":
                self._resumed_from = payload.get("resumed_from_step")
            elif kind == "error":
                # The first worker error is the cause; later ones are usually its echoes.
                if self._worker_error is None:
                    self._worker_error = payload["message"]
                self._events.append(
                    {"kind": "worker_error", "reason": payload["message"], "details": payload}
                )
            elif kind == "finished":
                self._final_step = payload.get("final_step")
            else:
                self._events.append(
                    {
                        "kind": payload.get("kind", kind),
                        "reason": payload.get("reason", ""),
                        "details": payload.get("details"),
                    }
                )

    def get_control(self) -> str:
        with self._lock:
            return self._control.pop(0) if self._control else "none"

    # -- called by the scheduler ------------------------------------------------------------------
    def request(self, what: str) -> None:
        with self._lock:
            if what not in self._control:
                self._control.append(what)

    def drain(self) -> dict[str, Any]:
        with self._lock:
            out = {
                "status": self._status,
                "metrics": self._metrics,
                "commits": self._commits,
                "events": self._events,
                "error": self._error,
                "resumed_from_step": self._resumed_from,
                "placement": dict(self._placement),
                "placement_group": self._placement_group,
                "pids": dict(self._pids),
                "final_step": self._final_step,
            }
            self._metrics, self._commits, self._events = [], [], []
            return out

    def ping(self) -> str:
        return self._status

    def placement_group_id(self) -> str | None:
        return self._placement_group

    # -- the fit thread -------------------------------------------------------------------------
    def _run(self) -> None:
        try:
            stopped_early = self._fit()
            with self._lock:
                self._status = "stopped" if stopped_early else "succeeded"
        except BaseException as exc:
            with self._lock:
                self._error = self._worker_error or _last_line(exc)
                self._status = "failed"

    def _fit(self) -> bool:
        # Set here rather than as the actor's runtime_env, so that the driver can start in
        # an already-running pooled Ray worker process (a runtime_env forces a fresh one);
        # TorchTrainer hands RAY_TRAIN_* variables of this process on to its controller.
        os.environ.update(DRIVER_ENV)
        from ray.train import FailureConfig, RunConfig, ScalingConfig

        TorchTrainer = _trainer_class()

        scaling = self.spec["scaling"]
        resources = {"CPU": float(scaling["cpus_per_worker"])}
        if scaling["use_gpu"]:
            resources["GPU"] = float(scaling["gpus_per_worker"])
        run_dir = Path(self.storage_path) / "jobs" / str(self.job_id) / "ray"
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
                use_gpu=bool(scaling["use_gpu"]),
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
        max_steps = int(self.spec["training"]["max_steps"])
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
            callbacks = super()._create_default_callbacks()
            return [c for c in callbacks if not isinstance(c, PlacementGroupCleanerCallback)]

    return ElastrainTorchTrainer


def _resolve(path: str):  # type: ignore[no-untyped-def]
    import importlib

    module, _, attr = path.partition(":")
    return getattr(importlib.import_module(module), attr)


def _last_line(exc: BaseException) -> str:
    """The most specific line of a (possibly nested, cross-process) error."""
    text = "".join(traceback.format_exception_only(type(exc), exc)).strip()
    lines = [line for line in text.splitlines() if line.strip()]
    return lines[-1] if lines else type(exc).__name__
