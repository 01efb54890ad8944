"""MLflow: one run per job in the spec's experiment, through `MlflowClient` (no global
active run, so many jobs' runs are forwarded from one thread without stepping on each
other)."""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Callable, Iterator, Sequence
from datetime import datetime
from typing import TypeVar

from mlflow.entities import Metric, Param, RunStatus, RunTag
from mlflow.exceptions import MlflowException
from mlflow.tracking import MlflowClient

from elastrain.contracts.spec import MlflowTracking
from elastrain.service.states import JobState
from elastrain.service.tracking.base import Change, Point, RunInfo, TrackerError

#: What `log_batch` takes at once (MLflow's own limits: 1000 metrics, 100 params).
_METRICS_PER_BATCH = 1000
_PARAMS_PER_BATCH = 100

_END_STATUS = {
    JobState.SUCCEEDED: RunStatus.to_string(RunStatus.FINISHED),
    JobState.FAILED: RunStatus.to_string(RunStatus.FAILED),
    JobState.CANCELLED: RunStatus.to_string(RunStatus.KILLED),
}

T = TypeVar("T")

#: What MLflow's REST client reads from the environment at every request to authenticate.
CREDENTIAL_VARIABLES = (
    "MLFLOW_TRACKING_TOKEN",
    "MLFLOW_TRACKING_USERNAME",
    "MLFLOW_TRACKING_PASSWORD",
    "MLFLOW_TRACKING_CLIENT_CERT_PATH",
    "MLFLOW_TRACKING_SERVER_CERT_PATH",
    "MLFLOW_TRACKING_AUTH",
    "DATABRICKS_TOKEN",
    "DATABRICKS_HOST",
)
_env_lock = threading.Lock()


@contextlib.contextmanager
def without_operator_credentials() -> Iterator[None]:
    """The operator's MLflow credentials out of the environment while inside: a call to a
    tracker other than the operator's carries none. (MLflow reads them per request from
    `os.environ`; the forwarder is the one thread that calls MLflow.)"""
    with _env_lock:
        saved = {name: os.environ.pop(name) for name in CREDENTIAL_VARIABLES if name in os.environ}
        try:
            yield
        finally:
            os.environ.update(saved)


def _chunks(items: Sequence[T], size: int) -> Iterator[Sequence[T]]:
    for start in range(0, len(items), size):
        yield items[start : start + size]


def _ms(at: datetime) -> int:
    return int(at.timestamp() * 1000)


class MlflowTracker:
    name = "mlflow"

    def __init__(self, config: MlflowTracking, *, uri: str, credentials: bool) -> None:
        """`uri`: where to forward; `credentials`: whether the operator's MLflow
        credentials (in the service's environment) may go there: only to the operator's
        own tracker (`elastrain.service.tracking.destinations`)."""
        self.config = config
        self.uri = uri
        self.credentials = credentials
        self.client = MlflowClient(tracking_uri=uri)
        self.run_id: str | None = None

    def open(self, run: RunInfo, run_id: str | None) -> str:
        with self._auth():
            return self._open(run, run_id)

    def _auth(self) -> contextlib.AbstractContextManager[None]:
        return contextlib.nullcontext() if self.credentials else without_operator_credentials()

    def _open(self, run: RunInfo, run_id: str | None) -> str:
        try:
            if run_id is not None:
                self.client.get_run(run_id)  # still there: go on with it
                self.run_id = run_id
                return run_id
            made = self.client.create_run(
                self._experiment_id(), run_name=run.run_name, tags=run.tags
            )
            self.run_id = made.info.run_id
            params = [Param(k, v) for k, v in sorted(run.params.items())]
            for chunk in _chunks(params, _PARAMS_PER_BATCH):
                self.client.log_batch(self.run_id, params=list(chunk))
        except MlflowException as exc:
            raise TrackerError(f"mlflow: {exc.message}") from exc
        return self.run_id

    def _experiment_id(self) -> str:
        name = self.config.experiment
        found = self.client.get_experiment_by_name(name)
        if found is not None:
            return str(found.experiment_id)
        try:
            return str(self.client.create_experiment(name))
        except MlflowException:
            # Another forwarder (or a person) made it meanwhile.
            found = self.client.get_experiment_by_name(name)
            if found is None:
                raise
            return str(found.experiment_id)

    def log_points(self, points: Sequence[Point]) -> None:
        metrics = [
            Metric(key, value, _ms(p.at), p.step) for p in points for key, value in p.values.items()
        ]
        for chunk in _chunks(metrics, _METRICS_PER_BATCH):
            self._log_batch(metrics=list(chunk))

    def log_changes(self, changes: Sequence[Change]) -> None:
        if not changes:
            return
        tags: dict[str, str] = {}
        metrics = []
        for change in changes:
            # Every transition kept (its own tag, in order), and where the job is now.
            tags[f"elastrain.transition.{change.event_id:09d}"] = (
                f"{change.from_state or '-'} -> {change.to_state}: {change.reason}"
            )[:5000]
            tags["elastrain.state"] = change.to_state
            tags["elastrain.state_reason"] = change.reason[:5000]
            if change.world_size is not None:
                metrics.append(
                    Metric("world_size", change.world_size, _ms(change.at), change.step or 0)
                )
        run_tags = [RunTag(k, v) for k, v in tags.items()]
        for chunk in _chunks(run_tags, _PARAMS_PER_BATCH):
            self._log_batch(tags=list(chunk))
        if metrics:
            self._log_batch(metrics=metrics)

    def finish(self, state: JobState, at: datetime | None) -> None:
        status = _END_STATUS.get(state, RunStatus.to_string(RunStatus.FAILED))
        end = _ms(at) if at is not None else None
        self._call(lambda: self.client.set_terminated(self._run(), status, end_time=end))

    def close(self) -> None:
        self.run_id = None  # nothing held locally: the client keeps no connection open

    def _run(self) -> str:
        if self.run_id is None:
            raise TrackerError("mlflow: the run was not opened")
        return self.run_id

    def _log_batch(self, *, metrics: Sequence[Metric] = (), tags: Sequence[RunTag] = ()) -> None:
        self._call(
            lambda: self.client.log_batch(self._run(), metrics=list(metrics), tags=list(tags))
        )

    def _call(self, fn: Callable[[], object]) -> None:
        try:
            with self._auth():
                fn()
        except MlflowException as exc:
            raise TrackerError(f"mlflow: {exc.message}") from exc
