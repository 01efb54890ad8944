"""Experiment trackers (MLflow, W&B): the control plane forwards what it has stored of a
tracked job (metric points, the spec as params, state changes) to the trackers its spec
names (`elastrain.contracts.spec.TrackingSpec`), so the workers need no tracker credentials.

`elastrain.service.tracking.forwarder` reads after commit and never writes a job's state; each
tracker's client package is an optional extra, imported only when a job uses it.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable

from elastrain.contracts.spec import TRACKER_EXTRAS, JobSpec, MlflowTracking, WandbTracking
from elastrain.service.settings import Settings
from elastrain.service.tracking.base import Tracker, TrackerError
from elastrain.service.tracking.destinations import is_operator_tracker, mlflow_uri_problem


def missing_clients(spec: JobSpec) -> dict[str, str]:
    """The trackers `spec` names whose client package is not installed here: name -> the
    extra that installs it. Checked at submit, so the job is refused rather than accepted
    and never forwarded."""
    missing: dict[str, str] = {}
    for name in spec.tracking.names:
        module, extra = TRACKER_EXTRAS[name]
        if importlib.util.find_spec(module) is None:
            missing[name] = extra
    return missing


def make_tracker(name: str, spec: JobSpec, settings: Settings | None = None) -> Tracker:
    """A tracker for one job's run (its client imported now, not at service start).
    `settings`: the operator's trackers; the job's destination is checked against them
    again here (a job stored before a rule changed sends nothing: TrackerError), and the
    operator's credentials go to the operator's tracker only. Without settings (tests of
    the forwarder's own logic) the spec's URI is taken as it is."""
    config = getattr(spec.tracking, name)
    if isinstance(config, MlflowTracking):
        from elastrain.service.tracking.mlflow_tracker import MlflowTracker

        if settings is None:
            return MlflowTracker(config, uri=config.tracking_uri or "", credentials=True)
        problem = mlflow_uri_problem(
            config.tracking_uri,
            allowed=settings.allowed_trackers,
            operator_uri=settings.mlflow_tracking_uri,
        )
        if problem is not None:
            raise TrackerError(f"refused, nothing sent: {problem}")
        uri = config.tracking_uri or settings.mlflow_tracking_uri or ""
        return MlflowTracker(
            config, uri=uri, credentials=is_operator_tracker(uri, settings.mlflow_tracking_uri)
        )
    if isinstance(config, WandbTracking):
        from elastrain.service.tracking.wandb_tracker import WandbTracker

        return WandbTracker(config)
    raise ValueError(f"tracking.{name}: not set in the job's spec")


def tracker_maker(settings: Settings) -> Callable[[str, JobSpec], Tracker]:
    """`make_tracker` under the operator's settings, for the forwarder."""
    return lambda name, spec: make_tracker(name, spec, settings)
