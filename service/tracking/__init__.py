"""Experiment trackers (MLflow, W&B): the control plane forwards what it has stored of a
tracked job (metric points, the spec as params, state changes) to the trackers its spec
names (`elastrain.contracts.spec.TrackingSpec`), so the workers need no tracker credentials.

`elastrain.service.tracking.forwarder` reads after commit and never writes a job's state; each
tracker's client package is an optional extra, imported only when a job uses it.
"""

from __future__ import annotations

import importlib.util

from elastrain.contracts.spec import TRACKER_EXTRAS, JobSpec, MlflowTracking, WandbTracking
from elastrain.service.tracking.base import Tracker


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


def make_tracker(name: str, spec: JobSpec) -> Tracker:
    """A tracker for one job's run (its client imported now, not at service start)."""
    config = getattr(spec.tracking, name)
    if isinstance(config, MlflowTracking):
        from elastrain.service.tracking.mlflow_tracker import MlflowTracker

        return MlflowTracker(config)
    if isinstance(config, WandbTracking):
        from elastrain.service.tracking.wandb_tracker import WandbTracker

        return WandbTracker(config)
    raise ValueError(f"tracking.{name}: not set in the job's spec")
